"""`python -m raypar.train [--config FILE] [section.key=value ...]`: same as `raypar train`."""
import sys

from raypar.driver.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))

import sys

from raypar.driver.cli import main

sys.exit(main())

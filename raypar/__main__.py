import sys

from raypar.cli import main

sys.exit(main())

"""`python -m mtpkit ...`: the same command line as the `mtpkit` script."""

import sys

from mtpkit.cli import main

if __name__ == "__main__":
    sys.exit(main())

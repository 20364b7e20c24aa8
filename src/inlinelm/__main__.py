"""``python -m inlinelm``: the same command as ``inlinelm``."""

import sys

from inlinelm.cli import main

if __name__ == "__main__":
    sys.exit(main())

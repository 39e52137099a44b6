"""``python -m pykeen_bess``: see :mod:`pykeen_bess.cli`."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())

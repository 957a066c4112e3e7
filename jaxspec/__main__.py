"""`python -m jaxspec` -> the `jaxspec` command line."""

import sys

from jaxspec.cli import main

if __name__ == "__main__":
    sys.exit(main())

"""``python -m ctxpar.cli``: the ``ctxpar`` command (ctxpar/entrypoints/cli/main.py)."""

import sys

from ctxpar.entrypoints.cli.main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

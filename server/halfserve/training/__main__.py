"""``python -m halfserve.training RECIPE ...``: the ``train`` subcommand without the rest of the CLI."""

from __future__ import annotations

import sys

from halfserve.training.cli import main

if __name__ == "__main__":
    sys.exit(main())

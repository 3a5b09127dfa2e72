"""`python -m megatrain.launch.cli`: the launcher, as the console script `megatrain-launch` runs it (the
module for machines where the script is not on PATH, and for run-default.sh)."""

from __future__ import annotations

import sys

from megatrain.launch.cli.main import main

if __name__ == "__main__":
    sys.exit(main())

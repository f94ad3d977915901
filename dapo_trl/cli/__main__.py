"""`python -m dapo_trl.cli`: the same command line as `train_dapo.py` and `dapo-train`."""

import sys

from .train import main

if __name__ == "__main__":
    sys.exit(main())

"""Moved to `dapo_trl.config.reference` (`python -m dapo_trl.config.reference [--check]`); this name still runs it
and still imports, with a warning."""

import sys
import warnings

from .config.reference import *  # noqa: F403 - the moved module's public names
from .config.reference import main

_MOVED = "dapo_trl.config_reference moved to dapo_trl.config.reference (`python -m dapo_trl.config.reference`)"

if __name__ == "__main__":
    print(_MOVED, file=sys.stderr)
    sys.exit(main())
else:
    warnings.warn(_MOVED, FutureWarning, stacklevel=2)

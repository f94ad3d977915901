"""Moved to `dapo_trl.builtin_models` (`python -m dapo_trl.builtin_models [--warm] [--moe]`); this name still runs it
and still imports, with a warning."""

import sys
import warnings

from .builtin_models.tiny_model import *  # noqa: F403 - the moved module's public names
from .builtin_models.tiny_model import main

_MOVED = "dapo_trl.tiny_model moved to dapo_trl.builtin_models (`python -m dapo_trl.builtin_models`)"

if __name__ == "__main__":
    print(_MOVED, file=sys.stderr)
    main()
else:
    warnings.warn(_MOVED, FutureWarning, stacklevel=2)

"""Train with DAPO: `accelerate launch train_dapo.py --loss_type dapo ...` or `python train_dapo.py --config x.yaml`.

Every GRPOConfig / DAPOConfig / ModelConfig field is a flag, and `--config RECIPE.yaml` reads them from a YAML
recipe (configs/dapo_tiny.yaml); `python train_dapo.py --help` lists them.
"""

import sys

from dapo_trl.cli import main

if __name__ == "__main__":
    sys.exit(main())

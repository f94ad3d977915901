"""`python -m dapo_trl.builtin_models [--output DIR] [--warm] [--moe]`: build a tiny model (see `tiny_model.main`)."""

from .tiny_model import main

main()

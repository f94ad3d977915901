"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`, so this is importable)."""

import logging
import warnings
from importlib.metadata import PackageNotFoundError, version


def package_version(package: str) -> str:
    """Installed version of a package, or '?' (printed in each benchmark's header for reproducibility)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"


def quiet() -> None:
    """Silence warnings, progress bars and per-step log printing, so the tables are what is printed."""
    import transformers

    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    for name in ("trl", "dapo_trl", "datasets", "accelerate", "transformers"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets

        datasets.disable_progress_bars()
        datasets.logging.set_verbosity_error()
    except ImportError:
        pass


def peak_memory_mb(device: str) -> float:
    """Peak memory of this process: `torch.cuda.max_memory_allocated` on CUDA, peak RSS on CPU."""
    import resource

    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

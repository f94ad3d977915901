"""Helpers shared by the benchmark scripts (run as `python benchmarks/<name>.py`, so this is importable)."""

from importlib.metadata import PackageNotFoundError, version


def package_version(package: str) -> str:
    """Installed version of a package, or '?' (printed in each benchmark's header for reproducibility)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "?"

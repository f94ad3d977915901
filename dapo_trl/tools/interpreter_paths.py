"""Which directories of the sandbox's Python must be re-exposed inside the sandbox's mount namespace.

The sandbox hides /tmp, /var/tmp, /dev/shm and /run/lock behind private tmpfs and the home directories behind empty
ones, yet a virtual environment, pyenv or conda may live under any of them. So the interpreter's own directories
(prefix, base installation, site-packages) that fall under a hidden path are bind-mounted back read-only, and
nothing else there: not the trainer's project, caches or tokens.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import subprocess
import sys


def resolve_python(python: str | None) -> str:
    """An absolute path to exec: the trainer's own interpreter by default; a bare name is looked up on PATH."""
    python = python or sys.executable
    if os.sep not in python:
        python = shutil.which(python) or python
    return os.path.abspath(python)


def _layout() -> list[str]:
    """This interpreter's directories; also run, as source, by another interpreter to describe itself."""
    import os
    import site
    import sys

    paths = [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    paths.append(os.path.dirname(os.path.realpath(sys.executable)))  # a venv's bin/python links into its base
    paths += site.getsitepackages()
    if site.ENABLE_USER_SITE:
        paths.append(site.getusersitepackages())
    return paths


def interpreter_dirs(python: str) -> list[str]:
    """The directories `python` reads. Another interpreter is asked (with -I, as the sandbox runs it); if it cannot
    answer, the list is empty and the sandbox's construction probe reports why it cannot run."""
    if python == os.path.abspath(sys.executable):
        return _layout()
    describe = "import json\nprint(json.dumps(_layout()))"
    source = f"from __future__ import annotations\n{inspect.getsource(_layout)}\n{describe}"
    try:
        done = subprocess.run([python, "-I", "-c", source], capture_output=True, env={}, timeout=60, check=True)
        paths = json.loads(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError):
        return []
    return [path for path in paths if isinstance(path, str)] if isinstance(paths, list) else []


def _is_under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def hidden_dirs(paths: list[str], hidden: list[str]) -> list[str]:
    """The existing directories among `paths` strictly under a hidden path, outermost only, by both their real
    path and the path as given (a symlinked venv is reached through either)."""
    roots = {os.path.realpath(root) for root in hidden} | {os.path.abspath(root) for root in hidden}
    found = {os.path.realpath(path) for path in paths} | {os.path.abspath(path) for path in paths}
    found = {path for path in found if os.path.isdir(path) and any(_is_under(path, r) and path != r for r in roots)}
    return sorted(path for path in found if not any(other != path and _is_under(path, other) for other in found))


def closed_to_others(roots: list[str]) -> list[str]:
    """The exposed interpreter directories the unprivileged sandbox user cannot enter (no read or execute for
    others): bind-mounted as they are, they stay closed to it whatever the mount namespace shows."""
    return [root for root in roots if os.path.isdir(root) and (os.stat(root).st_mode & 0o005) != 0o005]

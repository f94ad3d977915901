"""Per-call memory and pids cgroups: the limits that hold for a whole process tree (a fork bomb, a memory hog).

Made under the trainer's own cgroup, v1 or delegated v2; where neither is writable there are none, and the sandbox
reports the missing layer.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path

from .sandbox_base import SandboxLimits

logger = logging.getLogger("dapo_trl.tools.sandbox")


class Cgroups:
    """Per-call memory and pids cgroups under the trainer's own cgroup, v1 or delegated v2; absent if not writable."""

    def __init__(self, limits: SandboxLimits) -> None:
        self.limits = limits
        self.parents: dict[str, Path] = {}
        self.version = 0
        try:
            self._discover()
        except OSError as error:
            logger.debug("cgroups unavailable: %s", error)
            self.parents = {}

    def _discover(self) -> None:
        own = {}
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                own[controller] = path
        root = Path("/sys/fs/cgroup")
        v1 = {c: root / c for c in ("memory", "pids") if (root / c / "cgroup.procs").exists() and c in own}
        if v1:
            self.version = 1
            for controller, mount in v1.items():
                parent = mount / own[controller].lstrip("/") / "dapo-sandbox"
                parent.mkdir(exist_ok=True)
                self.parents[controller] = parent
        elif (root / "cgroup.controllers").exists() and "" in own:
            self.version = 2
            parent = root / own[""].lstrip("/") / "dapo-sandbox"
            parent.mkdir(exist_ok=True)
            wanted = {"memory", "pids"} & set((parent / "cgroup.controllers").read_text().split())
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in sorted(wanted)))
            for controller in wanted:
                self.parents[controller] = parent

    def create(self) -> list[tuple[Path, list[str]]]:
        """Fresh cgroup directories with the limits written, each with the controllers it enforces."""
        name = uuid.uuid4().hex[:12]
        made: dict[Path, list[str]] = {}
        for controller, parent in sorted(self.parents.items()):
            path = parent / name
            try:
                if path not in made:
                    path.mkdir()
                    made[path] = []
                self._limit(controller, path)
                made[path].append(controller)
            except OSError as error:
                logger.debug("cgroup %s: %s", controller, error)
        return list(made.items())

    def _limit(self, controller: str, path: Path) -> None:
        memory = str(self.limits.memory_mb << 20)
        if self.version == 1 and controller == "memory":
            (path / "memory.limit_in_bytes").write_text(memory)
            if (path / "memory.memsw.limit_in_bytes").exists():
                (path / "memory.memsw.limit_in_bytes").write_text(memory)
        elif self.version == 1 and controller == "pids":
            (path / "pids.max").write_text(str(self.limits.max_processes))
        elif self.version == 2:
            if (path / "memory.max").exists():
                (path / "memory.max").write_text(memory)
                if (path / "memory.swap.max").exists():
                    (path / "memory.swap.max").write_text("0")
            if (path / "pids.max").exists():
                (path / "pids.max").write_text(str(self.limits.max_processes))

    @staticmethod
    def hit_memory_limit(paths: list[Path]) -> bool:
        for path in paths:
            for name in ("memory.failcnt", "memory.memsw.failcnt"):
                if (path / name).exists() and int((path / name).read_text().strip() or 0) > 0:
                    return True
            events = path / "memory.events"
            if events.exists():
                counts = dict(line.split() for line in events.read_text().splitlines() if line.strip())
                if int(counts.get("oom_kill", 0)) > 0:
                    return True
        return False

    @staticmethod
    def destroy(paths: list[Path]) -> None:
        for path in paths:
            for _ in range(100):
                try:
                    pids = [int(p) for p in (path / "cgroup.procs").read_text().split()]
                except OSError:
                    pids = []
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.01)
            else:
                logger.warning("could not remove sandbox cgroup %s", path)

"""Run each hostile program through LocalSandbox and report, as JSON lines, what it did and how the host fared.

Meant to run inside a containment (PID namespace, pids and memory cgroups: see tests/test_sandbox.py), so that a
sandbox bug fails the test instead of harming the machine. Usage: python hostile_run.py OUT.jsonl [case ...]
"""

import json
import os
import shutil
import site
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from dapo_trl.tools import LocalSandbox, SandboxLimits

SECRET = f"dapo-secret-{uuid.uuid4().hex}"
WORLD_WRITABLE = Path(__file__).resolve().parent / ".world-writable"
HOST_TMP_FILE = Path("/tmp") / f"dapo-host-{uuid.uuid4().hex}"  # /tmp is private in the sandbox, its Python aside
INTERPRETER_DIRS = [Path(sys.prefix), *map(Path, site.getsitepackages())]  # re-exposed, read-only

SEGFAULT_EXTENSION = """
import subprocess, sys
open('boom.c', 'w').write('void *PyInit_boom(void) { volatile int *p = 0; *p = 1; return 0; }')
subprocess.run(['gcc', '-shared', '-fPIC', '-o', 'boom.so', 'boom.c'], check=True)
sys.path.insert(0, '.')
import boom
"""
SEGFAULT_CTYPES = "import ctypes\nctypes.string_at(0)"


def sandbox_uid_processes() -> int:
    """Processes on this machine (as far as we see) owned by a sandbox uid."""
    count = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid >= 60_000 - 256:
                    count += 1
            except OSError:
                pass
    return count


def cases(canary_pid: int, port: int) -> dict[str, str]:
    outside = [str(WORLD_WRITABLE / "pwned"), "/root/pwned", "/etc/pwned", str(Path.cwd() / "pwned"), "/pwned"]
    return {
        "infinite_loop": "while True:\n    pass",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "allocate_10gb": "x = bytearray(10 * 2**30)\nprint(len(x))",
        "allocate_growing": "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 2**20))",
        "write_10gb": "with open('big', 'wb') as f:\n    for _ in range(10240):\n        f.write(b'0' * 2**20)",
        "write_10gb_many_files": "for i in range(10240):\n    open(f'f{i}', 'wb').write(b'0' * 2**20)",
        "print_100mb": "print('x' * 100_000_000)",
        "read_environment": (
            "import os, glob\nprint(dict(os.environ))\n"
            "for path in glob.glob('/proc/*/environ'):\n"
            "    try:\n        print(path, open(path, 'rb').read())\n"
            "    except OSError as error:\n        print(path, error)"
        ),
        "write_outside": (
            f"for path in {outside!r}:\n"
            "    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as error:\n        print('refused', path, type(error).__name__)"
        ),
        "network": (
            "import socket\n"
            f"for host, port in [('127.0.0.1', {port}), ('1.1.1.1', 53), ('10.0.0.1', 80)]:\n"
            "    try:\n        socket.create_connection((host, port), timeout=2)\n        print('connected', host)\n"
            "    except OSError as error:\n        print('blocked', host, error)"
        ),
        "kill_parent": (
            "import os, signal\n"
            f"for pid in [os.getppid(), 1, {os.getpid()}, {canary_pid}]:\n"
            "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('signalled', pid, flush=True)\n"
            "    except OSError as error:\n        print('refused', pid, error, flush=True)"
        ),
        "spawn_shell": (
            "import subprocess\n"
            f"print(subprocess.run(['sh', '-c', 'id -u; echo x > /root/shell-pwned; kill -9 {os.getpid()} 1; "
            "echo shell done'], capture_output=True, text=True))"
        ),
        "segfault_extension": SEGFAULT_EXTENSION if shutil.which("gcc") else SEGFAULT_CTYPES,
        "escape_process_group": (
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(300)\nprint('left')"
        ),
        "tamper_interpreter": (
            "import os, site, sys\n"
            "for path in [sys.prefix, *site.getsitepackages()]:\n"
            "    try:\n        open(os.path.join(path, 'pwned'), 'w').write('x')\n        print('wrote', path)\n"
            "    except OSError as error:\n        print('refused', path, type(error).__name__)\n"
            f"print('host tmp file', 'visible' if os.path.exists({str(HOST_TMP_FILE)!r}) else 'hidden')"
        ),
    }


def main() -> None:
    out = Path(sys.argv[1])
    selected = sys.argv[2:]
    os.environ["DAPO_TEST_SECRET"] = SECRET
    WORLD_WRITABLE.mkdir(exist_ok=True)
    os.chmod(WORLD_WRITABLE, 0o777)
    HOST_TMP_FILE.write_text(SECRET)
    HOST_TMP_FILE.chmod(0o644)
    canary = subprocess.Popen(["sleep", "600"])
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    sandbox = LocalSandbox(SandboxLimits(timeout_s=5.0, max_output_bytes=1 << 16))
    try:
        with out.open("w") as f:
            for name, code in cases(canary.pid, server.getsockname()[1]).items():
                if selected and name not in selected:
                    continue
                free_before = shutil.disk_usage("/").free
                started = time.monotonic()
                result = sandbox.run(code)
                time.sleep(0.2)
                try:
                    server.accept()
                    accepted = True
                except BlockingIOError:
                    accepted = False
                record = {
                    "case": name,
                    "status": result.status.value,
                    "message": result.message,
                    "stdout": result.stdout[-4000:],
                    "stderr": result.stderr[-4000:],
                    "exit_code": result.exit_code,
                    "signal": result.signal,
                    "seconds": time.monotonic() - started,
                    "layers": result.layers,
                    "secret_seen": SECRET in result.stdout + result.stderr,
                    "canary_alive": canary.poll() is None,
                    "leftover_sandbox_processes": sandbox_uid_processes(),
                    "disk_used_mb": (free_before - shutil.disk_usage("/").free) / 2**20,
                    "host_files_written": [
                        p
                        for p in (
                            WORLD_WRITABLE / "pwned",
                            Path("/root/pwned"),
                            Path("/etc/pwned"),
                            Path("/pwned"),
                            Path.cwd() / "pwned",
                            Path("/root/shell-pwned"),
                            *(directory / "pwned" for directory in INTERPRETER_DIRS),
                        )
                        if p.exists()
                    ],
                    "server_accepted": accepted,
                }
                record["host_files_written"] = [str(p) for p in record["host_files_written"]]
                f.write(json.dumps(record) + "\n")
                f.flush()
    finally:
        canary.kill()
        shutil.rmtree(WORLD_WRITABLE, ignore_errors=True)
        HOST_TMP_FILE.unlink(missing_ok=True)


if __name__ == "__main__":
    main()

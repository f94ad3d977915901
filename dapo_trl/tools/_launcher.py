"""Sandbox launcher: run as `python -I -S -c <this source> <config json>` by `LocalSandbox`.

It imports nothing from dapo_trl (it runs without site-packages) and does, in order:

1. join the run's cgroups (memory, pids) so every descendant is accounted for;
2. unshare mount, PID, network, IPC and UTS namespaces (a user namespace too when not root);
3. fork the namespace's init (PID 1): it mounts a private /proc, private size-limited tmpfs over /tmp, /var/tmp,
   /dev/shm and /run/lock, hides home directories behind an empty tmpfs, binds the Python installation's own
   directories back read-only wherever it lives (a venv under /tmp, pyenv under /root), makes the host read-only,
   brings up an isolated loopback, sets resource limits, then forks the user process;
4. the user process drops to an unprivileged uid with no supplementary groups and no capabilities, sets
   no_new_privs, and execs Python on the runner source with a clean environment.

When the user process ends, init ends, and the kernel kills everything left in the PID namespace. Each layer that
cannot be set up is skipped and reported in the status record (fd `status_fd`), which the parent turns into a
warning. The status record is one JSON line: exit code or signal of the user process and the layers in force.
"""

import ctypes
import errno
import fcntl
import json
import os
import resource
import signal
import socket
import struct
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_MOVE = 8192
MS_REC = 16384
MS_PRIVATE = 1 << 18
SYS_MOUNT_SETATTR = 442  # same number on x86_64 and arm64
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
PR_SET_PDEATHSIG = 1
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

libc = ctypes.CDLL(None, use_errno=True)


def _check(result, what):
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(source, target, fstype, flags, data=None):
    _check(
        libc.mount(
            None if source is None else source.encode(),
            target.encode(),
            None if fstype is None else fstype.encode(),
            ctypes.c_ulong(flags),
            None if data is None else data.encode(),
        ),
        f"mount {target}",
    )


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _set_readonly(path, readonly, recursive):
    """mount_setattr(2): (un)set read-only on a mount, or on the whole tree below it (Linux >= 5.12)."""
    attr = _MountAttr(MOUNT_ATTR_RDONLY if readonly else 0, 0 if readonly else MOUNT_ATTR_RDONLY, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    result = libc.syscall(
        ctypes.c_long(SYS_MOUNT_SETATTR),
        ctypes.c_int(AT_FDCWD),
        path.encode(),
        ctypes.c_uint(flags),
        ctypes.byref(attr),
        ctypes.c_size_t(ctypes.sizeof(attr)),
    )
    _check(result, f"mount_setattr {path}")


def _write(path, text):
    with open(path, "w") as handle:
        handle.write(text)


def _loopback_up():
    """An isolated network namespace starts with lo down; local sockets (multiprocessing and friends) need it up."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("16sH14s", b"lo", 0, b"\0" * 14)
        flags = struct.unpack("16sH14s", fcntl.ioctl(sock, SIOCGIFFLAGS, request))[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b"\0" * 14))


def _set_limits(cfg):
    limits = {
        resource.RLIMIT_AS: cfg["memory_bytes"],
        resource.RLIMIT_CPU: cfg["cpu_seconds"],
        resource.RLIMIT_FSIZE: cfg["file_bytes"],
        resource.RLIMIT_NOFILE: cfg["open_files"],
        resource.RLIMIT_CORE: 0,
    }
    if cfg["limit_processes"]:
        limits[resource.RLIMIT_NPROC] = cfg["max_processes"]
    for which, value in limits.items():
        resource.setrlimit(which, (value, value))


def _setup_mounts(cfg, layers, warnings):
    """Read-only host filesystem; private /proc and tmpfs; home directories masked; then the interpreter's own
    directories bound back read-only over all of these (a venv may live under /tmp, pyenv under /root)."""
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    # Hold each interpreter directory before a tmpfs hides it; it is bound back from the handle afterwards.
    held = [(path, os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)) for path in cfg["expose_paths"]]
    private = [path for path in cfg["private_paths"] if os.path.isdir(path)]
    for path in private:
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['disk_bytes']},mode=1777")
    for masked in cfg["mask_paths"]:
        _mount("tmpfs", masked, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path, handle in held:
        os.makedirs(path, 0o755, exist_ok=True)  # the mount point, inside the fresh tmpfs: root's, 0755
        os.fchdir(handle)
        _mount(".", path, None, MS_BIND | MS_REC)
        os.close(handle)
    os.chdir("/")
    if cfg["mask_paths"]:
        layers.append("masked_homes")
    try:  # every mount read-only, the bound interpreter included, so even a world-writable directory is safe
        _set_readonly("/", True, recursive=True)
        layers.append("readonly_host")
    except OSError as error:
        warnings.append(f"host filesystem stays writable where permissions allow ({error})")
        for path, _ in held:
            try:
                _mount(None, path, None, MS_BIND | MS_REMOUNT | MS_RDONLY)
            except OSError as remount_error:
                warnings.append(f"{path} stays writable where permissions allow ({remount_error})")
    if "readonly_host" in layers:
        for path in private:  # only the tmpfs itself: the interpreter bound below it stays read-only
            _set_readonly(path, False, recursive=False)
    if "pid_namespace" in layers:
        _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    layers.append("private_tmp")


def _drop_privileges(cfg):
    if cfg["uid"] is not None and os.getuid() == 0:
        os.setgroups([])
        os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")


def _user_process(cfg):
    """Child of init: the program itself."""
    try:
        os.chdir(cfg["workdir"])
        _drop_privileges(cfg)
        os.execve(cfg["python"], [cfg["python"], "-I", "-B", "-X", "utf8", "-c", cfg["runner"]], cfg["env"])
    except BaseException as error:  # noqa: BLE001 - report any setup failure as the sandbox's, then die
        os.write(2, f"sandbox setup failed: {error}\n".encode())
    os._exit(125)


def _init(cfg, layers, status_fd):
    """PID 1 of the namespace (or plain child without one): set up, start the program, reap, report."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    report = {"layers": layers, "warnings": []}
    try:
        if "mount_namespace" in layers:
            try:
                _setup_mounts(cfg, layers, report["warnings"])
            except OSError as error:
                report["warnings"].append(f"private mounts unavailable ({error})")
        if not os.path.isdir(cfg["workdir"]):
            os.mkdir(cfg["workdir"], 0o700)
        if cfg["uid"] is not None and os.getuid() == 0:
            os.chown(cfg["workdir"], cfg["uid"], cfg["gid"])
            layers.append("unprivileged_user")
        if "network_namespace" in layers:
            try:
                _loopback_up()
            except OSError as error:
                report["warnings"].append(f"loopback not up ({error})")
        if "uts_namespace" in layers:
            socket.sethostname("sandbox")
        _set_limits(cfg)
        layers.append("rlimits")
    except BaseException as error:  # noqa: BLE001
        report["setup_error"] = f"{type(error).__name__}: {error}"
        os.write(status_fd, (json.dumps(report) + "\n").encode())
        os._exit(125)

    child = os.fork()
    if child == 0:
        os.close(status_fd)
        _user_process(cfg)
    if cfg["uid"] is not None and os.getuid() == 0:
        # init needs no privilege to reap; the program cannot signal it either way (PID 1 of its namespace).
        try:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # cleared by the uid change
        except OSError as error:
            report["warnings"].append(f"init kept its privileges ({error})")
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
        if pid == child:
            if os.WIFSIGNALED(status):
                report["signal"] = os.WTERMSIG(status)
            else:
                report["exit_code"] = os.waitstatus_to_exitcode(status)
            break
    os.write(status_fd, (json.dumps(report) + "\n").encode())
    os._exit(0)


def _map_ids():
    """In a fresh user namespace (non-root), map our own ids to themselves so file ownership reads the same."""
    uid, gid = os.getuid(), os.getgid()
    try:
        _write("/proc/self/setgroups", "deny")
    except OSError as error:
        if error.errno != errno.ENOENT:
            raise
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")


def main():
    cfg = json.loads(sys.argv[1])
    status_fd = cfg["status_fd"]
    layers = []
    for procs, controllers in cfg["cgroups"]:
        try:
            _write(procs, str(os.getpid()))
            layers += ["cgroup:" + controller for controller in controllers]
        except OSError:
            pass
    if cfg["namespaces"]:
        base = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
        flags = base if os.getuid() == 0 else base | CLONE_NEWUSER
        if libc.unshare(ctypes.c_int(flags)) == 0:
            if flags & CLONE_NEWUSER:
                try:
                    _map_ids()
                    layers.append("user_namespace")
                except OSError:
                    pass
            layers += ["mount_namespace", "pid_namespace", "network_namespace", "ipc_namespace", "uts_namespace"]
    # Orphans of the program come back to us instead of the host's init, so they can be killed and reaped here.
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    init = os.fork()
    if init == 0:
        _init(cfg, layers, status_fd)
    os.close(status_fd)
    # The parent stops a run with SIGTERM: kill init (with it the whole PID namespace) and reap it, so that no
    # zombie is left holding one of the sandbox uid's process slots.
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(init, signal.SIGKILL))
    while True:
        try:
            os.waitpid(init, 0)
            break
        except InterruptedError:
            continue
    if "pid_namespace" not in layers and cfg["uid"] is not None and os.getuid() == 0:
        _kill_all_of(cfg["uid"])
    while True:  # reap every orphan that was re-parented to us
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            break
        except InterruptedError:
            continue
    os._exit(0)


def _kill_all_of(uid):
    """Without a PID namespace, processes that left the process group still carry the sandbox uid: kill them all."""
    killer = os.fork()
    if killer == 0:
        try:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)


main()

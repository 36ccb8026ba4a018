"""The boundary around the Python tool's code: bubblewrap namespaces and a seccomp filter.

The policy's code is hostile by assumption (a policy under RL finds holes), so it runs
behind the kernel's boundaries, not behind Python's: `bwrap` (bubblewrap, Debian's
`bubblewrap` package) starts it

- in new user, mount, PID, network, IPC, UTS and cgroup namespaces, as uid/gid 65534
  (nobody) with no capabilities, unable to make further user namespaces;
- on a read-only root made of the system's library directories (/usr, /lib*), the
  interpreter's own installation with every site-packages directory hidden (the bare
  standard library: no cffi, pyarrow or numpy), the distributions the tool's `packages`
  setting names (and their dependencies) from the trainer's environment, a read-only /dev
  and a /proc that shows the sandbox's processes only;
- with one writable directory, /sandbox: a tmpfs of `disk_mb`, its working directory;
- in a new session, killed with its parent (and, being PID 1's children, every process of
  the namespace with it), with an environment of its own (no variable of the trainer's);
- under a seccomp filter (compiled by libseccomp through pyseccomp) that refuses starting
  processes (fork, vfork, clone without CLONE_THREAD: threads stay possible), ptrace and
  other processes' memory, namespaces and mounts (setns, unshare, mount, ...), pidfds,
  raw and packet sockets, io_uring, BPF, perf, keyrings, kernel modules and clocks.

`check_machine()` says what this machine lacks of that (the tool then refuses to start,
unless its settings say `insecure_local: true`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

WORKDIR = "/sandbox"  # inside: the code's directory, its only writable path
PACKAGES = "/packages"  # inside: the allowed distributions' files
BOOT_INSIDE = "/sandbox_boot.py"
UID = 65534  # nobody
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
CLONE_THREAD = 0x00010000
SOCK_TYPE_MASK, SOCK_RAW, SOCK_PACKET, AF_PACKET = 0xF, 3, 10, 17
REFUSED_SYSCALLS = (
    # processes: the code may not start any (threads are clone with CLONE_THREAD)
    "fork",
    "vfork",
    # other processes
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "kcmp",
    "pidfd_open",
    "pidfd_getfd",
    "pidfd_send_signal",
    # namespaces and mounts
    "setns",
    "unshare",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "open_tree",
    "move_mount",
    "fsopen",
    "fsconfig",
    "fsmount",
    "fspick",
    "mount_setattr",
    "name_to_handle_at",
    "open_by_handle_at",
    # kernel interfaces a tool never needs
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
    "syslog",
    "quotactl",
    "settimeofday",
    "clock_settime",
    "clock_adjtime",
    "adjtimex",
    "iopl",
    "ioperm",
    "vhangup",
)


@dataclass(frozen=True)
class Interpreter:
    """A Python installation as the sandbox needs it: where it lives, which directories
    hold third-party packages (hidden inside), its version."""

    executable: str  # the real path, outside any virtual environment
    version: str  # "3.11"
    roots: tuple[str, ...]  # the installation's directories (prefix, exec_prefix)
    site_dirs: tuple[str, ...]  # its site-packages directories that exist


@functools.cache
def interpreter(python: str) -> Interpreter:
    """The installation behind `python` (a virtual environment's interpreter is its base's),
    asked by running it."""
    executable = os.path.realpath(shutil.which(python) or python)
    probe = (
        "import json, site, sys; print(json.dumps([sys.version_info[:2], sys.base_prefix,"
        " sys.base_exec_prefix, site.getsitepackages()]))"
    )
    try:
        done = subprocess.run(
            [executable, "-I", "-S", "-c", probe], capture_output=True, text=True, timeout=60
        )
        version, prefix, exec_prefix, sites = json.loads(done.stdout)
    except (OSError, ValueError, subprocess.SubprocessError):
        raise ValueError(f"python={python!r} is not a Python interpreter that runs here") from None
    return Interpreter(
        executable,
        f"{version[0]}.{version[1]}",
        tuple(sorted({prefix, exec_prefix})),
        tuple(d for d in sites if os.path.isdir(d)),
    )


def distribution_paths(names: list[str]) -> dict[str, str]:
    """Every top-level file and directory of the distributions `names` and of what they
    require, from the trainer's environment: {name inside /packages: path outside}."""
    from packaging.requirements import Requirement

    paths: dict[str, str] = {}
    todo, seen = list(names), set()
    while todo:
        name = todo.pop()
        key = name.lower().replace("_", "-")
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ValueError(f"packages: {name!r} is not installed beside the trainer") from None
        for file in dist.files or ():
            top = file.parts[0]
            if top not in ("..", "__pycache__") and not top.endswith(".pth"):
                paths[top] = str(dist.locate_file(top))
        for spec in dist.requires or ():
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return paths


def under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def system_mounts() -> list[str]:
    """The system's library directories, read-only (a merged-/usr system's symlinks as
    symlinks), and the dynamic loader's cache."""
    args: list[str] = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    if os.path.isfile("/etc/ld.so.cache"):
        args += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    return args


def interpreter_mounts(python: Interpreter, packages: dict[str, str], boot: Path) -> list[str]:
    """The interpreter's installation read-only with its site-packages hidden, the allowed
    distributions under /packages, and the boot script."""
    args: list[str] = []
    for root in python.roots:
        if not under(root, "/usr"):
            args += ["--ro-bind", root, root]
    if not any(under(python.executable, r) for r in (*python.roots, "/usr")):
        args += ["--ro-bind", python.executable, python.executable]
    for site_dir in python.site_dirs:  # an empty, read-only directory in its place
        args += ["--tmpfs", site_dir, "--remount-ro", site_dir]
    for name, path in sorted(packages.items()):
        args += ["--ro-bind", path, f"{PACKAGES}/{name}"]
    return [*args, "--ro-bind", str(boot), BOOT_INSIDE]


def environment(workdir: str) -> dict[str, str]:
    """The code's whole environment: nothing of the trainer's, one thread per library."""
    return {
        "PATH": "/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
    }


def bwrap_argv(
    bwrap: str, disk_mb: int, code_fd: int, filter_fd: int, mounts: list[str]
) -> list[str]:
    """bwrap and its options up to the command: namespaces, user, the writable tmpfs
    holding the code as main.py, `mounts` (the functions above), a read-only root,
    environment, seccomp filter."""
    args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent"]
    args += ["--new-session", "--cap-drop", "ALL", "--uid", str(UID), "--gid", str(UID)]
    args += ["--hostname", "sandbox", "--dev", "/dev", "--remount-ro", "/dev", "--proc", "/proc"]
    args += ["--size", str(disk_mb * 1024 * 1024), "--perms", "0700", "--tmpfs", WORKDIR]
    args += ["--file", str(code_fd), f"{WORKDIR}/main.py", "--chdir", WORKDIR, *mounts]
    args += ["--remount-ro", "/", "--clearenv"]  # bwrap's root is a tmpfs the code owns
    for name, value in environment(WORKDIR).items():
        args += ["--setenv", name, value]
    return [*args, "--seccomp", str(filter_fd)]


@functools.cache
def seccomp_filter() -> bytes:
    """The compiled filter (classic BPF for this machine's architecture): every refused
    call fails with EPERM; clone3, whose flags a filter cannot read, with ENOSYS (the C
    library then creates threads with clone)."""
    import pyseccomp as sc

    rules = sc.SyscallFilter(sc.ALLOW)
    for name in REFUSED_SYSCALLS:
        with contextlib.suppress(ValueError):  # not a call of this architecture
            rules.add_rule(sc.ERRNO(errno.EPERM), name)
    rules.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    rules.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    rules.add_rule(sc.ERRNO(errno.EPERM), "socket", sc.Arg(0, sc.EQ, AF_PACKET))
    for kind in (SOCK_RAW, SOCK_PACKET):
        rules.add_rule(
            sc.ERRNO(errno.EPERM), "socket", sc.Arg(1, sc.MASKED_EQ, SOCK_TYPE_MASK, kind)
        )
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        return out.read()


def memfd(name: str, data: bytes) -> int:
    """An anonymous file holding `data`, read from its start (bwrap's --file / --seccomp)."""
    fd = os.memfd_create(name)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


@functools.cache
def check_machine() -> str | None:
    """What this machine lacks for the boundary (None: nothing): bwrap, libseccomp, or
    the unprivileged namespaces bwrap makes (tried once with the filter applied)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return "bubblewrap is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    try:
        program = seccomp_filter()
    except (ImportError, OSError, RuntimeError) as e:
        return f"libseccomp cannot compile the filter ({e}; Debian/Ubuntu: libseccomp2)"
    code_fd, filter_fd = memfd("main.py", b""), memfd("seccomp", program)
    argv = [*bwrap_argv(bwrap, 1, code_fd, filter_fd, system_mounts()), "true"]
    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=60, pass_fds=(code_fd, filter_fd)
        )
    finally:
        os.close(code_fd)
        os.close(filter_fd)
    if done.returncode != 0:
        return f"bubblewrap cannot make its namespaces here ({done.stderr.strip()[:300]})"
    return None

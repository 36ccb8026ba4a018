"""Runs inside the sandbox process (`rlhf.tools.sandbox`): limits itself, then runs main.py.

    python -I sandbox_boot.py WORKDIR CPU_S MEMORY_MB FILE_MB MAX_FILES

Before the policy's code runs, this process lowers its own resource limits (hard limits too,
so the code cannot raise them again: CPU seconds, address space, the size of any file it
writes, open files, processes, no core dumps) and installs an audit hook (PEP 578) that
refuses, for the rest of the process's life:

- opening a path outside WORKDIR for writing, or for reading unless it lies in Python's own
  installation (the standard library and site-packages, which imports read);
- more than MAX_FILES files opened for writing (with the file size limit: the disk it may
  fill);
- sockets of any kind; starting processes (fork, exec, spawn, system, subprocess), signals
  to other processes; ctypes (which could remove the hook); changing, removing or listing
  anything outside WORKDIR.

Audit hooks cannot be removed from Python code, but they are a guard, not a security
boundary: C extensions that open files themselves (numpy.fromfile) are not seen by them.
The kernel enforces the resource limits, and the parent adds a network namespace when
`unshare` works (rlhf.tools.sandbox); adversarial code needs a container around the tool.
Standard library only: nothing of the project is imported here.
"""

import os
import resource
import signal
import sys
import traceback

WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
BLOCKED = (
    "socket.",
    "subprocess.",
    "os.fork",
    "os.forkpty",
    "os.exec",
    "os.posix_spawn",
    "os.spawn",
    "os.system",
    "os.kill",
    "os.killpg",
    "os.startfile",
    "pty.spawn",
    "ctypes.dlsym",  # every other use of ctypes needs a symbol or an address
    "ctypes.cdata",
    "ctypes.call_function",
    "ctypes.string_at",
    "ctypes.wstring_at",
    "ctypes.addressof",
    "resource.setrlimit",
    "resource.prlimit",
    "_posixsubprocess",
    "signal.pthread_kill",
    "mmap.__new__",
    "sys.remote_exec",
    "gc.get_objects",
    "gc.get_referrers",
    "gc.get_referents",
)
LISTINGS = ("os.listdir", "os.scandir")  # allowed where reading is (imports list directories)
PATH_EVENTS = {  # event -> positions of path arguments that must lie inside the workdir
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.mkdir": (0,),
    "os.rename": (0, 1),
    "os.link": (0, 1),
    "os.symlink": (0, 1),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
    "os.chdir": (0,),
    "shutil.rmtree": (0,),
    "os.chflags": (0,),
    "os.setxattr": (0,),
    "os.removexattr": (0,),
}


def limit(cpu_s: int, memory_mb: int, file_mb: int) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU at cpu_s
    for kind, value in (
        (resource.RLIMIT_AS, memory_mb * mb),
        (resource.RLIMIT_FSIZE, file_mb * mb),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_NPROC, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises instead of killing


def make_hook(workdir: str, max_files: int):
    """The audit hook. It reads nothing the sandboxed code could rebind later: the functions
    it calls and the rules are bound here, the rules are immutable, and gc's object lists,
    through which the hook object could be found, are among the refused events."""
    realpath, fsdecode, sep = os.path.realpath, os.fsdecode, os.sep
    blocked, listings, write_flags = BLOCKED, LISTINGS, WRITE_FLAGS
    path_events = tuple(PATH_EVENTS.items())
    readable = tuple(realpath(p) for p in {sys.prefix, sys.base_prefix, sys.exec_prefix} if p)
    writes = [0]

    def inside(path, root):
        if isinstance(path, int):  # an open file descriptor
            return True
        real = realpath(fsdecode(path))
        return real == root or real.startswith(root + sep)

    def check_open(args):
        path, mode, flags = (*args, None, None, None)[:3]
        if path is None or isinstance(path, int):
            return
        writing = any(c in (mode or "") for c in "wax+") or bool((flags or 0) & write_flags)
        if inside(path, workdir):
            if writing:
                writes[0] += 1
                if writes[0] > max_files:
                    raise PermissionError(
                        f"sandbox: more than {max_files} files opened for writing"
                    )
            return
        if writing or not readable_path(path):
            raise PermissionError(f"sandbox: opening {fsdecode(path)} is not allowed")

    def readable_path(path):
        return inside(path, workdir) or any(inside(path, root) for root in readable)

    def hook(event, args):
        if event.startswith(blocked):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            check_open(args)
            return
        if event in listings:
            if args and args[0] is not None and not readable_path(args[0]):
                raise PermissionError(f"sandbox: {event} outside the working directory")
            return
        for name, positions in path_events:
            if event == name:
                for i in positions:
                    if i < len(args) and args[i] is not None and not inside(args[i], workdir):
                        raise PermissionError(f"sandbox: {event} outside the working directory")

    return hook


def main() -> None:
    workdir, cpu_s, memory_mb, file_mb, max_files = sys.argv[1:6]
    workdir = os.path.realpath(workdir)
    os.chdir(workdir)
    with open("main.py") as f:
        source = f.read()
    code = compile(source, "main.py", "exec")
    limit(int(cpu_s), int(memory_mb), int(file_mb))
    sys.addaudithook(make_hook(workdir, int(max_files)))
    sys.argv = ["main.py"]
    try:
        exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit:
        raise
    except BaseException as e:  # the traceback from main.py on, as `python main.py` shows it
        traceback.print_exception(type(e), e, e.__traceback__.tb_next if e.__traceback__ else None)
        sys.exit(1)


if __name__ == "__main__":
    main()

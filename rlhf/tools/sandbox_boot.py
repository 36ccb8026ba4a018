"""Runs inside the sandbox (`rlhf.tools.sandbox`), in the bare interpreter: limits itself,
then runs main.py.

    python -I -S -B sandbox_boot.py CPU_S MEMORY_MB FILE_MB [PACKAGE_DIR]

It lowers its own resource limits, hard limits too, so that the code cannot raise them
again: CPU seconds, address space, the size of any file it writes (its output included),
open files, no core dumps. PACKAGE_DIR, when given, holds the distributions the tool
allows and goes first on sys.path. The boundary itself is outside this process
(rlhf.tools.isolation); this file only sets limits and reports the code's traceback as
`python main.py` would. Standard library only: nothing of the project is importable here.
"""

import resource
import signal
import sys
import traceback


def limit(cpu_s: int, memory_mb: int, file_mb: int) -> None:
    mb = 1024 * 1024
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))  # SIGXCPU at cpu_s
    for kind, value in (
        (resource.RLIMIT_AS, memory_mb * mb),
        (resource.RLIMIT_FSIZE, file_mb * mb),
        (resource.RLIMIT_NOFILE, 64),
        (resource.RLIMIT_CORE, 0),
    ):
        resource.setrlimit(kind, (value, value))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-large write raises instead of killing


def main() -> None:
    cpu_s, memory_mb, file_mb, *package_dir = sys.argv[1:]
    with open("main.py") as f:
        code = compile(f.read(), "main.py", "exec")
    limit(int(cpu_s), int(memory_mb), int(file_mb))
    sys.path[:0] = package_dir
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

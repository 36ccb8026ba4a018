"""`python -m rlhf.rollout.keyed_launch MODULE ARG...`: `python -m MODULE ARG...` given the run's
SGLang API key from the environment rather than on its command line.

SGLang 0.5.23 reads its API key from the command line only (`--api-key`, a field of its
`ServerArgs` with no environment variable; its `--config FILE` turns the file's keys back
into command-line words inside the process, where a key starting with '-' is taken for an
option), and sglang-router 0.3.2 likewise (`--api-key`). A key on the command line of the
process is readable by every local user (`ps`, `/proc/PID/cmdline`); a process's
environment is readable by its own user only. So every server and router the project starts
(`rlhf.rollout.sglang_server`) runs through this module: it appends `--api-key=KEY` (one
word, so a key starting with '-' stays a value) from `RLHF_SGLANG_API_KEY` to `sys.argv`
inside the process and runs MODULE as `__main__`, as `python -m` would. The process's
command line, which the kernel keeps as it was exec'd, never holds the key; without the
variable nothing is added.
"""

from __future__ import annotations

import runpy
import sys

from rlhf.sglang_api import api_key


def module_argv(argv: list[str]) -> tuple[str, list[str]]:
    """The module to run and the arguments it gets (`argv` without the program name)."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m rlhf.rollout.keyed_launch MODULE [ARG...]")
    key = api_key()
    return argv[0], [*argv[1:], *([f"--api-key={key}"] if key else [])]


def main() -> None:
    module, args = module_argv(sys.argv[1:])
    sys.argv = [module, *args]  # runpy puts the module's file name first, as `-m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

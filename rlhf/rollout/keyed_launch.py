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

`python -m rlhf.rollout.keyed_launch --held MODULE`: a launch held before its command line is
known. The process imports MODULE and what its run imports next (`PRELOADS`), with the
garbage collector off (`rlhf.utils.collection_deferred`). SGLang's CPU server here: ~5 s
its module, ~3.4 s the rest, which from the order to serving left 3.6-5.1 s of the start
and leaves ~0.5 s. It then waits for one JSON line on stdin, its `Order`: the arguments,
the environment and the log to write to, and runs MODULE as above, as if it had just been
started with them. At end of file instead (its launcher let go of it, or died) it exits,
having started nothing: no port, no model, no device memory
(`rlhf.rollout.sglang_server.hold_servers`).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
from dataclasses import asdict, dataclass

from rlhf.sglang_api import api_key
from rlhf.utils import collection_deferred

HELD = "--held"
# set by the launcher in a server's environment for `rlhf.rollout.sglang_plugin`
BOUND_STORES_ENV = "RLHF_SGLANG_BOUND_STORES"
UNPINNED_LORA_ENV = "RLHF_SGLANG_UNPINNED_LORA"
SERVER_MODULE = "sglang.launch_server"  # SGLang's server, what `sglang_server` launches
# What a held launch imports besides its module: what the module's first process imports
# once it runs, in any device's flow (SGLang's server: its plugins' hooks, then its HTTP
# server, whose engine imports the scheduler's and detokenizer's entry points, and the
# OpenAI routes it imports as it starts; not the model runner, which a GPU server imports
# only in its spawned scheduler)
PRELOADS = {
    SERVER_MODULE: (
        "sglang.srt.entrypoints.http_server",
        "sglang.srt.entrypoints.openai.serving_responses",
    ),
}


@dataclass(frozen=True)
class Order:
    """What a held launch runs with: MODULE's arguments, the whole environment, and the log
    its output goes to (`private`: readable by this user only)."""

    argv: list[str]
    env: dict[str, str]
    log: str
    private: bool

    def line(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()


def module_argv(argv: list[str]) -> tuple[str, list[str]]:
    """The module to run and the arguments it gets (`argv` without the program name)."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m rlhf.rollout.keyed_launch [--held] MODULE [ARG...]")
    key = api_key()
    return argv[0], [*argv[1:], *([f"--api-key={key}"] if key else [])]


def open_log(path: str, private: bool) -> int:
    """A log's file descriptor for appending; `private`: readable by this user only, since
    SGLang writes its arguments, the API key included, into it at startup."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600 if private else 0o644)
    if private:
        os.fchmod(fd, 0o600)  # a log from an earlier start may be world-readable
    return fd


def run(argv: list[str]) -> None:
    module, args = module_argv(argv)
    sys.argv = [module, *args]  # runpy puts the module's file name first, as `-m` does
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def held(module: str) -> None:
    """Import `module` (the garbage collector off meanwhile, its objects frozen after:
    `rlhf.utils.collection_deferred`), wait for the `Order`, then run it (see the module's
    docstring)."""
    with collection_deferred():
        importlib.import_module(module)
        preload(module)
    sys.modules.pop(module)  # run as __main__ below, a fresh copy; what it imported stays
    line = sys.stdin.buffer.readline()
    if not line:
        raise SystemExit(0)
    order = Order(**json.loads(line))
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # the module's own children do not inherit the launcher's pipe
    os.close(devnull)
    to_log(order.log, order.private)
    entitle([*sys.orig_argv[:3], module, *order.argv])  # before the environment changes
    os.environ.clear()
    os.environ.update(order.env)
    run([module, *order.argv])


def preload(module: str) -> None:
    """Import what `module`'s run would import after the order (`PRELOADS`). SGLang's
    plugins load first, as its launch loads them before it imports the rest (idempotent:
    the launch's own call then does nothing): their hooks patch functions before other
    modules bind them, and their guards stand before what they guard
    (`rlhf.rollout.sglang_plugin`)."""
    if module == SERVER_MODULE:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    for name in PRELOADS.get(module, ()):
        importlib.import_module(name)


def entitle(argv: list[str]) -> None:
    """Show `argv` as the process's command line (`ps`, /proc/PID/cmdline: one string), as a
    launch that was not held would: which model and port this server serves. Never the
    key, which `run` adds inside. setproctitle writes over the memory of the command line
    and of the environment that follows it, so it runs before the environment changes."""
    try:
        from setproctitle import setproctitle  # SGLang's dependency: it titles its processes
    except ImportError:
        return
    setproctitle(" ".join(argv))


def to_log(path: str, private: bool) -> None:
    """stdout and stderr to the log at `path`, after what the imports printed (the held
    process's stdout until now: a temporary file, copied in)."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = open_log(path, private)
    os.lseek(1, 0, os.SEEK_SET)
    while chunk := os.read(1, 1 << 16):
        os.write(fd, chunk)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def main() -> None:
    argv = sys.argv[1:]
    if argv[:1] == [HELD] and len(argv) == 2:
        held(argv[1])
    else:
        run(argv)


if __name__ == "__main__":
    main()

"""Run `rlhf-train` in this process and SIGKILL its SGLang server at chosen moments.

    python server_fault_driver.py --kill update_weights_from_tensor:3 \
        --kill prompt_logprobs:3 -- --config ... key=value ...

`--kill ROUTE:N` kills the server that the N-th call of `rlhf.sglang_api.ROUTE` is
addressed to (its whole process group, as an OOM kill or a crash would) right before that
call, then lets the call go to the dead server. The trainer's own recovery has to do the
rest: nothing else is changed.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections import Counter

import psutil

from rlhf import sglang_api
from rlhf.cli import train


def kill_server(url: str) -> None:
    """SIGKILL the process group of the SGLang server this process started for `url`
    (http://host:port); wait until it is gone. A held launch shows its command line as one
    string (`rlhf.rollout.keyed_launch.entitle`), hence the words of the joined line."""
    port = url.rsplit(":", 1)[1].rstrip("/")
    servers = [
        p
        for p in psutil.Process().children(recursive=True)
        if "sglang.launch_server" in (argv := " ".join(p.cmdline()).split())
        and argv[argv.index("--port") + 1] == port
    ]
    assert servers, f"no SGLang server of this process listens on {url}"
    for proc in servers:
        os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    psutil.wait_procs(servers, timeout=30)
    time.sleep(0.5)  # the listening socket closes with the process
    print(f"server_fault_driver: killed SGLang server pids {[p.pid for p in servers]}", flush=True)


def install(kills: dict[str, int]) -> None:
    """Wrap each named sglang_api function so that its N-th call first kills the server."""
    calls: Counter[str] = Counter()
    for route, nth in kills.items():
        real = getattr(sglang_api, route)

        def wrapped(*args, _route=route, _nth=nth, _real=real, **kwargs):
            calls[_route] += 1
            if calls[_route] == _nth:
                kill_server(args[0])
            return _real(*args, **kwargs)

        setattr(sglang_api, route, wrapped)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kill", action="append", default=[], help="ROUTE:N")
    parser.add_argument("train_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    kills = {route: int(n) for route, n in (k.split(":") for k in args.kill)}
    install(kills)
    rest = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    return train.main(rest)


if __name__ == "__main__":
    sys.exit(main())

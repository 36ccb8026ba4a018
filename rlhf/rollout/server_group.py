"""The SGLang servers of a run: launched (and restarted) here, or external, optionally routed.

Why a group: generation must survive a server dying mid-step, and no server process may
outlive the trainer. The group launches `rollout.num_servers` servers (or checks the
external `rollout.server_urls`), restarts a dead launched server at most
`rollout.max_server_restarts` times and tells the trainer through `on_restart(url)` so it
can push the current weights again. With `rollout.use_router` an sglang-router in front of
the servers takes /generate; weight updates always go to every server in `server_urls`.

Every process runs in its own process group; `stop()` (context manager, exceptions, the
atexit hook of `sglang_server`, and a SIGTERM handler installed while the group runs) kills
those groups. Restarts run on one long-lived launcher thread: Linux delivers the launcher's
death signal (PR_SET_PDEATHSIG) when the *thread* that forked a server exits, so a server
forked from a short-lived worker thread would be killed when that thread ends.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import FrameType
from typing import Any

from rlhf import sglang_api
from rlhf.config.placement import server_gpus
from rlhf.config.schema import RolloutConfig
from rlhf.rollout.client import RETRIES_KEY, RetryPolicy
from rlhf.rollout.sglang_server import (
    SGLangServer,
    build_router_args,
    build_server_args,
    release_held,
)
from rlhf.sglang_api import ServerLost
from rlhf.utils import cpu_threads, free_ports

log = logging.getLogger(__name__)

KEY = "actor_rollout_ref.rollout"
# How long a server that failed a request but still runs may take to answer /health again or
# to die (SGLang's HTTP process outlives a crashed scheduler by ~5 s); then it is restarted.
SETTLE_S = 30.0


class ServerGroup:
    """Launched or external SGLang servers, optionally behind an sglang-router."""

    def __init__(
        self,
        rollout: RolloutConfig,
        model_path: str | Path | None = None,
        *,
        log_dir: str | Path,
        device: str = "cuda",
        seed: int = 0,
        max_total_tokens: int | None = None,
        on_restart: Callable[[str], None] | None = None,
        host: str = "127.0.0.1",
        base_port: int | None = None,
        router_port: int | None = None,
        gpus_per_node: int | None = None,
    ):
        """`base_port`/`router_port`: fixed ports (server i on base_port + i) instead of free
        ones. On a GPU `device` the servers share one node: server i takes GPUs i x its TP
        size onwards (`rlhf.config.placement.server_gpus`), refused (ConfigError) when they
        need more than `gpus_per_node` (the trainer's processes on this node; None: not
        checked)."""
        if not rollout.server_urls and model_path is None:
            raise ValueError(f"a model path is needed to launch servers ({KEY}.server_urls unset)")
        self.gpus = (
            server_gpus(
                rollout.num_servers,
                rollout.tensor_model_parallel_size,
                gpus_per_node,
                "processes of the node, LOCAL_WORLD_SIZE",
            )
            if device != "cpu" and not rollout.server_urls
            else None
        )
        self.rollout = rollout
        self.model_path = model_path
        self.log_dir = Path(log_dir)
        self.device = device
        self.seed = seed
        self.max_total_tokens = max_total_tokens
        self.on_restart = on_restart
        self.host = host
        self.base_port = base_port
        self.router_port = router_port
        self.external = [u.rstrip("/") for u in rollout.server_urls or []]
        self.servers: list[SGLangServer] = []
        self.router: SGLangServer | None = None
        self.restarts: dict[str, int] = {}
        self._lock = threading.Lock()
        self._launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sglang-launcher")
        self._stopped = False
        self._prev_sigterm: Any = None
        self._sigterm_installed = False

    @property
    def server_urls(self) -> list[str]:
        """Every SGLang server (weight updates go to each of them)."""
        return list(self.external) if self.external else [s.url for s in self.servers]

    @property
    def generate_urls(self) -> list[str]:
        """Where /generate goes: the router, or every server."""
        return [self.router.url] if self.router else self.server_urls

    def start(self, wait: bool = True) -> ServerGroup:
        """Launch or check the servers (and the router); on any failure stop what started.

        `wait=False` returns once the server processes are started (their URLs known), so
        the caller can build its models while SGLang loads; `wait_ready()` then finishes."""
        self._install_sigterm()
        try:
            if self.external:
                for url in self.external:
                    self._check_external(url)
            else:
                self._run_on_launcher(self._launch_servers)
        except BaseException:
            self.stop()
            raise
        return self.wait_ready() if wait else self

    def wait_ready(self) -> ServerGroup:
        """Wait until every launched server is healthy, then start the router (if any)."""
        try:
            for server in self.servers:
                server.wait_healthy(self.rollout.server_startup_timeout_s)
            if self.rollout.use_router and self.router is None:
                self._run_on_launcher(self._launch_router)
        except BaseException:
            self.stop()
            raise
        return self

    def _launch_servers(self) -> None:
        num = self.rollout.num_servers
        ports = (
            free_ports(num)
            if self.base_port is None
            else range(self.base_port, self.base_port + num)
        )
        assert self.model_path is not None, "checked in __init__"
        for i, port in enumerate(ports):
            launch = build_server_args(
                self.rollout,
                self.model_path,
                port=port,
                device=self.device,
                host=self.host,
                max_total_tokens=self.max_total_tokens,
                seed=self.seed + i,  # distinct sampling streams per server
                base_gpu_id=self.gpus[i][0] if self.gpus else None,
                cpu_threads=cpu_threads(num),  # the node's servers generate together
            )
            self.servers.append(SGLangServer(launch, self.log_dir / f"sglang_server_{i}.log"))
            self.servers[-1].start()
        release_held()  # launches held for these servers that none took (rlhf.cli.train)

    def _check_external(self, url: str) -> None:
        """Health-check an external server with the request retry policy; raise naming it."""
        policy = RetryPolicy.from_config(self.rollout)
        attempts = policy.retries + 1
        for attempt in range(1, attempts + 1):
            if sglang_api.healthy(url):
                return
            if attempt < attempts:
                time.sleep(policy.delay_s(attempt))
        raise sglang_api.ServerUnavailable(
            f"external SGLang server at {url} ({KEY}.server_urls) did not answer GET /health "
            f"after {attempts} attempts ({RETRIES_KEY}={policy.retries}); start it first or "
            f"fix the URL"
        )

    def _launch_router(self) -> None:
        free = [p for p in free_ports(3) if p != self.router_port]
        port = self.router_port or free[0]
        metrics_port = free[1]
        launch = build_router_args(
            self.server_urls,
            port=port,
            metrics_port=metrics_port,
            host=self.host,
            startup_timeout_s=self.rollout.server_startup_timeout_s,
        )
        self.router = SGLangServer(launch, self.log_dir / "sglang_router.log").start()
        self._wait_router(self.router)

    def _wait_router(self, router: SGLangServer) -> None:
        """The router answers /health before it has registered its workers: wait for both."""
        timeout_s = self.rollout.server_startup_timeout_s
        deadline = time.monotonic() + timeout_s
        router.wait_healthy(timeout_s, router=True)
        missing = set(self.server_urls)
        while time.monotonic() < deadline:
            missing = set(self.server_urls) - sglang_api.router_healthy_workers(router.url)
            if not missing:
                return
            if not router.is_alive():
                break
            time.sleep(0.5)
        raise RuntimeError(
            f"sglang-router at {router.url} did not report workers {sorted(missing)} healthy "
            f"within {timeout_s:.0f} s ({KEY}.server_startup_timeout_s); log {router.log_path}:\n"
            f"{router.log_tail()}"
        )

    def health(self) -> dict[str, bool]:
        """URL -> healthy, for every server and the router."""
        status = {}
        for url in self.server_urls:
            server = self._launched(url)
            alive = server is None or server.is_alive()
            status[url] = alive and sglang_api.healthy(url)
        if self.router is not None:
            status[self.router.url] = self.router.is_alive() and self.router.healthy()
        return status

    def recover(self, url: str) -> str:
        """A request to `url` failed: restart what died, return the URL to retry on.

        Blocks while a server restarts; concurrent callers wait and then find it healthy.
        Raises when a server used up its restarts or no external server is left.
        """
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"SGLang server group stopped; cannot retry request to {url}")
            if self.router is not None and url == self.router.url:
                self._recover_servers()
                if not self.router.is_alive():
                    self._run_on_launcher(self._restart, self.router)
                return url
            if self.external:
                return self._recover_external(url)
            server = self._launched(url)
            if server is None:
                raise ValueError(f"{url} is not a server of this group ({self.server_urls})")
            if not self._settled(server):
                self._run_on_launcher(self._restart, server)
            return url

    def _settled(self, server: SGLangServer) -> bool:
        """A server a request failed on: healthy (True), or dead, or stopped here after
        `SETTLE_S` of running without answering /health (False: restart it). A crashed
        server's process may still run for a few seconds; asked at once, it looked alive and
        the caller's next request was refused with nothing restarted."""
        deadline = time.monotonic() + SETTLE_S
        while server.is_alive():
            if server.healthy():
                return True
            if time.monotonic() >= deadline:
                log.warning(
                    "SGLang server at %s runs but has not answered /health for %.0f s; stopping it",
                    server.url,
                    SETTLE_S,
                )
                server.stop()
                return False
            time.sleep(0.5)
        return False

    def _recover_servers(self) -> None:
        if self.external:
            if not any(sglang_api.healthy(u) for u in self.external):
                raise ServerLost(
                    f"no external SGLang server answers /health ({KEY}.server_urls="
                    f"{self.external}); external servers are never restarted by the trainer"
                )
            return
        for server in self.servers:
            if not server.is_alive():
                self._run_on_launcher(self._restart, server)

    def _recover_external(self, url: str) -> str:
        if sglang_api.healthy(url):
            return url
        others = [u for u in self.external if u != url and sglang_api.healthy(u)]
        if not others:
            raise ServerLost(
                f"external SGLang server at {url} ({KEY}.server_urls) is down and no other "
                "listed server is healthy; external servers are never restarted by the "
                "trainer: restart it, or remove it from the list"
            )
        log.warning("external SGLang server at %s is down; re-issuing on %s", url, others[0])
        return others[0]

    def _run_on_launcher(self, fn: Callable[..., None], *args: Any) -> None:
        self._launcher.submit(fn, *args).result()

    def _restart(self, server: SGLangServer) -> None:
        """On the launcher thread: replace a dead process, same port; then `on_restart`."""
        if server.is_alive():  # restarted by an earlier caller
            return
        url, limit = server.url, self.rollout.max_server_restarts
        code = server.proc.returncode if server.proc is not None else None
        used = self.restarts.get(url, 0)
        if used >= limit:
            raise ServerLost(
                f"SGLang process at {url} died (exit code {code}) after {used} restart(s), the "
                f"limit ({KEY}.max_server_restarts={limit}); log {server.log_path}:\n"
                f"{server.log_tail()}"
            )
        self.restarts[url] = used + 1
        log.warning(
            "SGLang process at %s died (exit code %s); restarting it (%d/%d), log %s",
            url,
            code,
            used + 1,
            limit,
            server.log_path,
        )
        server.stop()
        server.start()
        if server is self.router:
            self._wait_router(server)
        else:
            server.wait_healthy(self.rollout.server_startup_timeout_s)
        log.warning("restarted SGLang process at %s", url)
        if server is not self.router and self.on_restart is not None:
            self.on_restart(url)

    def _launched(self, url: str) -> SGLangServer | None:
        return next((s for s in self.servers if s.url == url), None)

    def stop(self) -> None:
        """Stop the router and every launched server (whole process groups); idempotent."""
        self._stopped = True
        processes = [p for p in (self.router, *self.servers) if p is not None]
        try:
            if processes:  # in parallel: SGLang takes seconds to shut down gracefully
                with ThreadPoolExecutor(max_workers=len(processes)) as pool:
                    list(pool.map(SGLangServer.stop, processes))
        finally:
            self._launcher.shutdown(wait=False, cancel_futures=True)
            self._restore_sigterm()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("not on the main thread: no SIGTERM handler for the SGLang servers")
            return
        self._prev_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        # Off the main thread the handler stays; it then only stops a stopped group and chains.
        if not self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        self._sigterm_installed = False
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._prev_sigterm)

    def _on_sigterm(self, signum: int, frame: FrameType | None) -> None:
        """Stop the servers, then do what SIGTERM did before (by default: die, status 143)."""
        log.warning("SIGTERM: stopping SGLang servers %s", self.server_urls)
        previous = self._prev_sigterm
        self.stop()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)

    def __enter__(self) -> ServerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

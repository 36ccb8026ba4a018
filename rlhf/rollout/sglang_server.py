"""Launch, health-check and stop SGLang server (and sglang-router) processes.

`build_server_args` is the one place that turns our config into SGLang's command line, and
`build_router_args` the one place for sglang-router's. Both run through
`rlhf.rollout.keyed_launch`, which gives them the API key from the environment, never on the
command line (where any local user reads it).
Each server runs in its own process group with its log in the run directory; stopping it
kills the whole group (scheduler and detokenizer subprocesses included), and every server
still running is stopped when this process exits.

A server may start from a held launch (`hold_servers`): a process that imported SGLang
before the server's command line was known and waits for it (`keyed_launch --held`);
`rlhf-train` holds its servers' launches while it imports and checks (`hold_run_servers`),
and lets go of those no server took.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rlhf import sglang_api
from rlhf.config.engine_args import launched_rollout, server_argv
from rlhf.config.loader import ConfigError
from rlhf.config.schema import ActorRolloutRefConfig, RolloutConfig
from rlhf.models.moe_arch import sglang_serving_problem
from rlhf.rollout.keyed_launch import (
    BOUND_STORES_ENV,
    HELD,
    SERVER_MODULE,
    UNPINNED_LORA_ENV,
    Order,
    open_log,
)
from rlhf.utils import cpu_threads as node_cpu_threads
from rlhf.utils import die_with_parent, malloc_kept_env, omp_spin_env
from rlhf.weight_sync.shm_reaper import mapped_files

if TYPE_CHECKING:
    from rlhf.models.families import ModelArch

log = logging.getLogger(__name__)

CPU_SHIM_DIR = Path(__file__).parent / "cpu_shims"
# between readiness polls of a starting server: a refused connection costs ~1 ms, and the
# run waits on average half of this past the moment the server is up
HEALTH_POLL_S = 0.1
# `python -m MODULE` with `--api-key` from RLHF_SGLANG_API_KEY added inside the process
KEYED_LAUNCH = (sys.executable, "-m", "rlhf.rollout.keyed_launch")
_RUNNING: set[SGLangServer] = set()


@dataclass(frozen=True)
class ServerLaunch:
    """Everything needed to start one server: command line, environment additions, URL."""

    argv: list[str]
    env: dict[str, str]
    url: str


def check_servable(arch: ModelArch) -> None:
    """Raise ValueError for a model SGLang would serve wrongly (`sglang_serving_problem`)."""
    problem = sglang_serving_problem(arch.moe, arch.family)
    if problem is not None:
        raise ValueError(problem)


def build_server_args(
    rollout: RolloutConfig,
    model_path: str | Path,
    *,
    port: int,
    device: str,
    host: str = "127.0.0.1",
    max_total_tokens: int | None = None,
    seed: int = 0,
    base_gpu_id: int | None = None,
    cpu_threads: int = 1,
) -> ServerLaunch:
    """The `sglang.launch_server` command line and environment for `rollout` on `device`.

    `base_gpu_id`: first GPU of this server (several servers on one node take
    `tensor_model_parallel_size` GPUs each); None leaves SGLang's default, GPU 0.
    `cpu_threads`: the server's OpenMP threads on CPU (`rlhf.utils.cpu_threads`).
    """
    argv = [
        *KEYED_LAUNCH,
        SERVER_MODULE,
        "--model-path",
        str(model_path),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(rollout.tensor_model_parallel_size),
        "--dtype",
        rollout.dtype,
        "--mem-fraction-static",
        str(rollout.gpu_memory_utilization),
        "--random-seed",
        str(seed),
    ]
    if device == "cpu":
        argv += [
            "--device",
            "cpu",
            "--attention-backend",
            "torch_native",
            "--sampling-backend",
            "pytorch",
            "--disable-overlap-schedule",
            "--disable-cuda-graph",
            "--skip-server-warmup",
            "--sleep-on-idle",  # the idle scheduler would busy-poll a core
        ]
        if rollout.engine_kwargs.sglang.get("enable_lora"):  # the one LoRA backend on CPU
            argv += ["--lora-backend", "torch_native"]
    elif rollout.free_cache_engine:  # GPU: weights and KV cache can be released (sleep/wake)
        argv += ["--enable-memory-saver"]
        if rollout.engine_kwargs.sglang.get("enable_lora"):
            # a LoRA run syncs only adapters: the base weights must come back from a release
            # as they were (SGLang's copy in host memory), not as the next sync's to fill
            argv += ["--enable-weights-cpu-backup"]
    if device != "cpu" and rollout.sampling_seed is not None:  # GPU SGLang seeds only then
        argv += ["--enable-deterministic-inference"]
    if max_total_tokens is not None:
        argv += ["--max-total-tokens", str(max_total_tokens)]
    if base_gpu_id is not None:
        argv += ["--base-gpu-id", str(base_gpu_id)]
    argv += server_argv(rollout.engine_kwargs.sglang)  # the user's, last
    env = server_env(rollout, device, cpu_threads, model_path)
    return ServerLaunch(argv=argv, env=env, url=f"http://{host}:{port}")


def server_env(
    rollout: RolloutConfig, device: str, cpu_threads: int = 1, model_path: str | Path | None = None
) -> dict[str, str]:
    """What a server of `rollout` on `device` adds to this process's environment
    (`cpu_threads`: its OpenMP threads on the CPU; `model_path`: the model it serves, whose
    module alone SGLang's model registry then imports: `unserved_model_modules`)."""
    env: dict[str, str] = {BOUND_STORES_ENV: "1"}  # rlhf/rollout/sglang_plugin.py
    unserved = unserved_model_modules(model_path, rollout) if model_path else None
    if unserved is not None and MODELS_ENV not in os.environ:  # the user's own list wins
        env[MODELS_ENV] = unserved
    # SGLang keeps each image's vision-tower output by the image's hash, and a weight update
    # does not clear it: a picture seen before a sync would keep the old tower's embedding
    # (measured: log-probs 0.12 off transformers with the new weights). No such cache.
    env["SGLANG_VLM_CACHE_SIZE_MB"] = "0"
    if device != "cpu":
        return env
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    if rollout.engine_kwargs.sglang.get("enable_lora"):
        env[UNPINNED_LORA_ENV] = "1"  # rlhf/rollout/sglang_plugin.py
    env["OMP_NUM_THREADS"] = str(cpu_threads)
    env.update(omp_spin_env())  # idle OpenMP threads sleep soon: the trainer needs the cores
    env.update(malloc_kept_env())  # freed tensors' memory stays mapped (rlhf.utils)
    if importlib.util.find_spec("sgl_kernel") is None:
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(CPU_SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p
        )
    return env


MODELS_ENV = "SGLANG_DISABLED_MODEL_ARCHS"


def unserved_model_modules(model_path: str | Path, rollout: RolloutConfig) -> str | None:
    """SGLang's model modules that define none of the model's architectures (its
    config.json), comma-separated: SGLang's `SGLANG_DISABLED_MODEL_ARCHS`, with which its
    model registry imports the served model's module instead of all ~250 of them (0.6 s of
    a CPU server's 7.4 s start here). None where that is not sure: a model directory that
    does not read, an architecture no module defines by that name, a draft model
    (`speculative_*` engine arguments: it has architectures of its own), no SGLang."""
    if any(key.startswith("speculative") for key in rollout.engine_kwargs.sglang):
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        spec = importlib.util.find_spec("sglang")  # finds, does not import, the package
    except (OSError, ValueError):
        return None
    archs = config.get("architectures") if isinstance(config, dict) else None
    if not archs or spec is None or not spec.submodule_search_locations:
        return None
    models = Path(spec.submodule_search_locations[0]) / "srt" / "models"
    defines = _defining_modules(models, tuple(archs))
    if set().union(*defines.values()) != set(archs):
        return None
    return ",".join(module for module, found in defines.items() if not found)


@functools.cache
def _defining_modules(models: Path, archs: tuple[str, ...]) -> dict[str, set[str]]:
    """Each of SGLang's model modules in `models` with the architectures it defines by name;
    read once per process (a node's servers and the hold before them ask alike)."""
    defines = {}
    for path in sorted(models.glob("*.py")):
        if path.stem not in ("__init__", "registry"):
            text = path.read_text()
            defines[path.stem] = {arch for arch in archs if f"\nclass {arch}(" in text}
    return defines


def build_router_args(
    worker_urls: list[str],
    *,
    port: int,
    metrics_port: int,
    host: str = "127.0.0.1",
    startup_timeout_s: float = 300.0,
) -> ServerLaunch:
    """The `sglang_router.launch_router` command line routing /generate over `worker_urls`.

    Round-robin, because each request already carries all `n` samples of its prompt; the
    router's circuit breaker is off since the server group restarts dead workers itself.
    """
    argv = [
        *KEYED_LAUNCH,
        "sglang_router.launch_router",
        "--worker-urls",
        *worker_urls,
        "--host",
        host,
        "--port",
        str(port),
        "--policy",
        "round_robin",
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(metrics_port),
        "--worker-startup-timeout-secs",
        str(max(1, round(startup_timeout_s))),
        "--worker-startup-check-interval",
        "1",
        "--disable-circuit-breaker",
        "--shutdown-grace-period-secs",
        "5",
    ]  # with a key, the router requires it from clients and sends it to workers
    return ServerLaunch(argv=argv, env={}, url=f"http://{host}:{port}")


def _has_api_key(launch: ServerLaunch) -> bool:
    """Whether the process gets an API key: from the environment it inherits
    (`keyed_launch`), or on its command line (a launch built elsewhere)."""
    env = {**os.environ, **launch.env}
    on_command_line = any(a == "--api-key" or a.startswith("--api-key=") for a in launch.argv)
    return bool(env.get(sglang_api.API_KEY_ENV)) or on_command_line


class SGLangServer:
    """One SGLang server process group; use as a context manager or call `stop()`."""

    def __init__(self, launch: ServerLaunch, log_path: str | Path):
        self.launch = launch
        self.url = launch.url
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen | None = None
        self.shm_before: set[Path] = set()  # SGLang's /dev/shm files when it started

    def start(self) -> SGLangServer:
        """Start the process: a held launch of it when there is one (`hold_servers`), else a
        new one."""
        self.shm_before = sglang_shm_files()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        private = _has_api_key(self.launch)
        self.proc = _ordered(self.launch, str(self.log_path), private)
        held = self.proc is not None
        if self.proc is None:
            with os.fdopen(open_log(str(self.log_path), private), "ab") as log_file:
                self.proc = subprocess.Popen(
                    self.launch.argv,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, **self.launch.env},
                    start_new_session=True,
                    # SIGTERM if the launching process dies: the server then stops cleanly
                    preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),
                )
        _RUNNING.add(self)
        how = ", held since its imports" if held else ""
        log.info(
            "started SGLang server pid %d at %s (log %s%s)",
            self.proc.pid,
            self.url,
            self.log_path,
            how,
        )
        return self

    def log_tail(self, num_lines: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-num_lines:])

    def is_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self, timeout_s: float = sglang_api.HEALTH_TIMEOUT_S) -> bool:
        return sglang_api.healthy(self.url, timeout_s)

    def wait_healthy(self, timeout_s: float, router: bool = False) -> None:
        """Block until the server generates a token (`sglang_api.generates`; a `router`:
        until its /health answers 200); raise naming the URL and log if it never does."""
        ready = self.healthy if router else functools.partial(sglang_api.generates, self.url)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.is_alive():
                code = self.proc.returncode if self.proc else None
                raise sglang_api.ServerUnavailable(
                    f"SGLang server for {self.url} exited with code {code} before becoming "
                    f"healthy; log {self.log_path}:\n{self.log_tail()}"
                )
            if ready():
                return
            time.sleep(HEALTH_POLL_S)
        self.stop()
        raise sglang_api.ServerUnavailable(
            f"SGLang server at {self.url} not healthy after {timeout_s:.0f} s "
            f"(actor_rollout_ref.rollout.server_startup_timeout_s); log {self.log_path}:\n"
            f"{self.log_tail()}"
        )

    def stop(self, grace_s: float = 1.0) -> None:
        """SIGTERM the process group; once its engine processes are gone (they exit at once
        on SIGTERM), or after `grace_s`, SIGKILL what is left; idempotent.

        SGLang's HTTP process outlives a SIGTERM by 5 s "before crash diagnostics", which
        nothing here needs: it is killed as soon as the engine processes have exited
        (measured on the CPU quickstart: a stop took 3.0 s, when the HTTP process had its
        1 s grace and the zombies of the killed processes were waited for too).
        """
        _RUNNING.discard(self)
        proc = self.proc  # a local: a SIGTERM handler may call stop() while stop() runs
        if proc is None:
            return
        pgid = proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while _engine_processes(pgid) and time.monotonic() < deadline:
                time.sleep(0.02)
        _kill_group(pgid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5.0)
        self.proc = None
        remove_unused_shm_files(self.shm_before)

    def __enter__(self) -> SGLangServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


SHM = Path("/dev/shm")
# SGLang's load-snapshot slots and the named semaphores of its multiprocessing (spawn) objects
SHM_PREFIXES = ("sglang_loads_", "sem.mp-")


def sglang_shm_files() -> set[Path]:
    """SGLang's files in /dev/shm (of every server on the machine)."""
    return {p for p in SHM.iterdir() if p.name.startswith(SHM_PREFIXES)}


def remove_unused_shm_files(before: set[Path]) -> None:
    """Unlink SGLang's /dev/shm files that appeared since `before` and that no live process
    uses: its processes die by SIGKILL, which skips SGLang's (and multiprocessing's) own
    unlinking, so every start used to leave some. A file in use (another server's) is kept;
    so is every file older than this server."""
    for path in sglang_shm_files() - before - mapped_files():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def live_group(pgid: int) -> set[int]:
    """The processes of group `pgid` that still run: a killed process whose parent has died
    stays a zombie until init reaps it, holding nothing but its PID, and is left out."""
    proc = Path("/proc")
    if not proc.is_dir():  # no procfs: whether any member, zombie or not, is left
        try:
            os.killpg(pgid, 0)
            return {pgid}
        except ProcessLookupError:
            return set()
    members = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _ppid, group = stat.rsplit(")", 1)[1].split()[:3]
        if int(group) == pgid and state not in ("Z", "X"):
            members.add(int(entry.name))
    return members


def _engine_processes(pgid: int) -> set[int]:
    """Group `pgid`'s running processes but its leader (SGLang's HTTP process) and
    multiprocessing's resource tracker (which stays until its parent exits)."""
    engines = set()
    for pid in live_group(pgid) - {pgid}:
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                engines.add(pid)
    return engines


def _kill_group(pgid: int) -> None:
    """Make sure no process of the group survives (children that outlived their parent)."""
    deadline = time.monotonic() + 5.0
    while live_group(pgid) and time.monotonic() < deadline:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        time.sleep(0.02)


@dataclass(frozen=True)
class HeldLaunch:
    """A server process started before its command line was known (`keyed_launch --held`):
    `module` imported, with `env` added to this process's environment, waiting for its
    order."""

    proc: subprocess.Popen
    module: str
    env: dict[str, str]


_HELD: list[HeldLaunch] = []


def hold_servers(env: dict[str, str], count: int, module: str = SERVER_MODULE) -> None:
    """Start `count` held launches of `module` with `env`: the next servers started here with
    that module and environment take them (`SGLangServer.start`), their imports done; the
    rest are let go by `release_held`. From the thread that outlives them (the main thread:
    `die_with_parent`)."""
    for _ in range(count):
        with tempfile.TemporaryFile() as early:  # what the imports print, until the order
            proc = subprocess.Popen(
                [*KEYED_LAUNCH, HELD, module],
                stdin=subprocess.PIPE,
                stdout=early,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid(), signal.SIGTERM),
            )
        _HELD.append(HeldLaunch(proc, module, dict(env)))


def hold_run_servers(aro: ActorRolloutRefConfig, device: str, local_rank: int) -> int:
    """Hold the launches of the servers this process will start for a training run, before
    its checks and model build (how many): the first process of each node launches its
    node's `rollout.num_servers` (`rlhf.rollout.policy_servers.PolicyServers.launch`), none
    when the run uses `rollout.server_urls`. A config the checks will refuse holds none."""
    if aro.rollout.server_urls or local_rank != 0:
        return 0
    try:
        rollout = launched_rollout(aro)
    except ConfigError:
        return 0
    num = rollout.num_servers
    hold_servers(server_env(rollout, device, node_cpu_threads(num), aro.model.path), num)
    return num


def release_held() -> None:
    """Let go of every held launch no server took: it is killed, having started nothing."""
    while _HELD:
        _let_go(_HELD.pop())


def _let_go(held: HeldLaunch) -> None:
    _kill_group(held.proc.pid)
    held.proc.wait()
    if held.proc.stdin is not None:
        with contextlib.suppress(BrokenPipeError):
            held.proc.stdin.close()


def _ordered(launch: ServerLaunch, log_path: str, private: bool) -> subprocess.Popen | None:
    """A held launch of `launch`'s module and environment, given its order; None if none is
    held (or the one held has died)."""
    if launch.argv[: len(KEYED_LAUNCH)] != list(KEYED_LAUNCH):
        return None
    module, *args = launch.argv[len(KEYED_LAUNCH) :]
    for held in [h for h in _HELD if h.module == module and h.env == launch.env]:
        _HELD.remove(held)
        order = Order(args, {**os.environ, **launch.env}, log_path, private)
        try:
            assert held.proc.stdin is not None, "held launches read their order on stdin"
            held.proc.stdin.write(order.line())
            held.proc.stdin.close()
            return held.proc
        except BrokenPipeError:  # it died
            _let_go(held)
    return None


def stop_all_servers() -> None:
    """Stop every server this process started and has not stopped yet."""
    for server in list(_RUNNING):
        server.stop()
    release_held()


atexit.register(stop_all_servers)

"""SGLang's command line is built in one place from the rollout config."""

from __future__ import annotations

import importlib.util
import os

from rlhf.config.schema import RolloutConfig
from rlhf.rollout.sglang_server import CPU_SHIM_DIR, build_server_args


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_config_maps_to_flags():
    rollout = RolloutConfig(
        tensor_model_parallel_size=2, gpu_memory_utilization=0.45, dtype="bfloat16"
    )
    launch = build_server_args(
        rollout, "/models/m", port=3000, device="cuda", host="0.0.0.0", seed=5
    )
    argv = launch.argv
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/models/m"
    assert flag(argv, "--tp-size") == "2"
    assert flag(argv, "--mem-fraction-static") == "0.45"
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--random-seed") == "5"
    assert launch.url == "http://0.0.0.0:3000"
    assert "--device" not in argv and launch.env == {}


def test_cpu_flags_and_kernel_stand_in():
    launch = build_server_args(RolloutConfig(), "/m", port=1, device="cpu", max_total_tokens=4096)
    argv = launch.argv
    assert flag(argv, "--device") == "cpu"
    assert flag(argv, "--attention-backend") == "torch_native"
    assert flag(argv, "--max-total-tokens") == "4096"
    assert {"--disable-cuda-graph", "--disable-overlap-schedule", "--skip-server-warmup"} <= set(
        argv
    )
    assert launch.env["SGLANG_USE_CPU_ENGINE"] == "1"
    shim_on_path = str(CPU_SHIM_DIR) in launch.env.get("PYTHONPATH", "").split(os.pathsep)
    assert shim_on_path == (importlib.util.find_spec("sgl_kernel") is None)


def test_kernel_stand_in_raises_when_called():
    import sys

    import pytest

    sys.path.insert(0, str(CPU_SHIM_DIR))
    try:
        import sgl_kernel

        with pytest.raises(sgl_kernel.MissingKernelError, match=r"sgl_kernel\.fused_add_rmsnorm"):
            sgl_kernel.fused_add_rmsnorm(1, 2)
    finally:
        sys.path.remove(str(CPU_SHIM_DIR))
        sys.modules.pop("sgl_kernel", None)

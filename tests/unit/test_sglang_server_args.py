"""SGLang's command line is built in one place from the rollout config."""

from __future__ import annotations

import importlib.util
import json
import os
import re

import pytest

from rlhf.config.rollout import EngineKwargs
from rlhf.config.schema import RolloutConfig
from rlhf.rollout.sglang_server import (
    CPU_SHIM_DIR,
    MODELS_ENV,
    build_server_args,
    unserved_model_modules,
)
from rlhf.utils import cpu_threads


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
    assert argv[1:4] == ["-m", "rlhf.rollout.keyed_launch", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/models/m"
    assert flag(argv, "--tp-size") == "2"
    assert flag(argv, "--mem-fraction-static") == "0.45"
    assert flag(argv, "--dtype") == "bfloat16"
    assert flag(argv, "--random-seed") == "5"
    assert launch.url == "http://0.0.0.0:3000"
    # the project's SGLang plugin binds the scheduler's store to loopback (sglang_plugin.py)
    no_image_cache = {"SGLANG_VLM_CACHE_SIZE_MB": "0"}  # a sync must reach every image
    assert "--device" not in argv
    assert launch.env == {"RLHF_SGLANG_BOUND_STORES": "1", **no_image_cache}


def test_cpu_flags_and_kernel_stand_in():
    launch = build_server_args(
        RolloutConfig(), "/m", port=1, device="cpu", max_total_tokens=4096, cpu_threads=3
    )
    argv = launch.argv
    assert flag(argv, "--device") == "cpu"
    assert "--sleep-on-idle" in argv and launch.env["OMP_NUM_THREADS"] == "3"
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


ENGINE = "actor_rollout_ref.rollout.engine_kwargs.sglang"


def test_engine_kwargs_from_yaml_and_overrides_reach_the_command_line(tmp_path):
    from rlhf.config import load_config

    path = tmp_path / "run.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n    engine_kwargs:\n      sglang:\n"
        "        chunked_prefill_size: 4096\n        enable_torch_compile: true\n"
    )
    cfg = load_config(
        path, [f"{ENGINE}.max_running_requests=7", f"{ENGINE}.disable_radix_cache=false"]
    )
    argv = build_server_args(cfg.actor_rollout_ref.rollout, "/m", port=1, device="cuda").argv
    tail = argv[argv.index("--mem-fraction-static") :]
    assert tail[-5:] == [
        "--chunked-prefill-size",
        "4096",
        "--enable-torch-compile",
        "--max-running-requests",
        "7",
    ]
    assert "--disable-radix-cache" not in argv  # false leaves a switch off


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "chunked_prefil_size=4",
            "not an SGLang server argument; did you mean 'chunked_prefill_size'",
        ),
        ("tp_size=2", "set by actor_rollout_ref.rollout.tensor_model_parallel_size"),
        ("max_running_requests=abc", "invalid int value: 'abc'"),
        ("enable_torch_compile=3", "a switch, give true or false"),
    ],
)
def test_bad_engine_kwargs_are_config_errors(override, message):
    from rlhf.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=re.escape(message)):
        validate_config(
            load_config(None, ["actor_rollout_ref.model.path=m", f"{ENGINE}.{override}"])
        )


def test_launch_servers_takes_engine_kwargs_from_a_config_and_flags(tmp_path):
    from rlhf.cli import launch_servers

    path = tmp_path / "run.yaml"
    path.write_text(
        "actor_rollout_ref:\n  rollout:\n    engine_kwargs:\n      sglang:\n"
        "        chunked_prefill_size: 4096\n"
    )
    args = launch_servers.parse_args(
        ["--model", "m", "--config", str(path), "--engine-kwarg", "max_running_requests=7"]
    )
    rollout = launch_servers.rollout_config(args)
    assert rollout.engine_kwargs.sglang == {"chunked_prefill_size": 4096, "max_running_requests": 7}
    assert launch_servers.main(["--model", "m", "--engine-kwarg", "no_such_arg=1"]) == 2
    # a run with rollout routing replay: its servers return the routed experts
    r3 = tmp_path / "r3.yaml"
    r3.write_text("actor_rollout_ref:\n  actor:\n    router_replay:\n      mode: R3\n")
    args = launch_servers.parse_args(["--model", "m", "--config", str(r3)])
    rollout = launch_servers.rollout_config(args)
    assert rollout.engine_kwargs.sglang == {"enable_return_routed_experts": True}


def test_cpu_thread_policy(monkeypatch):
    """Each side of a step gets the node's cores split among its own processes; an explicit
    OMP_NUM_THREADS wins."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert [cpu_threads(n) for n in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(1) == 3


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_moe_models_with_dense_layers_are_refused_before_serving(tmp_path, family):
    """SGLang 0.5.23 would build the dense layers with experts (test_moe_weight_sync)."""
    from transformers import AutoConfig

    from rlhf.models.families import load_arch
    from rlhf.rollout.sglang_server import check_servable
    from tests.distributed.test_moe_parity import COMMON, MODELS

    fields = {**COMMON, **MODELS[family]}  # with dense layers
    AutoConfig.for_model(**fields).save_pretrained(tmp_path / "mixed")
    with pytest.raises(ValueError, match=rf"the {family} model has dense layers \[\d"):
        check_servable(load_arch(tmp_path / "mixed"))
    sparse = {**fields, "mlp_only_layers": [], "decoder_sparse_step": 1}
    AutoConfig.for_model(**sparse).save_pretrained(tmp_path / "sparse")
    check_servable(load_arch(tmp_path / "sparse"))


def test_sglangs_registry_imports_only_the_served_models_module(
    tiny_qwen2_dir, tmp_path, monkeypatch
):
    """`SGLANG_DISABLED_MODEL_ARCHS`: every model module of SGLang's but the one defining
    the served architecture, and no list where that is not sure."""
    monkeypatch.delenv(MODELS_ENV, raising=False)
    unserved = unserved_model_modules(tiny_qwen2_dir, RolloutConfig())
    assert unserved is not None
    assert "qwen2" not in unserved.split(",")
    assert {"llama", "qwen2_moe", "qwen2_5_vl", "deepseek_v2"} <= set(unserved.split(","))
    launch = build_server_args(RolloutConfig(), tiny_qwen2_dir, port=1, device="cpu")
    assert launch.env[MODELS_ENV] == unserved
    draft = RolloutConfig(engine_kwargs=EngineKwargs(sglang={"speculative_algorithm": "EAGLE"}))
    assert unserved_model_modules(tiny_qwen2_dir, draft) is None
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    assert unserved_model_modules(other, RolloutConfig()) is None
    assert unserved_model_modules(tmp_path / "missing", RolloutConfig()) is None
    monkeypatch.setenv(MODELS_ENV, "llama")  # the user's own list wins
    assert (
        MODELS_ENV
        not in build_server_args(RolloutConfig(), tiny_qwen2_dir, port=1, device="cpu").env
    )

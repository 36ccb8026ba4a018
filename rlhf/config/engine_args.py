"""`actor_rollout_ref.rollout.engine_kwargs.sglang`: extra SGLang server arguments.

A mapping of SGLang `ServerArgs` names to values (`chunked_prefill_size: 4096`,
`enable_torch_compile: true`). Each name is checked against SGLang's own argument parser
(an unknown one is an error suggesting the nearest), and the values are parsed by it, so a
wrong type fails before any server starts. Arguments this project sets from its own keys
are refused with the key to use instead. `server_argv` turns the mapping into command-line
options, appended after ours; `true` switches a flag on, `false` leaves it off.
`launched_rollout` adds what the run itself needs of the servers (rollout routing replay:
`enable_return_routed_experts`; LoRA adapters: `enable_lora` and its sizes).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
from typing import Any

from rlhf.config.loader import ConfigError
from rlhf.config.lora_targets import hf_projections, megatron_targets
from rlhf.config.schema import ActorRolloutRefConfig, ModelConfig, RolloutConfig

KEY = "actor_rollout_ref.rollout.engine_kwargs.sglang"
AR = "actor_rollout_ref"
# SGLang arguments set from this project's keys (or by the launcher itself).
OWNED = {
    "model_path": f"{AR}.model.path",
    "tp_size": f"{AR}.rollout.tensor_model_parallel_size",
    "dtype": f"{AR}.rollout.dtype",
    "mem_fraction_static": f"{AR}.rollout.gpu_memory_utilization",
    "random_seed": "data.seed",
    "enable_memory_saver": f"{AR}.rollout.free_cache_engine",
    "device": "trainer.device",
    "host": "the launcher (each server's address)",
    "port": "the launcher (each server's address)",
    "base_gpu_id": "the launcher (GPUs of each server)",
    "api_key": "the RLHF_SGLANG_API_KEY environment variable (clients send the same key)",
    "admin_api_key": "the RLHF_SGLANG_API_KEY environment variable (the servers get it as "
    "--api-key, which SGLang then requires on the admin routes too)",
}


ROUTES_FLAG = "enable_return_routed_experts"  # SGLang's: each token's experts in meta_info


def launched_rollout(aro: ActorRolloutRefConfig) -> RolloutConfig:
    """The rollout section the launched servers get: with rollout routing replay
    (`actor.router_replay.mode=R3`) SGLang returns the experts it routed each token to;
    with LoRA adapters synced alone (`model.lora_merge=false`) it serves one adapter of
    the run's rank on the adapted projections (`lora_server_kwargs`)."""
    rollout, needed = aro.rollout, {}
    if aro.actor.router_replay.mode == "R3":
        needed[ROUTES_FLAG] = (True, f"{AR}.actor.router_replay.mode=R3")
    if aro.model.lora_rank and not aro.model.lora_merge:
        reason = f"{AR}.model.lora_rank={aro.model.lora_rank} with model.lora_merge=false"
        needed |= {k: (v, reason) for k, v in lora_server_kwargs(aro.model).items()}
    if not needed:
        return rollout
    sglang = dict(rollout.engine_kwargs.sglang)
    for name, (value, reason) in needed.items():
        if sglang.get(name, value) != value:
            raise ConfigError(f"{KEY}.{name}={sglang[name]}: {reason} sets it to {value}")
        sglang[name] = value
    kwargs = dataclasses.replace(rollout.engine_kwargs, sglang=sglang)
    return dataclasses.replace(rollout, engine_kwargs=kwargs)


def lora_server_kwargs(model: ModelConfig) -> dict[str, Any]:
    """SGLang's LoRA arguments for the adapters `model` (`actor_rollout_ref.model`) trains:
    one adapter of its rank, loaded and unloaded by the weight sync, on the projections
    it adapts (`rlhf.weight_sync.adapters`)."""
    return {
        "enable_lora": True,
        "max_lora_rank": model.lora_rank,
        "lora_target_modules": hf_projections(megatron_targets(model.target_modules)),
        "max_loras_per_batch": 1,
        "max_loaded_loras": 1,
    }


@functools.cache
def _sglang_parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
    ServerArgs.add_cli_args(parser)
    return parser


def _actions() -> dict[str, argparse.Action]:
    return {a.dest: a for a in _sglang_parser()._actions if a.option_strings}


def server_argv(kwargs: dict[str, Any]) -> list[str]:
    """Command-line options for `kwargs` (checked; empty for an empty mapping)."""
    if not kwargs:
        return []
    actions, argv = _actions(), []
    for name, value in kwargs.items():
        if name in OWNED:
            raise ConfigError(f"{KEY}.{name}: set by {OWNED[name]}; use that instead")
        action = actions.get(name)
        if action is None:
            near = difflib.get_close_matches(name, list(actions), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"{KEY}.{name}: not an SGLang server argument{hint}")
        option = action.option_strings[0]
        if action.nargs == 0:  # a flag
            if not isinstance(value, bool):
                raise ConfigError(f"{KEY}.{name}: a switch, give true or false (got {value!r})")
            argv += [option] if value else []
        elif isinstance(value, list):
            argv += [option, *map(str, value)]
        else:
            argv += [option, str(value)]
    _check_values(argv)
    return argv


def _check_values(argv: list[str]) -> None:
    """Let SGLang's parser read the options (types, choices) as it will at launch."""
    try:
        _sglang_parser().parse_known_args(["--model-path", "m", *argv])
    except (argparse.ArgumentError, SystemExit) as e:
        raise ConfigError(f"{KEY}: SGLang rejects {' '.join(argv)}: {e}") from None

"""`actor_rollout_ref.rollout.engine_kwargs.sglang`: extra SGLang server arguments.

A mapping of SGLang `ServerArgs` names to values (`chunked_prefill_size: 4096`,
`enable_torch_compile: true`). Each name is checked against SGLang's own argument parser
(an unknown one is an error suggesting the nearest), and the values are parsed by it, so a
wrong type fails before any server starts. Arguments this project sets from its own keys
are refused with the key to use instead. `server_argv` turns the mapping into command-line
options, appended after ours; `true` switches a flag on, `false` leaves it off.
`launched_rollout` adds what the run itself needs of the servers (rollout routing replay:
`enable_return_routed_experts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
from typing import Any

from rlhf.config.loader import ConfigError
from rlhf.config.schema import ActorRolloutRefConfig, RolloutConfig

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
    (`actor.router_replay.mode=R3`) SGLang returns the experts it routed each token to."""
    rollout = aro.rollout
    if aro.actor.router_replay.mode != "R3":
        return rollout
    if rollout.engine_kwargs.sglang.get(ROUTES_FLAG) is False:
        raise ConfigError(f"{KEY}.{ROUTES_FLAG}=false: {AR}.actor.router_replay.mode=R3 needs it")
    sglang = {**rollout.engine_kwargs.sglang, ROUTES_FLAG: True}
    kwargs = dataclasses.replace(rollout.engine_kwargs, sglang=sglang)
    return dataclasses.replace(rollout, engine_kwargs=kwargs)


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

"""verl settings that are read together rather than key by key (`rlhf.config.verl_keys` is
the one-key table): `custom_reward_function`, the `reward_model` section, and verl's global
micro-batch sizes, which are per-GPU sizes times the data-parallel size of a model.

Each function takes the nested dict of a YAML file and its overrides, before it is
type-checked, and rewrites verl's keys into this system's or raises `VerlKeyError`.
`parse(value, example)` turns a command-line value into the type of `example`;
`default(key)` is the default of this system's key.
"""

from __future__ import annotations

from typing import Any

from rlhf.config.tree import MISSING, get, put

ACTOR, REF = "actor_rollout_ref.actor", "actor_rollout_ref.ref"


class VerlKeyError(ValueError):
    """A verl key or value this system refuses; the message is the one line to print."""


def shown(value: Any) -> str:
    return str(getattr(value, "text", value))


def custom_reward_function(tree: dict, parse: Any) -> None:
    """verl's `custom_reward_function.path` / `.name` -> `reward.custom_fn=path:name`."""
    section = tree.get("custom_reward_function", MISSING)
    if section is MISSING:
        return
    if not isinstance(section, dict) or set(section) - {"path", "name"}:
        extra = sorted(set(section) - {"path", "name"}) if isinstance(section, dict) else []
        raise VerlKeyError(
            f"custom_reward_function{'.' + extra[0] if extra else ''}: verl's "
            "custom_reward_function is read as its path and name only (reward.custom_fn)"
        )
    del tree["custom_reward_function"]
    path = parse(section.get("path"), None)
    if not path:  # verl's default: no custom function (a name alone means nothing)
        return
    name = parse(section.get("name"), None) or "compute_score"
    _move(tree, parse, "custom_reward_function", "reward.custom_fn", f"{path}:{name}")


ON_TRAINER_RANKS = (
    "the reward model runs on the trainer ranks here, sharded like the actor, between "
    "generation and the log-prob passes, not on servers or workers of its own: drop the key "
    "(or serve the model yourself behind reward.url)"
)
REWARD_MODEL_KEYS: dict[str, tuple[tuple, str]] = {  # key: (values accepted, reason otherwise)
    "strategy": (
        ("megatron",),
        "this system runs models with Megatron-Core only (the reward model like the actor)",
    ),
    "model.input_tokenizer": (
        (None,),
        "the reward model reads the policy's token ids here, so it must share the policy's "
        "tokenizer; serve a reward model with its own tokenizer behind reward.url",
    ),
    "use_reward_loop": ((), ON_TRAINER_RANKS),
    "num_workers": ((), ON_TRAINER_RANKS),
    "rollout": ((), ON_TRAINER_RANKS),
    "enable_resource_pool": ((), ON_TRAINER_RANKS),
    "nnodes": ((), ON_TRAINER_RANKS),
    "n_gpus_per_node": ((), ON_TRAINER_RANKS),
}


def reward_model(tree: dict, parse: Any, default: Any) -> None:
    """verl's `reward_model` section: `enable=true` with `model.path` is a reward model that
    scores every sample (`reward.model_path`, `reward.model_scores_every_row`); its
    micro-batches are the reference's here, so `micro_batch_size_per_gpu` must equal them."""
    section = tree.pop("reward_model", MISSING)
    if section is MISSING:
        return
    if not isinstance(section, dict):
        raise VerlKeyError("reward_model: verl's reward_model section is a mapping of keys")
    enable = parse(section.pop("enable", False), True)
    if enable not in (True, False):
        raise VerlKeyError(f"reward_model.enable={shown(enable)}: expected true or false")
    reward_manager(tree, section, parse, default)
    for key in _leaves(section):
        if not enable:
            raise VerlKeyError(
                f"reward_model.{key}: a setting of verl's reward model, which "
                "reward_model.enable=false leaves unused; drop it, or set "
                "reward_model.enable=true with reward_model.model.path"
            )
        _check_reward_model_key(key, get(section, key), parse, tree, default)
    if not enable:
        return
    path = parse(get(section, "model.path"), "")
    if path is MISSING or not path:
        raise VerlKeyError(
            "reward_model.enable=true needs reward_model.model.path (an HF "
            "*ForSequenceClassification directory: reward.model_path here)"
        )
    _move(tree, parse, "reward_model.model.path", "reward.model_path", path)
    _move(tree, parse, "reward_model.enable", "reward.model_scores_every_row", True)


MANAGERS = ("naive", "dapo")  # verl's rule-scoring managers this system's rule rewards are
OVERLONG = "reward_model.reward_kwargs.overlong_buffer_cfg"


def reward_manager(tree: dict, section: dict, parse: Any, default: Any) -> None:
    """verl's reward manager, which scores the rule rows whether or not a reward model is on:
    `reward_manager` naive or dapo (the same rule scores; DAPO's overlong penalty is
    `reward.overlong_buffer`, which `reward_kwargs.overlong_buffer_cfg.*` sets) and its
    `reward_kwargs`; popped from `section`."""
    manager = section.pop("reward_manager", MISSING)
    if manager is not MISSING and parse(manager, "") not in MANAGERS:
        raise VerlKeyError(
            f"reward_model.reward_manager={shown(manager)}: rule rows are scored as verl's "
            "naive and dapo managers score them (reward.num_workers scores in parallel); a "
            "reward function of your own is reward.custom_fn"
        )
    kwargs = section.pop("reward_kwargs", {})
    overlong = kwargs.pop("overlong_buffer_cfg", {}) if isinstance(kwargs, dict) else {}
    for leaf in ("enable", "len", "penalty_factor"):
        if leaf in overlong:
            value = overlong.pop(leaf)
            example = default(f"reward.overlong_buffer.{leaf}")
            _move(
                tree,
                parse,
                f"{OVERLONG}.{leaf}",
                f"reward.overlong_buffer.{leaf}",
                parse(value, example),
            )
    if "log" in overlong and parse(overlong.pop("log"), True) not in (True, False):
        raise VerlKeyError(f"{OVERLONG}.log: expected true or false")
    # either way: the penalty's batch mean is always logged (reward/overlong_penalty/mean)
    if "max_resp_len" in kwargs:
        given, limit = parse(kwargs.pop("max_resp_len"), 0), get(tree, "data.max_response_length")
        limit = default("data.max_response_length") if limit is MISSING else parse(limit, 0)
        if given != limit:
            raise VerlKeyError(
                f"reward_model.reward_kwargs.max_resp_len={shown(given)}: the overlong penalty "
                f"is measured against data.max_response_length ({limit}) here; set them equal"
            )
    rest = [f"reward_kwargs.{k}" for k in _leaves(kwargs)] if isinstance(kwargs, dict) else []
    rest += [f"{OVERLONG}.{k}" for k in _leaves(overlong)]
    if rest:
        raise VerlKeyError(
            f"reward_model.{rest[0].removeprefix('reward_model.')}: verl's reward-manager "
            "argument has no equivalent here (reward.* are this system's rule settings)"
        )


def _check_reward_model_key(key: str, value: Any, parse: Any, tree: dict, default: Any) -> None:
    if key == "model.path":
        return
    if key in ("micro_batch_size_per_gpu", "micro_batch_size"):
        ref_key = f"{REF}.log_prob_micro_batch_size_per_gpu"
        ref = get(tree, ref_key)
        expected = default(ref_key) if ref is MISSING else parse(ref, None)
        given = parse(value, None)
        if key == "micro_batch_size":
            given = per_gpu(tree, parse, default, f"reward_model.{key}", given, ACTOR)
        if given != expected:
            raise VerlKeyError(
                f"reward_model.{key}={shown(value)}: the reward model scores with the "
                f"reference's micro-batches here ({ref_key}={expected}); set that key"
            )
        return
    head = key.split(".")[0] if key.split(".")[0] in REWARD_MODEL_KEYS else key
    allowed, reason = REWARD_MODEL_KEYS.get(
        head,
        (
            (),
            "verl's reward-model setting has no equivalent here; this system's are "
            "reward.model_path and reward.url (docs/from-verl.md)",
        ),
    )
    if parse(value, allowed[0] if allowed else None) not in allowed:
        raise VerlKeyError(f"reward_model.{key}={shown(value)}: {reason}")


def per_gpu(tree: dict, parse: Any, default: Any, key: str, size: Any, model: str) -> int:
    """`size` (verl's global micro-batch of `key`) over the data-parallel size of `model`."""

    def value(leaf: str) -> Any:
        found = get(tree, leaf)
        return default(leaf) if found is MISSING else parse(found, None)

    world = value("trainer.nnodes") * value("trainer.n_gpus_per_node")
    split = (
        value(f"{model}.megatron.tensor_model_parallel_size")
        * value(f"{model}.megatron.pipeline_model_parallel_size")
        * value(f"{model}.ulysses_sequence_parallel_size")
    )
    dp = max(world // split, 1)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % dp:
        raise VerlKeyError(
            f"{key}={shown(size)}: verl's global micro-batch is divided by the data-parallel "
            f"size, {dp} here ({world} processes / TP x PP x Ulysses {split}), so it must be a "
            f"positive multiple of {dp}; or set the per-GPU size ({key}_per_gpu)"
        )
    return size // dp


def _move(tree: dict, parse: Any, verl_key: str, target: str, value: Any) -> None:
    """Set this system's `target` to `value` unless the user set it to another value."""
    own = get(tree, target)
    if own is not MISSING and parse(own, value) != value:
        raise VerlKeyError(
            f"{verl_key} (verl's name of {target}, here {shown(value)}) and "
            f"{target}={shown(own)} are both set: set one"
        )
    put(tree, target, value)


def _leaves(section: dict, prefix: str = "") -> list[str]:
    keys = []
    for name, value in section.items():
        if isinstance(value, dict) and value:
            keys.extend(_leaves(value, f"{prefix}{name}."))
        else:
            keys.append(prefix + name)
    return keys

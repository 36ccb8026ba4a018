"""verl's keys on this system: each one a verl user's script sets either means the same here or
is refused in one line that says why and what to set instead. None is silently ignored.

The kinds, by dotted key (role keys are listed once per role that has them):

- `Alias(target)`: this system's key of the same meaning; the value moves there (both given
  with different values is an error).
- `Fixed(allowed, reason)`: a switch this system always has in one position; the value is
  accepted when it is that position (it then means what it says) and refused with `reason`
  otherwise. With `keep`, the key is also this system's own (the value stays).
- `SameAs(target, reason)`: a setting that here follows `target`; accepted when equal to
  it, refused with `reason` otherwise.
- `Implies(sets, reason)`: a switch that sets this system's keys, unless the user set any
  of them (then those say how).
- `Divided(target, model)`: verl's global micro-batch size, divided by the data-parallel
  size of `model` into this system's per-GPU `target`.
- `Refused(reason)`: no equivalent here; `reason` names the replacement.

The sections verl reads whole, `custom_reward_function` and `reward_model`, are translated by
`rlhf.config.verl_sections`.

`translate(tree)` applies them to the nested dict of a YAML file and its overrides before the
tree is type-checked (`rlhf.config.loader`); docs/from-verl.md is the table in words.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlhf.config.tree import MISSING, get, pop, put
from rlhf.config.verl_sections import (
    VerlKeyError,
    custom_reward_function,
    per_gpu,
    reward_model,
    shown,
)

ACTOR, REF, CRITIC = "actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic"
ROLLOUT, MODEL = "actor_rollout_ref.rollout", "actor_rollout_ref.model"
MULTI_TURN = f"{ROLLOUT}.multi_turn"
VERL_SECTIONS = ("custom_reward_function.", "reward_model.")  # read whole: verl_sections


@dataclass(frozen=True)
class Alias:
    target: str


@dataclass(frozen=True)
class Fixed:
    allowed: tuple
    reason: str
    keep: bool = False


@dataclass(frozen=True)
class Refused:
    reason: str


@dataclass(frozen=True)
class Implies:
    """A verl switch that sets this system's keys `sets[value]` (unless the user set any of
    them); a value not in `sets` is refused with `reason`."""

    sets: dict
    reason: str


@dataclass(frozen=True)
class Divided:
    """verl's global micro-batch size: this system's per-GPU `target` times the data-parallel
    size of `model` (whose layout keys give it), as verl divides it."""

    target: str
    model: str


@dataclass(frozen=True)
class SameAs:
    """Accepted when equal to this system's `target` key (which it cannot differ from)."""

    target: str
    reason: str


MEGATRON_ONLY = (
    "this system trains with Megatron-Core only: FSDP's sharding is data parallelism with "
    "megatron.use_distributed_optimizer=true, and megatron.tensor_model_parallel_size / "
    "pipeline_model_parallel_size split the model (docs/from-verl.md)"
)
SGLANG_ONLY = (
    "this system generates with SGLang servers only: set rollout.name=sglang (SGLang's own "
    "arguments: rollout.engine_kwargs.sglang.<name>)"
)
SHARES_ACTOR = (
    "the reference is sharded like the actor here ({target}); drop the key or set it equal"
)
ULYSSES = (
    "context parallelism is Ulysses here: set {role}.ulysses_sequence_parallel_size (it uses "
    "Megatron's context-parallel group)"
)


def _role_keys() -> dict[str, Any]:
    keys: dict[str, Any] = {}
    for role in (ACTOR, REF, CRITIC):
        keys[f"{role}.strategy"] = Fixed(("megatron",), MEGATRON_ONLY)
        keys[f"{role}.megatron.context_parallel_size"] = Fixed(
            (1,), ULYSSES.format(role=role if role != REF else ACTOR)
        )
        keys[f"{role}.use_torch_compile"] = Refused(
            "torch.compile is not used by the Megatron path here; drop the key"
        )
    for leaf in (
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size",
        "expert_model_parallel_size",
        "expert_tensor_parallel_size",
    ):
        target = f"{ACTOR}.megatron.{leaf}"
        keys[f"{REF}.megatron.{leaf}"] = SameAs(target, SHARES_ACTOR.format(target=target))
    keys[f"{REF}.megatron.param_offload"] = Alias(f"{REF}.param_offload")
    for role in (ACTOR, CRITIC):  # verl's pass-through, for what this system has keys for
        for leaf in (
            "recompute_granularity",
            "recompute_method",
            "recompute_num_layers",
            "sequence_parallel",
            "moe_aux_loss_coeff",
            "moe_z_loss_coeff",
            "moe_expert_capacity_factor",
            "moe_token_drop_policy",
        ):
            keys[f"{role}.megatron.override_transformer_config.{leaf}"] = Alias(
                f"{role}.megatron.{leaf}"
            )
    for section, role in ((MODEL, ACTOR), ("critic.model", CRITIC)):
        recompute = {
            f"{role}.megatron.recompute_granularity": "full",
            f"{role}.megatron.recompute_method": "uniform",
            f"{role}.megatron.recompute_num_layers": 1,
        }
        keys[f"{section}.enable_gradient_checkpointing"] = Implies(
            {True: recompute, False: {}}, "expected true or false"
        )
    for role in (ACTOR, CRITIC):
        keys[f"{role}.ppo_micro_batch_size"] = Divided(f"{role}.ppo_micro_batch_size_per_gpu", role)
        keys[f"{role}.optim.clip_grad"] = Alias(f"{role}.grad_clip")
        keys[f"{role}.optim.warmup_style"] = Alias(f"{role}.optim.lr_decay_style")
        keys[f"{role}.optim.lr_scheduler_type"] = Alias(f"{role}.optim.lr_decay_style")
        keys[f"{role}.optim.lr_warmup_steps_ratio"] = Fixed(
            (0, 0.0), f"warm-up is given in steps here: set {role}.optim.lr_warmup_steps"
        )
    for role in (ROLLOUT, REF):  # both compute log-probs with the actor's layout
        per_gpu = f"{role}.log_prob_micro_batch_size_per_gpu"
        keys[f"{role}.log_prob_micro_batch_size"] = Divided(per_gpu, ACTOR)
    return keys


PROFILER = (
    "global_profiler.steps profiles those training steps with torch.profiler here (traces in "
    "the run directory); for Nsight, run the trainer under nsys yourself"
)
OPTIMIZER_ON_HOST = (
    "Megatron's host-side optimizer (steps on the CPU) is not used here: the optimizer state "
    "leaves the GPU between phases with {role}.megatron.optimizer_offload=true"
)


def _engine_and_tooling_keys() -> dict[str, Any]:
    """vLLM's engine knobs, Megatron checkpoint formats and verl's tooling switches: their
    off position (verl's default) accepted, anything else refused pointing at the setting
    here."""
    keys: dict[str, Any] = {
        f"{ROLLOUT}.enable_chunked_prefill": Fixed(
            (True,),
            "SGLang always chunks long prefills; to turn that off set "
            f"{ROLLOUT}.engine_kwargs.sglang.chunked_prefill_size=-1",
        ),
        f"{ROLLOUT}.max_num_batched_tokens": Refused(
            "vLLM's scheduler budget; SGLang's are "
            f"{ROLLOUT}.engine_kwargs.sglang.chunked_prefill_size (tokens of a prefill chunk) "
            "and max_prefill_tokens (of a prefill batch)"
        ),
        f"{ROLLOUT}.enforce_eager": Implies(
            {True: {f"{ROLLOUT}.engine_kwargs.sglang.disable_cuda_graph": True}, False: {}},
            "expected true or false (SGLang's disable_cuda_graph)",
        ),
        "trainer.log_val_generations": Fixed(
            (0,),
            "validation generations are not sent to the trackers here; every training "
            "step's samples are in the run directory's rollouts/step_N.jsonl",
        ),
        "global_profiler.tool": Fixed((None,), PROFILER),
        "global_profiler.save_path": Fixed((None,), PROFILER),
    }
    checkpoint = (
        "models start from the HF weights of model.path and checkpoints are Megatron's "
        "distributed checkpoints anyway: a Megatron checkpoint of another run is resumed "
        "with trainer.resume_mode=<its global_step_N>, or exported with rlhf-convert "
        "mcore-to-hf"
    )
    bridge = (
        "the HF <-> Megatron conversion here is this system's own (rlhf/models/families.py, "
        "checked against transformers); either value means the same"
    )
    for role in (ACTOR, REF, CRITIC):
        keys[f"{role}.megatron.use_dist_checkpointing"] = Fixed((False,), checkpoint)
        keys[f"{role}.megatron.dist_checkpointing_path"] = Fixed((None,), checkpoint)
        keys[f"{role}.megatron.use_mbridge"] = Fixed((True, False), bridge)
        keys[f"{role}.megatron.vanilla_mbridge"] = Fixed((True, False), bridge)
        for leaf, off in (("enable", False), ("tool", None), ("all_ranks", False)):
            keys[f"{role}.profiler.{leaf}"] = Fixed((off,), PROFILER)
    for role in (ACTOR, CRITIC):
        host = OPTIMIZER_ON_HOST.format(role=role)
        prefix = f"{role}.megatron.override_optimizer_config"
        keys[f"{prefix}.optimizer_offload_fraction"] = Fixed((0, 0.0), host)
        keys[f"{prefix}.optimizer_cpu_offload"] = Fixed((False,), host)
        keys[f"{prefix}.overlap_cpu_optimizer_d2h_h2d"] = Fixed((False,), host)
        keys[f"{prefix}.use_precision_aware_optimizer"] = Fixed((False,), host)
    return keys


def _lora_keys() -> dict[str, Fixed]:
    """The keys verl's LoRA scripts set beside lora_rank, lora_alpha and target_modules
    (this system's own): how verl's FSDP workers move the model, meaningless here."""
    fsdp = (
        "a verl FSDP worker's way of moving LoRA weights into vLLM; here the weight sync "
        "sends the adapters, or the merged weights with model.lora_merge, whatever this says"
    )
    return {
        f"{MODEL}.use_shm": Fixed(
            (True, False), "the model loads from model.path as it is; either value means the same"
        ),
        f"{ROLLOUT}.load_format": Fixed(("safetensors", "auto", "dummy", "hf"), fsdp),
        f"{ROLLOUT}.layered_summon": Fixed((True, False), fsdp),
        f"{MODEL}.exclude_modules": Fixed(
            (None,), "every layer that target_modules names is adapted: list fewer there"
        ),
        f"{MODEL}.lora_adapter_path": Fixed(
            (None,),
            "training starts from fresh adapters; to start from trained ones, merge them into "
            "the base model (peft's merge_and_unload) and set model.path to it",
        ),
    }


def _megatron_lora_keys(model: str) -> dict[str, Alias | Fixed]:
    """verl's Megatron LoRA section of `model` (`actor_rollout_ref.model.lora`,
    `critic.model.lora`: Megatron-Bridge's settings): the same adapters as this system's
    flat keys, which its values move to."""
    lora, refused = f"{model}.lora", "; drop the key"
    merge = {f"{lora}.merge": Alias(f"{model}.lora_merge")} if model == MODEL else {}
    return {
        f"{lora}.rank": Alias(f"{model}.lora_rank"),
        f"{lora}.alpha": Alias(f"{model}.lora_alpha"),
        f"{lora}.dropout": Alias(f"{model}.lora_dropout"),
        f"{lora}.target_modules": Alias(f"{model}.target_modules"),
        **merge,
        f"{lora}.type": Fixed(
            ("lora",),
            "adapters here are plain LoRA on Megatron's fused layers (q/k/v and gate/up "
            "share one A); canonical_lora, dora and vlm_lora are not built" + refused,
        ),
        f"{lora}.dropout_position": Fixed(
            ("pre",), "dropout acts on each adapter's input (PEFT's place)" + refused
        ),
        f"{lora}.lora_A_init_method": Fixed(
            ("kaiming",),
            "A starts kaiming-uniform (PEFT's init, Megatron-Bridge's kaiming), drawn from "
            "the seed and the layer's name so that every layout gets the same adapters; "
            "xavier is not built" + refused,
        ),
        f"{lora}.lora_B_init_method": Fixed(("zero",), "B starts at zero" + refused),
        f"{lora}.exclude_modules": Fixed(
            ([], None), "every layer that target_modules names is adapted: list fewer there"
        ),
        f"{lora}.a2a_experimental": Fixed(
            (False,), "an expert's adapters run beside its GEMM, after the dispatch" + refused
        ),
        f"{lora}.dtype": Fixed(
            (None,), "the adapters take the actor's dtype (megatron.dtype)" + refused
        ),
        f"{lora}.adapter_path": Fixed(
            (None,),
            "training starts from fresh adapters; to start from trained ones, merge them into "
            "the base model (peft's merge_and_unload) and set model.path to it",
        ),
        **{
            f"{lora}.{leaf}": Fixed(
                (True,), "LoRA on a vision-language model is not built; the key means nothing"
            )
            for leaf in ("freeze_vision_model", "freeze_vision_projection", "freeze_language_model")
        },
    }


def _multi_turn_keys() -> dict[str, Fixed]:
    """verl's `rollout.multi_turn` keys this system has no such setting for: their off
    position is accepted (verl's default), anything else refused."""
    drop = "; drop the key"
    return {
        "function_tool_path": Fixed(
            (None,),
            "tools are classes listed in multi_turn.tool_config_path here (rlhf.tools.base."
            "Tool); verl's @function_tool files are not read" + drop,
        ),
        "interaction_config_path": Fixed(
            (None,),
            "a conversation here is the policy and its tools; verl's interactions (a "
            "simulated user answering turns) do not exist" + drop,
        ),
        "use_inference_chat_template": Fixed(
            (False,),
            "a conversation is kept as the token ids the engine produced and was fed and is "
            "never rendered again, so no second template applies" + drop,
        ),
        "tokenization_sanity_check_mode": Fixed(
            ("disable",),
            "a conversation is never tokenized again (token in, token out): the ids trained "
            "on are the engine's, and there is no second tokenization to compare" + drop,
        ),
        "num_repeat_rollouts": Fixed((None,), "responses per prompt are rollout.n here" + drop),
    }


VERL_KEYS: dict[str, Alias | Divided | Fixed | Implies | SameAs | Refused] = {
    **_role_keys(),
    **_engine_and_tooling_keys(),
    f"{ROLLOUT}.name": Fixed(("sglang",), SGLANG_ONLY, keep=True),
    f"{ROLLOUT}.mode": Fixed(
        ("async",),
        "SGLang runs as HTTP servers the trainer sends requests to, which is verl's async "
        "mode; verl's in-process sync engines do not exist here",
    ),
    f"{MODEL}.use_fused_kernels": Fixed(
        (True,),
        "the log-prob and entropy head is always the chunked vocab-parallel one "
        "(rlhf/models/logprobs.py): it never holds the full logits",
    ),
    f"{MODEL}.use_remove_padding": Alias("data.use_sequence_packing"),
    **_lora_keys(),
    **_megatron_lora_keys(MODEL),
    **_megatron_lora_keys(f"{CRITIC}.model"),
    **{f"{MULTI_TURN}.{leaf}": rule for leaf, rule in _multi_turn_keys().items()},
    "data.return_raw_chat": Fixed(
        (True,),
        "prompts stay chat messages until the trainer applies the chat template with its "
        "tokenizer (data.apply_chat_template); the servers get the token ids",
    ),
}


def translate(tree: dict, parse: Any, default: Any) -> None:
    """Apply `VERL_KEYS` to `tree` in place. `parse(value, example)` turns a command-line
    value into the type of `example` (YAML values pass through); `default(key)` is the
    default of this system's key."""
    custom_reward_function(tree, parse)
    reward_model(tree, parse, default)
    for key, rule in VERL_KEYS.items():
        value = get(tree, key)
        if value is MISSING:
            continue
        if isinstance(rule, Refused):
            raise VerlKeyError(f"{key}: {rule.reason}")
        if isinstance(rule, Implies):
            choice = parse(value, None)
            if choice not in rule.sets:
                raise VerlKeyError(f"{key}={shown(value)}: {rule.reason}")
            pop(tree, key)
            implied = rule.sets[choice]
            if all(get(tree, target) is MISSING for target in implied):  # else refined
                for target, implied_value in implied.items():
                    put(tree, target, implied_value)
            continue
        if isinstance(rule, Divided):
            value = per_gpu(tree, parse, default, key, parse(value, None), rule.model)
            put(tree, key, value)
            rule = Alias(rule.target)
        elif isinstance(rule, SameAs):
            target = get(tree, rule.target)
            expected = default(rule.target) if target is MISSING else parse(target, None)
            if parse(value, None) != expected:
                raise VerlKeyError(f"{key}={shown(value)}: {rule.reason}")
            pop(tree, key)
            continue
        if isinstance(rule, Fixed):
            if parse(value, rule.allowed[0]) not in rule.allowed:
                raise VerlKeyError(f"{key}={shown(value)}: {rule.reason}")
            if not rule.keep:
                pop(tree, key)
            continue
        pop(tree, key)
        target = get(tree, rule.target)
        if target is not MISSING and parse(target, None) != parse(value, None):
            raise VerlKeyError(
                f"{key} (verl's name of {rule.target}) and {rule.target} are both set, "
                f"to {shown(value)} and {shown(target)}: set one"
            )
        put(tree, rule.target, value)

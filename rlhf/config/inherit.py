"""Keys whose unset value is another key's: the critic's batch and layout are the actor's.

As in verl, a config that leaves the critic's mini-batch size, epochs, loss aggregation,
micro-batching mode or Megatron layout out gets the actor's (its own YAML interpolates
them); here a layout must be shared anyway (`validate_config`: actor, critic and reference
run on one set of Megatron groups). Applied to the raw tree, before the schema's defaults,
so that "unset" means absent from the file and the command line.
"""

from __future__ import annotations

from rlhf.config.tree import MISSING, get, put

ACTOR, CRITIC = "actor_rollout_ref.actor", "critic"
LAYOUT = (
    "megatron.tensor_model_parallel_size",
    "megatron.pipeline_model_parallel_size",
    "megatron.virtual_pipeline_model_parallel_size",
    "megatron.sequence_parallel",
    "megatron.expert_model_parallel_size",
    "megatron.expert_tensor_parallel_size",
    "ulysses_sequence_parallel_size",
)
# critic key -> the actor's key it takes when unset
CRITIC_FROM_ACTOR = {
    f"{CRITIC}.{key}": f"{ACTOR}.{key}"
    for key in (
        "ppo_mini_batch_size",
        "ppo_epochs",
        "loss_agg_mode",
        "use_dynamic_bsz",
        *LAYOUT,
    )
}


def inherit(tree: dict) -> None:
    """Give each unset critic key of `tree` the actor's value where the actor's is set."""
    for key, source in CRITIC_FROM_ACTOR.items():
        value = get(tree, source)
        if get(tree, key) is MISSING and value is not MISSING:
            put(tree, key, value)

"""Worker: the trainer's stages on a mixture-of-experts policy at any EP x TP layout.

Built from the config's `megatron.expert_*` / `megatron.moe_*` keys through the trainer's
own setup; on the fixed synthetic batch of `ppo_stages.py` rank 0 writes to OUT:

- `plain`: the router losses off (coefficients 0), token-budget packed micro-batches:
  `logprobs_before` [B, R], one actor update's `metrics` (pg_loss, grad_norm, ...) and
  `logprobs_after`, and the reference's log-probs (it shares the actor's layout);
- `router_loss`: a fresh actor with `--aux` / `--z` as megatron.moe_aux_loss_coeff /
  moe_z_loss_coeff, one sample per micro-batch (Megatron's router losses are per
  micro-batch, so the micro-batches must hold the same samples at every layout for the
  loss to be the same): the update's `metrics` and `logprobs_after`;
- `dropping`: the same with megatron.moe_expert_capacity_factor 0.5 instead (tokens over
  an expert's capacity are dropped);
- `r2`: routing replay R2 (`replay_r2`); `r3`: rollout routing replay (`replay_r3`) with
  routes transformers computed (`hf_routes`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

import torch

from rlhf.config import load_config
from rlhf.distributed.bootstrap import init_layout, seed_everything, teardown
from tests.distributed.workers.ppo_stages import checkpoint_round_trip, synthetic_batch
from tests.helpers import SEED_DEFAULTS

BUDGET = 40  # tokens per micro-batch: several packed micro-batches per rank
R2 = (  # two mini-batches of 4 samples, two epochs
    "actor_rollout_ref.actor.router_replay.mode=R2",
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
)


R3 = "actor_rollout_ref.actor.router_replay.mode=R3"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence parallel size")
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    parser.add_argument("--aux", type=float, default=0.1, help="moe_aux_loss_coeff")
    parser.add_argument("--z", type=float, default=0.01, help="moe_z_loss_coeff")
    parser.add_argument("--plain-only", action="store_true", help="only the plain update")
    args = parser.parse_args()
    cfg = config(args, aux=0.0, z=None)
    from rlhf.config.validate import validate_config

    layout = validate_config(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    ctx = init_layout("cpu", layout)
    try:
        seed_everything(0)
        run(args, cfg, ctx)
    finally:
        teardown()


def config(args, aux: float, z: float | None, capacity: float | None = None, *extra: str):
    etp = "null" if args.etp is None else args.etp
    factor = "null" if capacity is None else capacity
    actor = "actor_rollout_ref.actor"
    return load_config(
        None,
        [
            *SEED_DEFAULTS,
            f"actor_rollout_ref.model.path={args.model}",
            f"{actor}.optim.lr=0.01",
            f"{actor}.ppo_mini_batch_size=4",
            "actor_rollout_ref.rollout.n=2",
            f"{actor}.clip_ratio_c=null",
            "data.train_batch_size=4",
            "algorithm.adv_estimator=grpo",  # no critic: the actor's stages are compared
            f"{actor}.use_kl_loss=true",  # and so a reference
            f"trainer.n_gpus_per_node={os.environ.get('WORLD_SIZE', '1')}",
            f"{actor}.megatron.tensor_model_parallel_size={args.tp}",
            f"{actor}.megatron.pipeline_model_parallel_size={args.pp}",
            f"{actor}.ulysses_sequence_parallel_size={args.sp}",
            f"{actor}.megatron.expert_model_parallel_size={args.ep}",
            f"{actor}.megatron.expert_tensor_parallel_size={etp}",
            f"{actor}.megatron.moe_aux_loss_coeff={aux}",
            f"{actor}.megatron.moe_z_loss_coeff={'null' if z is None else z}",
            f"{actor}.megatron.moe_expert_capacity_factor={factor}",
            *extra,
        ],
    )


def build(cfg, ctx):
    from rlhf.engine.build import AR, build_engine
    from rlhf.models.model_dir import read_model_arch
    from rlhf.trainer.preflight import check_experts

    arch = read_model_arch(cfg.actor_rollout_ref.model.path)
    check_experts(arch, cfg.actor_rollout_ref.actor.megatron, f"{AR}.actor")
    return arch, build_engine(cfg, arch, ctx, total_steps=1)


def update_once(models, exp, planner, budget):
    """One actor update (one mini-batch); its metrics and the log-probs after it."""
    from rlhf.engine import engine as stages

    update = dataclasses.replace(models.actor_update, token_budget=budget)
    metrics, _ = stages.run_updates(update, exp.batch, exp, planner)
    after, _ = stages.compute_logprobs(
        models.actor, exp.batch, planner, budget, models.logprob_head
    )
    return metrics, after


def run(args, cfg, ctx) -> None:
    from rlhf.config.budgets import MicroBatching
    from rlhf.engine import engine as stages
    from rlhf.engine.micro_batch import MicroBatchPlanner
    from rlhf.trainer.step import Experience

    arch, models = build(cfg, ctx)
    planner = MicroBatchPlanner(ctx, thd=False)
    batch = synthetic_batch(arch.vocab_size)
    head = models.logprob_head
    before, entropy = stages.compute_logprobs(models.actor, batch, planner, BUDGET, head)
    assert models.ref is not None
    ref, _ = stages.compute_logprobs(models.ref, batch, planner, BUDGET, head)
    gen = torch.Generator().manual_seed(3)
    advantages = torch.randn(before.shape, generator=gen) * batch.mask_bt()
    zeros = torch.zeros_like(before)
    exp = Experience(batch, before, entropy, ref, None, zeros, advantages, None)
    metrics, after = update_once(models, exp, planner, BUDGET)
    plain = {"logprobs_before": before, "ref_logprobs": ref, "metrics": metrics}
    plain["logprobs_after"] = after
    # the updated actor (and its distributed optimizer's shards) saved and loaded back
    plain["checkpoint_round_trip"] = checkpoint_round_trip(
        models.actor, lambda: build(cfg, ctx)[1].actor
    )
    # offloaded between uses (the GPU configs' setting): nothing of the actor stays
    held = [storage_bytes(models.actor)]
    models.actor.offload_between_uses(("params", "grads", "optimizer"), "actor")
    held.append(storage_bytes(models.actor))
    with models.actor.on_device():
        held.append(storage_bytes(models.actor))
    plain["held_bytes"] = all_gathered(held)
    plain["gradient_guard"] = all_gathered(gradient_guard(models.actor, ctx))
    if args.plain_only:
        if ctx.rank == 0:
            result = {"plain": plain, "batch": batch.to_objects(), "advantages": advantages}
            torch.save(result, Path(args.out))
        return
    # the same first update with the router losses on, one sample per micro-batch
    _, lossy = build(config(args, args.aux, args.z), ctx)
    one_each = MicroBatching(BUDGET, samples=1)
    padded = dataclasses.replace(planner, padded=True)
    lossy_metrics, lossy_after = update_once(lossy, exp, padded, one_each)
    router_loss = {"metrics": lossy_metrics, "logprobs_after": lossy_after}
    # token dropping: each expert takes at most half its even share of a sample's tokens
    _, dropping = build(config(args, 0.0, None, capacity=0.5), ctx)
    drop_metrics, drop_after = update_once(dropping, exp, padded, one_each)
    dropped = {"metrics": drop_metrics, "logprobs_after": drop_after}
    replayed = replay_r2(args, ctx, exp, planner)
    rollout_routes = replay_r3(args, ctx, exp, planner)
    if ctx.rank == 0:
        result = {"plain": plain, "router_loss": router_loss, "advantages": advantages}
        result["dropping"] = dropped
        result["r2"] = replayed
        result["r3"] = rollout_routes
        result["batch"] = batch.to_objects()
        torch.save(result, Path(args.out))


def gradient_guard(model, ctx) -> list[bool]:
    """The update's non-finite guard (`gradients_finite`, every rank) with the gradients as
    the update left them, then with an inf in one routed expert's gradient on rank 0 only."""
    with model.on_device():
        verdicts = [model.gradients_finite()]
        param = next(p for n, p in model.module.named_parameters() if ".experts." in n)
        grad = param.main_grad.view(-1)
        kept = grad[0].item()
        if ctx.rank == 0:
            grad[0] = float("inf")
        verdicts.append(model.gradients_finite())
        grad[0] = kept
    return verdicts


def storage_bytes(model) -> int:
    """Bytes behind the model's state, found from the module and the optimizer themselves
    (every parameter, its main_grad, every tensor of the optimizer), each storage once."""
    params = list(model.module.parameters())
    tensors = params + [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
    for part in getattr(model.optimizer, "chained_optimizers", [model.optimizer]):
        tensors += [p for group in part.optimizer.param_groups for p in group["params"]]
        for state in part.optimizer.state.values():
            tensors += [v for v in state.values() if torch.is_tensor(v)]
    sizes = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(sizes.values())


def all_gathered(value):
    import torch.distributed as dist

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def on_update_plan(models, batch, planner) -> torch.Tensor:
    """The actor's log-probs over the actor update's micro-batch plan (as R2 records)."""
    update = models.actor_update
    (logprobs,) = planner.per_sample(
        models.actor,
        batch,
        update.token_budget,
        models.logprob_head,
        ("logprobs",),
        mini_batch_size=update.mini_batch_samples,
    )
    return logprobs


def replay_r2(args, ctx, exp, planner) -> dict:
    """router_replay.mode=R2 with two mini-batches and two PPO epochs: the old-log-prob
    pass (on the update's plan) records the routes, every forward of the update replays
    them. Returns the old log-probs, the update's metrics (and those of the same update
    routing anew) and the log-probs after it (own routing); at the updated weights, how
    many token-layer routes differ from the recorded ones when routing anew (`moved`), and
    the log-probs with the recorded routes replayed (`logprobs_replayed`)."""
    from rlhf.engine import engine as stages

    _, models = build(config(args, 0.0, None, None, *R2), ctx)
    replay = models.actor.route_replay
    old, _ = models.logprobs(exp.batch, "actor")
    recorded = dict(replay.routes)
    exp = dataclasses.replace(exp, old_logprobs_bt=old)
    metrics, _ = stages.run_updates(models.actor_update, exp.batch, exp, planner)
    with replay.recording():  # the updated weights' own routes
        after = on_update_plan(models, exp.batch, planner)
    moved = sum(
        int((own.sort(-1).values != rec.sort(-1).values).any(-1).sum())
        for key, rec_layers in recorded.items()
        for own, rec in zip(replay.routes[key], rec_layers)
    )
    moved_all = torch.tensor([moved])
    torch.distributed.all_reduce(moved_all)
    replay.routes = recorded
    with replay.replaying():
        replayed = on_update_plan(models, exp.batch, planner)
    # the same two epochs routing anew
    _, own = build(config(args, 0.0, None, None, *R2[1:]), ctx)
    own_metrics, _ = stages.run_updates(own.actor_update, exp.batch, exp, planner)
    return {
        "old_logprobs": old,
        "metrics": metrics,
        "metrics_routing_anew": own_metrics,
        "logprobs_after": after,
        "logprobs_replayed": replayed,
        "moved": int(moved_all),
    }


def hf_routes(model_dir, batch, choices: tuple[int, int]) -> list[torch.Tensor]:
    """Each sample's routes as SGLang returns them ([tokens - 1, layers x top-k] int16),
    computed by transformers: per token and MoE layer the experts ranked `choices` by the
    router (0: the first choice); experts 0..top-k-1 for the dense layer."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    c = model.config
    sparse = [i for i in range(c.num_hidden_layers) if i not in c.mlp_only_layers]
    routes = []
    with torch.no_grad():
        for prompt, response in zip(batch.prompt_ids, batch.response_ids):
            ids = (prompt + response)[:-1]  # the last token is never fed through the model
            out = model(torch.tensor([ids]), output_router_logits=True)
            r = torch.arange(c.num_experts_per_tok).repeat(len(ids), c.num_hidden_layers, 1)
            for layer, logits in zip(sparse, out.router_logits):
                ranked = logits.topk(max(choices) + 1, dim=-1).indices
                r[:, layer] = ranked[:, list(choices)]
            routes.append(r.reshape(len(ids), -1).to(torch.int16))
    return routes


def replay_r3(args, ctx, exp, planner) -> dict:
    """router_replay.mode=R3 with transformers' routes as the engine's: the old log-probs
    with the model's own routes (`old_own`) and, outside the replay as the weight-sync probe
    runs, the plain log-probs of a batch whose routes send every token to its 2nd and 3rd
    choices (`not_replayed`); then a whole trainer step on that batch
    (`learn_from_batch`): its old and reference log-probs, its update's `metrics` and the
    log-probs after it, replaying the routes."""
    from rlhf.algo import build_kl_controller
    from rlhf.engine import engine as stages
    from rlhf.logging import Timer
    from rlhf.trainer.step import Learning, learn_from_batch

    cfg = config(args, 0.0, None, None, R3)
    _, models = build(cfg, ctx)
    own = dataclasses.replace(exp.batch, routed_experts=hf_routes(args.model, exp.batch, (0, 1)))
    moved = dataclasses.replace(exp.batch, routed_experts=hf_routes(args.model, exp.batch, (1, 2)))
    head = models.logprob_head
    old_own, _ = models.logprobs(own, "actor")
    not_replayed, _ = stages.compute_logprobs(models.actor, moved, planner, BUDGET, head)
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    learned = learn_from_batch(
        models,
        moved,
        Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer),
        kl_ctrl,
        Timer(),
    )
    with stages.rollout_routes(models.actor):
        after, _ = stages.compute_logprobs(models.actor, moved, planner, BUDGET, head)
    return {
        "old_own": old_own,
        "not_replayed": not_replayed,
        "old_moved": learned.experience.old_logprobs_bt,
        "ref_moved": learned.experience.ref_logprobs_bt,
        "metrics": learned.metrics,
        "logprobs_after": after,
    }


if __name__ == "__main__":
    main()

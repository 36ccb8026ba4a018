"""Worker: full trainer steps (`rlhf.trainer.step.learn_from_batch`) per algorithm variant.

For each variant (an advantage estimator and where the KL goes), the models the config asks
for are built from the HF checkpoint and a fixed synthetic batch (two prompts x four samples,
scores that differ within each prompt) goes twice through the real Megatron stages and
updates (two mini-batches x two epochs each). The second step is the one reported: by then
the actor has left the reference, so the KL terms are not zero. Rank 0 writes, per variant:
which models exist, the second step's log-probs before and after it, values, advantages,
returns and metrics, the timer stages the second step ran (bypass mode runs no
old-log-prob pass), and the KL coefficient before the first and after the second step.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from rlhf.config import load_config
from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
from tests.helpers import SEED_DEFAULTS

GSPO_SETTINGS = [
    "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.actor.clip_ratio_low=0.0003",
    "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
]
# name -> overrides on top of COMMON
VARIANTS = {
    "gae": ["algorithm.adv_estimator=gae"],
    "grpo": ["algorithm.adv_estimator=grpo"],
    "dr_grpo": ["algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=false"],
    "rloo": ["algorithm.adv_estimator=rloo"],
    "reinforce_plus_plus": ["algorithm.adv_estimator=reinforce_plus_plus"],
    "grpo_kl_loss": [
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.5",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
    ],
    "grpo_no_kl": ["algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false"],
    # the epochs end at the first update whose actor/ppo_kl exceeds the bound
    "grpo_kl_bound": ["algorithm.adv_estimator=grpo", "trainer.early_stop.ppo_kl_bound=1e-6"],
    "gspo": ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo", *GSPO_SETTINGS],
    "vanilla_gspo_settings": GSPO_SETTINGS,  # the same, with PPO's token-level ratio
    "grpo_tis": ["algorithm.adv_estimator=grpo", "algorithm.rollout_correction.rollout_is=token"],
    "grpo_seq_is": [
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=1.5",
    ],
    # the engine's log-probs are the old ones; no old-log-prob forward
    "grpo_bypass": [
        "algorithm.adv_estimator=grpo",
        "algorithm.rollout_correction.bypass_mode=true",
    ],
    # step 1 trains only the critic, step 2 both (the trainer's actor_trains decides)
    "gae_critic_warmup": ["algorithm.adv_estimator=gae", "trainer.critic_warmup=1"],
}
COMMON = [
    "data.train_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # 2 mini-batches of 4 samples
    "actor_rollout_ref.actor.ppo_epochs=2",
    "actor_rollout_ref.actor.optim.lr=0.002",
    "actor_rollout_ref.actor.clip_ratio=0.02",  # small: the second mini-batch/epoch clips
    "critic.ppo_mini_batch_size=1",
    "critic.ppo_epochs=2",
    "algorithm.kl_ctrl.kl_coef=0.05",
]
ROLES = ("actor_rollout_ref.actor", "critic")
SCORES = [1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0]  # prompt 0: samples 0-3, prompt 1: 4-7


def synthetic_batch(vocab_size: int):
    from rlhf.rollout.batch import RolloutBatch

    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, vocab_size, (9,), generator=gen).tolist() for _ in range(2)]
    responses = [
        torch.randint(3, vocab_size, (3 + i % 4,), generator=gen).tolist() for i in range(8)
    ]
    # What an engine would report: near the tiny model's ~-6, off by up to +-0.5.
    logprobs = [(-6.0 + torch.rand(len(r), generator=gen) - 0.5).tolist() for r in responses]
    return RolloutBatch(
        prompt_ids=[prompts[i // 4] for i in range(8)],
        response_ids=responses,
        scores_b=torch.tensor(SCORES),
        data_sources=["synthetic"] * 8,
        uids=[f"p{i // 4}" for i in range(8)],
        rollout_logprobs=logprobs,
    )


def run_variant(model_dir: str, overrides: list[str], ctx, save: Path | None = None) -> dict:
    from rlhf.algo import build_kl_controller
    from rlhf.config import validate_config
    from rlhf.engine.build import build_engine
    from rlhf.engine.engine import compute_logprobs
    from rlhf.logging import Timer
    from rlhf.trainer.preflight import load_policy_arch
    from rlhf.trainer.step import Learning, learn_from_batch

    model = f"actor_rollout_ref.model.path={model_dir}"
    cfg = load_config(None, [*SEED_DEFAULTS, model, *COMMON, *overrides])
    arch = load_policy_arch(cfg)
    validate_config(cfg, ctx.world_size, arch)
    models = build_engine(cfg, arch, ctx, total_steps=1)
    batch = synthetic_batch(arch.vocab_size)
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    kl_before = kl_ctrl.value
    learning = Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer)
    learn_from_batch(models, batch, learning, kl_ctrl, Timer(), learning.actor_trains(1))
    timer = Timer()
    learned = learn_from_batch(models, batch, learning, kl_ctrl, timer, learning.actor_trains(2))
    exp, metrics = learned.experience, learned.metrics
    after, _ = compute_logprobs(
        models.actor, batch, models.planner, models.budgets.actor, models.logprob_head
    )
    synced = None
    if save is not None:  # the actor's checkpoint after both steps, as rlhf-convert reads it
        save_actor(models, cfg, arch, ctx, save)
        synced = weight_sync_tensors(models.actor.module, arch, ctx)
    # the weight-sync probe's path: one sample per DP rank, fewer micro-batches than stages
    probe = models.probe_logprobs(batch.prompt_ids[5] + batch.response_ids[5])
    return {
        "sequence_parallel": models.actor.module.config.sequence_parallel,
        "chunks": len(models.actor.module),
        "has_ref": models.ref is not None,
        "has_critic": models.critic is not None,
        "old_logprobs": exp.old_logprobs_bt,
        "ref_logprobs": exp.ref_logprobs_bt,
        "values": exp.values_bt,
        "advantages": exp.advantages_bt,
        "returns": exp.returns_bt,
        "mask": batch.mask_bt(),
        "rollout_logprobs": batch.rollout_logprobs_bt(),
        "is_weights": exp.rollout_is_weights_bt,
        "logprobs_after": after,
        "probe_logprobs": probe,
        "kl_coef": (kl_before, kl_ctrl.value),
        "metrics": metrics,
        "stages": sorted(timer.seconds),
        "synced": synced,
    }


def weight_sync_tensors(module, arch, ctx) -> dict:
    """The HF tensors the weight sync gathers from every rank and would send (rank 0)."""
    from rlhf.weight_sync.gather import SyncTopology, iter_buckets

    buckets = iter_buckets(module, arch, SyncTopology.of(ctx), bucket_bytes=64 * 1024)
    return {name: t.clone() for bucket in buckets for name, t in bucket}


def save_actor(models, cfg, arch, ctx, directory: Path) -> None:
    from rlhf.models.mapping import Placement
    from rlhf.trainer.export import write_export_files
    from rlhf.utils import torch_dtype

    directory.mkdir(parents=True, exist_ok=True)
    models.actor.save(directory)
    if ctx.rank == 0:
        actor = cfg.actor_rollout_ref.actor
        padded = models.actor.module.padded_vocab_size
        dtype, path = torch_dtype(actor.megatron.dtype), cfg.actor_rollout_ref.model.path
        write_export_files(directory, path, arch, padded, dtype, Placement.of(ctx), "lm")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--vp", type=int, default=1, help="virtual-pipeline chunks per stage")
    parser.add_argument("--sp", type=int, default=1, help="Ulysses sequence parallel size")
    parser.add_argument(
        "--sequence-parallel", choices=["true", "false"], help="Megatron's (default: TP > 1)"
    )
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--save", help="write each variant's actor checkpoint to SAVE/<variant>")
    args = parser.parse_args()
    split = None if args.sequence_parallel is None else args.sequence_parallel == "true"
    ctx = init_parallel(
        "cpu", tp_size=args.tp, pp_size=args.pp, sp_size=args.sp, sequence_parallel=split
    )
    layout = [
        f"trainer.n_gpus_per_node={ctx.world_size}",
        *(f"{role}.megatron.tensor_model_parallel_size={args.tp}" for role in ROLES),
        *(f"{role}.megatron.pipeline_model_parallel_size={args.pp}" for role in ROLES),
        *(f"{role}.megatron.virtual_pipeline_model_parallel_size={args.vp}" for role in ROLES),
        *(f"{role}.ulysses_sequence_parallel_size={args.sp}" for role in ROLES),
    ]
    if args.sequence_parallel is not None:
        layout += [f"{role}.megatron.sequence_parallel={args.sequence_parallel}" for role in ROLES]
    try:
        results = {}
        for name in args.variants.split(","):
            seed_everything(0)
            save = Path(args.save) / name if args.save else None
            results[name] = run_variant(args.model, [*layout, *VARIANTS[name]], ctx, save)
        if ctx.rank == 0:
            torch.save(results, Path(args.out))
    finally:
        teardown()


if __name__ == "__main__":
    main()

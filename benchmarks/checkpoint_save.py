"""How long a checkpoint save holds the training step: synchronous against `trainer.async_save`.

    python benchmarks/checkpoint_save.py [--config CFG] [--model-shape SHAPE.json] [key=value ...]

One process, TP = PP = 1. The PPO models of `--config` (default: the quickstart's) are built
as the trainer builds them, on a randomly initialised HF checkpoint of `--model-shape`
(default: a 4-layer Qwen2 with a 32k vocabulary, ~13M parameters, so `make bench` runs on a
CPU), and one trainer step's learning runs so that Adam's state exists. Then the trainer's
own checkpoint code (`CheckpointKeeper`) saves the trained models: once to warm up (it
starts Megatron's result-queue process, ~1.7 s here), once synchronously and twice in the
background. Prints one JSON object: the checkpoint's size on disk, the seconds each save
held the step, the seconds until each was published, and the planner's `save_hold_text` for
this size. tools/run_gpu_checks.sh runs it for the 0.5B config and shape.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent))

from phase_memory import random_model, single_rank_models, synthetic_batch

# where a 1-rank run's only rank sits (the keeper reads these of a ParallelContext)
ONE_RANK = SimpleNamespace(is_main=True, rank=0, dp_sp_size=1, world_size=1, tp_size=1, pp_size=1)

REPO = Path(__file__).resolve().parent.parent
SMALL_SHAPE = {
    "model_type": "qwen2",
    "vocab_size": 32768,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": True,
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs/quickstart_cpu.yaml"))
    parser.add_argument("--model-shape", help="an HF config.json (default: a ~20M Qwen2)")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def disk_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def measure(args, model_dir: Path, run_dir: Path) -> dict:
    from rlhf.algo import build_kl_controller
    from rlhf.distributed.bootstrap import teardown
    from rlhf.logging import Timer
    from rlhf.memory.checkpoint_size import save_hold_text
    from rlhf.trainer.checkpoints import CheckpointKeeper
    from rlhf.trainer.step import Learning, learn_from_batch

    cfg, ctx, arch, models, _ = single_rank_models(
        args.config, str(model_dir), args.overrides, 29533
    )
    try:
        aro = cfg.actor_rollout_ref
        batch = synthetic_batch(cfg, arch.vocab_size, aro.actor.ppo_mini_batch_size * aro.rollout.n)
        learn_from_batch(
            models,
            batch,
            Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer),
            build_kl_controller(cfg.algorithm.kl_ctrl),
            Timer(),
        )
        trained = {"actor": models.actor}
        if models.critic is not None:
            trained["critic"] = models.critic
        keeper = CheckpointKeeper(
            cfg.trainer, planned_bytes(cfg, arch), run_dir, ONE_RANK, total_steps=4
        )

        def make_dirs(tmp: Path) -> None:
            for name in trained:
                (tmp / name).mkdir()

        def write(tmp: Path) -> None:
            make_dirs(tmp)
            for name, model in trained.items():
                model.save(tmp / name)

        def snapshot(tmp: Path) -> list:
            make_dirs(tmp)
            return [w for name, m in trained.items() for w in m.save_in_background(tmp / name)]

        keeper.save(1, write)
        result = {"warm_up_s": round(keeper.last_save_s, 3)}
        keeper.save(2, write)
        result["sync"] = {"held_s": round(keeper.last_save_s, 3)}
        for step in (3, 4):
            keeper.save_in_background(step, snapshot)
            held = keeper.last_blocking_s
            keeper.wait()
            result[f"async_{step - 2}"] = {
                "held_s": round(held, 3),
                "published_after_s": round(keeper.last_save_s, 3),
            }
        size = disk_bytes(keeper.manager.path_for(4))
        plan = save_hold_text(size, 1, keeper.write_rate, ctx.device.type, True, 30.0)
    finally:
        teardown()
    return {
        "device": ctx.device.type,
        "models": sorted(trained),
        "checkpoint_mib": round(size / 1024**2, 1),
        "write_rate_mb_s": round(keeper.write_rate / 1e6, 1),
        **result,
        "plan": plan,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        shape = Path(tmp) / "shape.json"
        if args.model_shape:
            shape = Path(args.model_shape)
        else:
            shape.write_text(json.dumps(SMALL_SHAPE))
        model_dir = random_model(shape, Path(tmp) / "model")
        print(json.dumps(measure(args, model_dir, Path(tmp) / "run")))


if __name__ == "__main__":
    main()


def planned_bytes(cfg, arch) -> int:
    """A checkpoint's planned bytes on disk for a 1-rank run of `cfg`."""
    from rlhf.config.validate import trained_megatron
    from rlhf.memory.checkpoint_size import checkpoint_bytes

    trained = trained_megatron(cfg.actor_rollout_ref, cfg.critic, cfg.algorithm)
    return checkpoint_bytes(trained.values(), arch, cfg.trainer.save_hf, 1)

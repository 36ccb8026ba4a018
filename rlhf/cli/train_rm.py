"""`rlhf-train-rm`: train a reward model on preference pairs (Bradley-Terry), export it to HF.

    rlhf-train-rm --config configs/quickstart_rm_cpu.yaml [key=value ...] [--print-config]

Works as a single process or under torchrun (TP, PP, Ulysses SP, DP as in rlhf-train). The
config tree is `rlhf.config.reward_training`; the trained model ends in
`<trainer.default_local_dir>/reward_model_hf`, an HF `*ForSequenceClassification` directory
for PPO's `reward.model_path`. Config and data errors print one line and exit 2.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import NoReturn

from rlhf.cli.train import bootstrap_layout, locked
from rlhf.config import ConfigError, dump_yaml, load_config
from rlhf.config.reward_training import RewardModelRunConfig, validate_reward_training
from rlhf.errors import ends_in_one_line

log = logging.getLogger("rlhf.cli.train_rm")


def run(cfg: RewardModelRunConfig) -> Path:
    """Lock the run directory (main rank), check the model, bootstrap, train, export."""
    from rlhf.distributed import bootstrap, launch_env
    from rlhf.trainer.preflight import preflight_reward_model
    from rlhf.trainer.reward_training import EXPORT_DIR, RewardModelTrainer

    run_dir = Path(cfg.trainer.default_local_dir)
    with locked(run_dir):
        world = launch_env.launched_world_size() or 1
        arch, layout = preflight_reward_model(cfg, world)  # before the process groups
        ctx = bootstrap_layout(cfg.trainer.device, layout, world)
        trainer = None
        try:
            bootstrap.seed_everything(cfg.model.megatron.seed)
            if ctx.is_main:
                run_dir.mkdir(parents=True, exist_ok=True)
                (run_dir / "config.yaml").write_text(dump_yaml(cfg))
                log.info("world %d: %s; run dir %s", ctx.world_size, ctx.describe(), run_dir)
            trainer = RewardModelTrainer(cfg, ctx, run_dir, arch)
            last = trainer.fit()
            if ctx.is_main:
                report(run_dir, last, run_dir / EXPORT_DIR)
        finally:
            if trainer is not None:
                trainer.close()
            bootstrap.teardown()
        return run_dir


def report(run_dir: Path, step: int, exported: Path) -> None:
    """Where the model is, and how held-out accuracy moved."""
    print(f"rlhf-train-rm: finished at step {step}", flush=True)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/rm/accuracy"]) for r in rows if "val/rm/accuracy" in r]
    if len(val) >= 2:
        (s0, v0), (s1, v1) = val[0], val[-1]
        print(f"  held-out accuracy: {v0:.3f} (step {s0}) -> {v1:.3f} (step {s1})", flush=True)
    print(f"  reward model:      {exported}  (reward.model_path of a PPO run)", flush=True)
    print(f"  metrics:           {run_dir / 'metrics.jsonl'}", flush=True)
    print(f"  checkpoints:       {run_dir / 'checkpoints'}", flush=True)


@ends_in_one_line("rlhf-train-rm")  # rlhf.errors: one line, exit 2 or 1
def main(argv: list[str] | None = None) -> int:
    import argparse

    from rlhf.distributed.launch_env import launched_world_size

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(
        prog="rlhf-train-rm", description="Train a reward model on preference pairs."
    )
    parser.add_argument("--config", help="YAML run config (see configs/quickstart_rm_cpu.yaml)")
    parser.add_argument("--print-config", action="store_true", help="print it resolved; exit")
    parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.seed=3")
    args = parser.parse_intermixed_args(argv)
    try:
        cfg = load_config(args.config, args.overrides, schema=RewardModelRunConfig)
        validate_reward_training(cfg, launched_world_size())
    except ConfigError as e:
        print(f"rlhf-train-rm: config error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_yaml(cfg))
        return 0
    run(cfg)
    return 0


def entry() -> NoReturn:
    """The `rlhf-train-rm` command (`main`; the process ends as rlhf-train's does)."""
    from rlhf.utils import exit_process

    exit_process(main())


if __name__ == "__main__":
    entry()

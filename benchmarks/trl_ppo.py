"""TRL's PPOTrainer (trl 1.12, `trl.experimental.ppo`) on the work of an rlhf PPO step.

    python benchmarks/trl_ppo.py MODEL_DIR TRAIN_PARQUET --steps 5 [--prompts 16 --n 2 ...]

The second yardstick of `benchmarks/ppo_vs_plain.py` (`--yardstick trl`), next to
`plain_ppo.py`. Per step, `prompts * n` queries (each prompt `n` times; TRL samples one
response a query), `response`-token responses at temperature 1, a critic (a one-label
sequence classifier on the policy's weights, as TRL takes it), a frozen reference, one
epoch of one mini-batch. Where rlhf scores with a rule, TRL takes a reward model: a second
one-label classifier, timed as the step's `reward`.

TRL computes the old log-probs from the generation's own logits (no pass of their own), and
updates policy and critic together, with one loss and one AdamW. Its stages here: `gen`
(`batch_generation`), `ref` (the reference's forward), `values` and `reward` (`get_reward`
of each model), and `update`: the rest of the step (advantages, the PPO epoch, TRL's
`gc.collect()` and bookkeeping).

Prints one JSON object per step: `t_start` (wall clock at the step's start), `tokens`
(prompt + response tokens, padding excluded), and seconds per stage under rlhf's
`timing_s/*` names.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch
from datasets import Dataset
from plain_ppo import load_prompts, yardstick_parser  # the same prompts and arguments
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    TrainerCallback,
)
from transformers.trainer_callback import PrinterCallback
from trl.experimental.ppo import PPOConfig, PPOTrainer
from trl.experimental.ppo import ppo_trainer as trl_ppo


def parse_args() -> argparse.Namespace:
    parser = yardstick_parser(__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=2e-4)
    return parser.parse_args()


class StageClock(TrainerCallback):
    """Seconds per stage of each step: TRL's module functions are wrapped (`wrap`), and
    each step's row is printed when TRL ends the step."""

    def __init__(self, ref_model, reward_model, pad: int):
        self.ref_model, self.reward_model, self.pad = ref_model, reward_model, pad
        self.spent: dict[str, float] = defaultdict(float)
        self.tokens = 0
        self.start = time.perf_counter()
        self.t_start = time.time()
        self.step = 0

    def timed(self, stage: Callable[..., str], fn: Callable) -> Callable:
        """`fn` with its seconds added to the stage `stage(*args)` names ("" to the rest)."""

        def call(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                name = stage(*args)
                if name:
                    self.spent[name] += time.perf_counter() - begin

        return call

    def generated(self, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            query_responses, logits = fn(*args, **kwargs)
            self.tokens += int((query_responses != self.pad).sum())
            return query_responses, logits

        return call

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        step_s = now - self.start
        stages = {f"timing_s/{k}": v for k, v in self.spent.items()}
        stages["timing_s/update"] = step_s - sum(stages.values())
        self.step += 1
        row = {"step": self.step, "t_start": self.t_start, "tokens": self.tokens, **stages}
        print(json.dumps({**row, "timing_s/step": step_s}), flush=True)
        self.spent.clear()
        self.tokens, self.start, self.t_start = 0, now, time.time()


def wrap(clock: StageClock) -> None:
    """Time TRL's generation, the reference's forward (TRL's `forward` also runs the policy
    in the update: that goes to the rest) and each `get_reward` model."""
    trl_ppo.batch_generation = clock.timed(
        lambda *a: "gen", clock.generated(trl_ppo.batch_generation)
    )
    trl_ppo.forward = clock.timed(
        lambda model, *a: "ref" if model is clock.ref_model else "", trl_ppo.forward
    )
    trl_ppo.get_reward = clock.timed(
        lambda model, *a: "reward" if model is clock.reward_model else "values",
        trl_ppo.get_reward,
    )


def main() -> None:
    args = parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    queries = [ids for ids, _ in load_prompts(args.train_file, tokenizer) for _ in range(args.n)]
    batch = args.prompts * args.n
    data = Dataset.from_dict({"input_ids": queries * (args.steps * batch // len(queries) + 1)})
    policy = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    ref = copy.deepcopy(policy).eval()
    critic, reward = (
        AutoModelForSequenceClassification.from_pretrained(
            args.model_dir, num_labels=1, dtype=torch.float32
        )
        for _ in range(2)
    )
    for model in (critic, reward):
        model.config.pad_token_id = tokenizer.pad_token_id
    clock = StageClock(ref, reward, tokenizer.pad_token_id)
    wrap(clock)
    with tempfile.TemporaryDirectory() as out:
        config = PPOConfig(
            output_dir=str(Path(out) / "trl"),
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=1,
            num_mini_batches=1,
            num_ppo_epochs=1,
            total_episodes=batch * args.steps,
            response_length=args.response,
            local_rollout_forward_batch_size=batch,
            temperature=1.0,
            kl_coef=args.kl_coef,
            learning_rate=args.lr,
            stop_token="eos",
            num_sample_generations=0,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=10**9,
            disable_tqdm=True,
        )
        trainer = PPOTrainer(
            args=config,
            processing_class=tokenizer,
            model=policy,
            ref_model=ref,
            reward_model=reward,
            train_dataset=data,
            value_model=critic,
            callbacks=[clock],
        )
        trainer.remove_callback(PrinterCallback)  # its log lines would read as rows
        clock.start, clock.t_start = time.perf_counter(), time.time()
        trainer.train()


if __name__ == "__main__":
    main()

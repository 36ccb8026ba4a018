"""The trainer's forward-only passes against a plain transformers forward, in one process.

    python benchmarks/forward_passes.py [--hidden 256 --layers 3 --samples 32 --response 16]

Builds the quickstart's models on one rank (a tiny Qwen2, random weights, the quickstart
tokenizer; actor, reference and critic as `rlhf-train` builds them from
configs/quickstart_cpu.yaml; freed memory kept mapped as in a CPU trainer's process,
`rlhf.utils.keep_freed_memory`, for both sides) and a batch of `--samples` sequences
(prompts of 28-40 tokens, `--response`-token responses). Times, median of `--repeats`
after a warm-up:

- `old_log_prob`, `ref`, `values`: the trainer's passes (`PPOEngine.logprobs` of the actor
  and of the reference, `.values`) over that batch, micro-batched as the config says;
- `plain_logprobs`: transformers' `AutoModelForCausalLM` over the same sequences, right-padded
  in one batch, log-softmax and the response tokens' log-probs (with the CPU compatibility
  layer's function mode paused, as in a plain loop's own process);
- `plain_values`: `AutoModelForTokenClassification` (one label) over them, the values.

Prints one JSON object: the seconds of each and each pass's ratio to its plain forward.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("overrides", nargs="*", help="extra config overrides (key=value)")
    return parser.parse_args()


def timed(fn, repeats: int) -> float:
    fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def make_batch(samples: int, response: int, vocab: int):
    from rlhf.rollout.batch import RolloutBatch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(28, 41, (samples,), generator=gen).tolist()
    return RolloutBatch(
        prompt_ids=[torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths],
        response_ids=[torch.randint(0, vocab, (response,), generator=gen).tolist()] * samples,
        scores_b=torch.zeros(samples),
        data_sources=["bench"] * samples,
        uids=[str(i) for i in range(samples)],
    )


def plain_side(model_dir: Path, batch):
    """(log-probs pass, values pass) of transformers over the batch, right-padded, each run
    with Megatron's CPU compatibility mode off (`rlhf.distributed.cpu_compat`: a function
    mode every torch call goes through, which a plain loop in its own process does not
    have; it cost transformers' forward here ~20%)."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from rlhf.distributed import cpu_compat

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    critic = AutoModelForTokenClassification.from_pretrained(
        model_dir, num_labels=1, dtype=torch.float32
    ).eval()
    rows = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    longest = max(map(len, rows))
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    targets = ids[:, 1:, None]

    @torch.no_grad()
    def logprobs():
        with cpu_compat.paused():  # as in a process of its own, without the CPU layer's mode
            logits = policy(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            return torch.log_softmax(logits, -1).gather(2, targets)[..., 0]

    @torch.no_grad()
    def values():
        with cpu_compat.paused():
            return critic(input_ids=ids, attention_mask=mask).logits[:, :-1, 0].float()

    return logprobs, values


def main() -> None:
    args = parse_args()
    from rlhf.config import load_config
    from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
    from rlhf.utils import keep_freed_memory

    keep_freed_memory()  # as a CPU trainer's process starts (rlhf.cli.train.run)

    with tempfile.TemporaryDirectory() as tmp:
        model = save_tiny_model(Path(tmp) / "model", TinyModelSpec.scaled(args.hidden, args.layers))
        ctx = init_parallel("cpu")
        try:
            seed_everything(0)
            result = measure(args, model, ctx, load_config)
        finally:
            teardown()
    print(json.dumps(result, indent=2))


def measure(args, model: Path, ctx, load_config) -> dict:
    from rlhf.engine.build import build_engine
    from rlhf.trainer.preflight import load_policy_arch

    overrides = [f"actor_rollout_ref.model.path={model}", f"critic.model.path={model}"]
    overrides += [f"data.max_response_length={args.response}", *args.overrides]
    cfg = load_config(str(REPO / "configs" / "quickstart_cpu.yaml"), overrides)
    arch = load_policy_arch(cfg)
    engine = build_engine(cfg, arch, ctx, total_steps=1)
    batch = make_batch(args.samples, args.response, arch.vocab_size)
    plain_logprobs, plain_values = plain_side(model, batch)
    seconds = {
        "old_log_prob": timed(lambda: engine.logprobs(batch), args.repeats),
        "ref": timed(lambda: engine.logprobs(batch, "ref"), args.repeats),
        "values": timed(lambda: engine.values(batch), args.repeats),
        "plain_logprobs": timed(plain_logprobs, args.repeats),
        "plain_values": timed(plain_values, args.repeats),
    }
    plain = {"old_log_prob": "plain_logprobs", "ref": "plain_logprobs", "values": "plain_values"}
    return {
        "setup": vars(args),
        "tokens": sum(len(p) + len(r) for p, r in zip(batch.prompt_ids, batch.response_ids)),
        "seconds": seconds,
        "ratio": {k: seconds[k] / seconds[v] for k, v in plain.items()},
    }


if __name__ == "__main__":
    main()

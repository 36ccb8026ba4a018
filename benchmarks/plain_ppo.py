"""A plain PPO loop in one process: PyTorch and transformers only, no framework.

    python benchmarks/plain_ppo.py MODEL_DIR TRAIN_PARQUET --steps 5 [--prompts 16 --n 2 ...]

The yardstick of `benchmarks/ppo_vs_plain.py`: the same work as an rlhf PPO step with a critic
and GAE, written the obvious way. Per step: HF `generate` (KV cache, sampling) of `n`
responses to each of `prompts` prompts; a `####` rule reward; old log-probs (actor),
reference log-probs and values (critic: a one-label token classifier on the same weights) on
right-padded rows; KL-penalised token rewards, GAE; one epoch of one mini-batch: critic update
(clipped value loss) then actor update (clipped surrogate), AdamW with grad clipping.

Prints one JSON object per step: `t_start` (wall clock at the step's start), `tokens`
(prompt + response tokens), and seconds per stage under rlhf's `timing_s/*` names.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import re
import time

import pyarrow.parquet as pq
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification, AutoTokenizer


def yardstick_parser(description: str) -> argparse.ArgumentParser:
    """The arguments `ppo_vs_plain.py` gives a yardstick (this loop, `trl_ppo.py`)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("model_dir")
    parser.add_argument("train_file")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--response", type=int, default=16, help="max new tokens")
    parser.add_argument("--kl-coef", type=float, default=0.001)
    return parser


def parse_args() -> argparse.Namespace:
    parser = yardstick_parser(__doc__.splitlines()[0])
    parser.add_argument("--clip", type=float, default=0.2)
    parser.add_argument("--value-clip", type=float, default=0.5)
    parser.add_argument("--actor-lr", type=float, default=2e-4)
    parser.add_argument("--critic-lr", type=float, default=1e-3)
    return parser.parse_args()


def load_prompts(path: str, tokenizer) -> list[tuple[list[int], str]]:
    table = pq.read_table(path).to_pylist()
    texts = [
        tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        for row in table
    ]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [(list(i), str(row["reward_model"]["ground_truth"])) for i, row in zip(ids, table)]


def rule_score(text: str, truth: str) -> float:
    found = re.findall(r"####\s*(-?[\d,]*\.?\d+)", text)
    return float(bool(found) and found[-1].replace(",", "") == truth)


def generate(actor, tokenizer, prompts, n: int, max_new: int):
    """Left-padded batch generation; the responses (to the first EOS, inclusive)."""
    width = max(len(p) for p, _ in prompts)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in prompts])
    starts = torch.tensor([width - len(p) for p, _ in prompts])
    mask = torch.arange(width)[None] >= starts[:, None]
    with torch.no_grad():
        out = actor.generate(
            input_ids=ids,
            attention_mask=mask.long(),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max_new,
            num_return_sequences=n,
            pad_token_id=pad,
            eos_token_id=tokenizer.eos_token_id,
        )
    responses = []
    for row in out[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        responses.append(row[:end])
    return responses


def padded(prompts: list[list[int]], responses: list[list[int]], pad: int):
    """Right-padded rows, attention mask, and the response-token mask over positions 1..L-1."""
    rows = [p + r for p, r in zip(prompts, responses)]
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    attention = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    response = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        response[i, len(p) - 1 : len(p) - 1 + len(r)] = True
    return tokens, attention, response


def logprobs(model, tokens, attention):
    logits = model(input_ids=tokens, attention_mask=attention).logits[:, :-1].float()
    return torch.gather(F.log_softmax(logits, -1), 2, tokens[:, 1:, None])[..., 0]


def values_of(critic, tokens, attention):
    return critic(input_ids=tokens, attention_mask=attention).logits[:, :-1, 0].float()


def gae(rewards, values, mask, gamma: float = 1.0, lam: float = 1.0):
    """Advantages and returns over the masked response positions (right to left)."""
    advantages = torch.zeros_like(rewards)
    last = torch.zeros(rewards.shape[0])
    next_value = torch.zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t].float()
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * m + last * (1 - m)
        next_value = values[:, t] * m + next_value * (1 - m)
        advantages[:, t] = last * m
    returns = advantages + values
    mean, std = advantages[mask].mean(), advantages[mask].std()
    return (advantages - mean) / (std + 1e-8) * mask, returns


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum()


def update(optimizer, params, loss) -> None:
    optimizer.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()


class Clock:
    """Seconds per named stage: `with clock("gen"): ...`."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.seconds[f"timing_s/{name}"] = time.perf_counter() - start


def ppo_step(args, models, optimizers, tokenizer, picked, clock: Clock) -> int:
    """One PPO step on the `picked` (prompt ids, ground truth) pairs; its token count."""
    actor, ref, critic = models
    actor.eval()
    with clock("gen"):
        responses = generate(actor, tokenizer, picked, args.n, args.response)
    prompts = [p for p, _ in picked for _ in range(args.n)]
    truths = [t for _, t in picked for _ in range(args.n)]
    with clock("reward"):
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        scores = torch.tensor([rule_score(text, t) for text, t in zip(texts, truths)])
    tokens, attention, mask = padded(prompts, responses, tokenizer.pad_token_id)
    with torch.no_grad():
        with clock("old_log_prob"):
            old = logprobs(actor, tokens, attention)
        with clock("ref"):
            ref_lp = logprobs(ref, tokens, attention)
        with clock("values"):
            values = values_of(critic, tokens, attention) * mask
    with clock("adv"):
        rewards = -args.kl_coef * (old - ref_lp) * mask
        last = mask.long().cumsum(1).argmax(1)
        rewards[torch.arange(len(prompts)), last] += scores
        adv, returns = gae(rewards, values, mask)
    actor.train()
    with clock("update_critic"):
        new = values_of(critic, tokens, attention)
        clipped = values + (new - values).clamp(-args.value_clip, args.value_clip)
        loss = 0.5 * torch.maximum((new - returns) ** 2, (clipped - returns) ** 2)
        update(optimizers[1], list(critic.parameters()), masked_mean(loss, mask))
    with clock("update_actor"):
        ratio = torch.exp(logprobs(actor, tokens, attention) - old)
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - args.clip, 1 + args.clip))
        update(optimizers[0], list(actor.parameters()), masked_mean(surrogate, mask))
    return sum(len(p) + len(r) for p, r in zip(prompts, responses))


def main() -> None:
    args = parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    actor = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    ref = copy.deepcopy(actor).eval()
    critic = AutoModelForTokenClassification.from_pretrained(
        args.model_dir, num_labels=1, dtype=torch.float32
    )
    optimizers = (
        torch.optim.AdamW(actor.parameters(), lr=args.actor_lr, weight_decay=0.0),
        torch.optim.AdamW(critic.parameters(), lr=args.critic_lr, weight_decay=0.0),
    )
    data = load_prompts(args.train_file, tokenizer)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    for step in range(args.steps):
        clock, t_start, start = Clock(), time.time(), time.perf_counter()
        picked = [data[order[(step * args.prompts + i) % len(data)]] for i in range(args.prompts)]
        tokens = ppo_step(args, (actor, ref, critic), optimizers, tokenizer, picked, clock)
        clock.seconds["timing_s/step"] = time.perf_counter() - start
        row = {"step": step + 1, "t_start": t_start, "tokens": tokens, **clock.seconds}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()

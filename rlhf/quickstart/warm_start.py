"""Warm start for the CPU quickstart: turn a random tiny model into a weak "base model".

PPO learns only from rewards it sees. A randomly initialised model never writes
`#### <correct number>`, so every reward is 0 and the quickstart would show nothing. Real
RLHF starts from a pretrained model that already answers in the right format and is right
some of the time; this module gives the tiny model that kind of start in about a minute.

It is a short supervised fine-tuning on the response tokens of arithmetic problems drawn with
a seed disjoint from the quickstart data. The final targets say: the correct answer with
probability `p_correct`, otherwise any other number in 0..18 equally likely. Two choices make
this learnable in about a thousand steps (sampled wrong labels were measured to leave the model
at the answers' marginal distribution, which ignores the prompt):
- the targets are that distribution itself, as next-token probabilities along the correct
  response, not sampled wrong answers, so there is no label noise;
- the first steps target the correct answer alone (the model learns to read the numbers),
  then the targets move to the mix (the model learns to be unsure).
The model then puts about `p_correct` on the right answer of unseen prompts, is right about
that often when sampled at temperature 1, and PPO has a signal to sharpen.

A mixture-of-experts model is warm-started the same way plus a load-balancing loss per layer,
as MoE models are pretrained: without it the tiny Qwen3-MoE came out with two of its eight
experts getting 0.4% and 0.5% of one layer's tokens (a uniform share is 12.5%).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedTokenizerBase,
)

from rlhf.quickstart.arithmetic import make_problems

MAX_ANSWER = 18  # the largest answer of rlhf.quickstart.arithmetic (9 + 9)


@dataclass(frozen=True)
class WarmStartConfig:
    """How the warm start trains; the defaults are the quickstart's."""

    num_problems: int = 4096  # training problems (make_problems with `data_seed`)
    data_seed: int = 12345  # not the quickstart data's seed (0)
    p_correct: float = 0.35  # probability of the correct answer in the final targets
    num_steps: int = 1000  # optimizer steps
    clean_fraction: float = 0.4  # leading fraction of the steps that targets the correct answer
    anneal_fraction: float = 0.2  # next fraction, over which the targets move to the mix
    batch_size: int = 64  # sequences per step
    lr: float = 3e-3  # peak AdamW learning rate (linear warmup, cosine decay to 10%)
    warmup_steps: int = 30  # steps of linear warmup
    weight_decay: float = 0.0  # AdamW weight decay
    load_balancing_coef: float = 0.01  # weight of `load_balancing_loss` (models with experts)
    seed: int = 0  # batch shuffling
    # torch CPU threads. One: measured on 2 cores (benchmarks/warm_start.py), 2 threads are
    # 1.6x faster alone but 9x slower while other processes keep the cores busy (a thread
    # that is not running stalls every op), 1 thread only 1.6x slower under that load.
    num_threads: int = 1

    def __post_init__(self) -> None:
        for key in ("p_correct", "clean_fraction", "anneal_fraction"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                raise ValueError(f"warm_start.{key} must be in [0, 1], got {getattr(self, key)}")
        if self.clean_fraction + self.anneal_fraction > 1.0:
            raise ValueError(
                "warm_start.clean_fraction + warm_start.anneal_fraction must be <= 1, got "
                f"{self.clean_fraction} + {self.anneal_fraction}"
            )
        for key in ("num_problems", "num_steps", "batch_size", "num_threads"):
            if getattr(self, key) < 1:
                raise ValueError(f"warm_start.{key} must be >= 1, got {getattr(self, key)}")
        if self.load_balancing_coef < 0:
            raise ValueError(
                f"warm_start.load_balancing_coef must be >= 0, got {self.load_balancing_coef}"
            )
        if self.lr <= 0:
            raise ValueError(f"warm_start.lr must be > 0, got {self.lr}")
        if self.warmup_steps < 0:
            raise ValueError(f"warm_start.warmup_steps must be >= 0, got {self.warmup_steps}")


@dataclass(frozen=True)
class WarmStartResult:
    """What one warm start did."""

    num_steps: int
    final_loss: float  # mean response-token loss over the last 10% of steps
    target_entropy: float  # the lowest final_loss possible: entropy of the final targets
    seconds: float  # wall time of the training loop
    # mean `load_balancing_loss` over the last 10% of steps (1: experts used evenly); None
    # for a model without experts
    final_load_balancing_loss: float | None = None


@dataclass(frozen=True)
class SftExamples:
    """Training data: each row is a prompt followed by its correct response.

    input_ids_nt: [N, T] prompt + response ids, right-padded with the pad id.
    position_nr: [N, R] index into T of the logits that predict response token r.
    labels_nr: [N, R] response token r (the correct answer's path).
    mixed_nrv: [N, R, V] next-token distribution at step r when the whole response is drawn
        from `answer_distribution` (the final targets).
    mask_nr: [N, R] True where response token r exists.
    tokens_nt: [N, T] True at the prompt and response tokens, False at the padding.
    """

    input_ids_nt: torch.Tensor
    position_nr: torch.Tensor
    labels_nr: torch.Tensor
    mixed_nrv: torch.Tensor
    mask_nr: torch.Tensor
    tokens_nt: torch.Tensor


def answer_distribution(
    truth: int, p_correct: float, answers: Sequence[int] = range(MAX_ANSWER + 1)
) -> list[float]:
    """Probabilities of `answers` (default 0..18): `p_correct` on `truth`, the rest spread
    evenly."""
    wrong = (1.0 - p_correct) / (len(answers) - 1)
    return [p_correct if a == truth else wrong for a in answers]


def path_targets(
    responses: list[list[int]], probs: list[float], path: int, vocab_size: int
) -> torch.Tensor:
    """[len(responses[path]), V]: at each step of response `path`, the distribution of the
    next token when a whole response is drawn with `probs` (its conditional given the prefix).

    Trained along the correct path, these put `probs[path]` on the correct response and the
    right mass on each first step away from it, with no label noise; how a wrong answer ends
    is learnt from the problems whose correct path it is.
    """
    ids = responses[path]
    targets = torch.zeros(len(ids), vocab_size)
    for step in range(len(ids)):
        prefix = ids[:step]
        for response, prob in zip(responses, probs):
            if response[:step] == prefix:
                targets[step, response[step]] += prob
    return targets / targets.sum(dim=-1, keepdim=True)


def prompt_ids(tokenizer: PreTrainedTokenizerBase, row: dict) -> list[int]:
    """Token ids of a row's chat prompt, ending with the assistant header."""
    return list(
        tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def build_examples(
    tokenizer: PreTrainedTokenizerBase, cfg: WarmStartConfig, vocab_size: int
) -> SftExamples:
    """One example per problem of `cfg`, its targets from `answer_distribution`."""
    responses = [
        [*tokenizer(f"#### {a}", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        for a in range(MAX_ANSWER + 1)
    ]
    rows = make_problems(cfg.num_problems, cfg.data_seed)
    num, max_resp = len(rows), max(len(r) for r in responses)
    prompts = [prompt_ids(tokenizer, row) for row in rows]
    examples = SftExamples(
        input_ids_nt=torch.full((num, max(map(len, prompts)) + max_resp), tokenizer.pad_token_id),
        position_nr=torch.zeros(num, max_resp, dtype=torch.long),
        labels_nr=torch.zeros(num, max_resp, dtype=torch.long),
        mixed_nrv=torch.zeros(num, max_resp, vocab_size),
        mask_nr=torch.zeros(num, max_resp, dtype=torch.bool),
        tokens_nt=torch.zeros(num, max(map(len, prompts)) + max_resp, dtype=torch.bool),
    )
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        truth = int(row["reward_model"]["ground_truth"])
        response = responses[truth]
        probs = answer_distribution(truth, cfg.p_correct)
        steps, start = len(response), len(prompt) - 1
        examples.input_ids_nt[i, : start + 1 + steps] = torch.tensor(prompt + response)
        examples.position_nr[i, :steps] = torch.arange(start, start + steps)
        examples.labels_nr[i, :steps] = torch.tensor(response)
        examples.mixed_nrv[i, :steps] = path_targets(responses, probs, truth, vocab_size)
        examples.mask_nr[i, :steps] = True
        examples.tokens_nt[i, : start + 1 + steps] = True
    return examples


def target_entropy(examples: SftExamples) -> float:
    """Mean entropy of the final targets over response tokens (the loss of a perfect fit)."""
    p_nrv = examples.mixed_nrv
    entropy_nr = -(p_nrv * torch.log(p_nrv.clamp_min(1e-30))).sum(dim=-1)
    return (entropy_nr[examples.mask_nr]).mean().item()


def lr_factor(step: int, cfg: WarmStartConfig) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 at the last step."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.num_steps - cfg.warmup_steps)
    return 0.1 + 0.45 * (1.0 + math.cos(math.pi * progress))


def mix_weight(step: int, cfg: WarmStartConfig) -> float:
    """Weight of the mixed targets at `step`: 0 while clean, rising linearly to 1."""
    clean = cfg.clean_fraction * cfg.num_steps
    anneal = cfg.anneal_fraction * cfg.num_steps
    if step < clean:
        return 0.0
    return 1.0 if step >= clean + anneal else (step - clean) / anneal


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...], tokens: torch.Tensor, top_k: int
) -> torch.Tensor:
    """Switch Transformer's load-balancing loss per layer, averaged over the layers: E x the
    sum over experts of (share of the top-k picks) x (mean router probability), counted at
    `tokens` (True where a token is not padding). 1 when the experts are used evenly.

    router_logits: per layer [B * T, E]; tokens: [B, T].
    """
    mask = tokens.reshape(-1)
    losses = []
    for logits_xe in router_logits:
        probs_xe = torch.softmax(logits_xe[mask].float(), dim=-1)
        num_experts = probs_xe.shape[-1]
        picks = torch.topk(probs_xe, top_k, dim=-1).indices.reshape(-1)
        share_e = torch.bincount(picks, minlength=num_experts) / picks.numel()
        losses.append(num_experts * (share_e * probs_xe.mean(dim=0)).sum())
    return torch.stack(losses).mean()


def response_loss(
    model: torch.nn.Module, examples: SftExamples, idx: torch.Tensor, mix: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Mean cross-entropy over response tokens against (1 - mix) correct + mix mixed targets,
    and the `load_balancing_loss` of the same forward for a model with experts (else None)."""
    # Right padding needs no attention mask: causal attention never looks ahead to it.
    top_k = getattr(model.config, "num_experts_per_tok", None)
    router = {"output_router_logits": True} if top_k else {}
    out = model(input_ids=examples.input_ids_nt[idx], **router)
    logits_btv = out.logits
    position_brv = examples.position_nr[idx, :, None].expand(-1, -1, logits_btv.shape[-1])
    logp_brv = torch.log_softmax(torch.gather(logits_btv, 1, position_brv).float(), dim=-1)
    clean_br = -torch.gather(logp_brv, 2, examples.labels_nr[idx, :, None]).squeeze(-1)
    mixed_br = -(examples.mixed_nrv[idx] * logp_brv).sum(dim=-1)
    loss_br = (1.0 - mix) * clean_br + mix * mixed_br
    mask_br = examples.mask_nr[idx]
    loss = (loss_br * mask_br).sum() / mask_br.sum()
    if not top_k:
        return loss, None
    return loss, load_balancing_loss(out.router_logits, examples.tokens_nt[idx], top_k)


# (model, examples, batch indices, mix weight) -> (loss, load-balancing loss or None)
LossFn = Callable[[torch.nn.Module, Any, torch.Tensor, float], tuple[torch.Tensor, Any]]


def train(
    model: torch.nn.Module, examples: Any, cfg: WarmStartConfig, loss_fn: LossFn = response_loss
) -> tuple[list[float], list[float]]:
    """`cfg.num_steps` AdamW steps on shuffled batches of `examples` (anything with an
    `input_ids_nt` of one row per example); the `loss_fn` loss of every step (default: the
    response loss) and, for a model with experts, its load-balancing loss (else an empty
    list)."""
    generator = torch.Generator().manual_seed(cfg.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
    num = len(examples.input_ids_nt)
    order, cursor, losses, balances = torch.randperm(num, generator=generator), 0, [], []
    model.train()
    for step in range(cfg.num_steps):
        if cursor + cfg.batch_size > num:
            order, cursor = torch.randperm(num, generator=generator), 0
        idx = order[cursor : cursor + cfg.batch_size]
        cursor += cfg.batch_size
        loss, balance = loss_fn(model, examples, idx, mix_weight(step, cfg))
        optimizer.zero_grad(set_to_none=True)
        if balance is None:
            loss.backward()
        else:
            (loss + cfg.load_balancing_coef * balance).backward()
            balances.append(balance.item())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    model.eval()
    return losses, balances


def warm_start(model_dir: str | Path, cfg: WarmStartConfig = WarmStartConfig()) -> WarmStartResult:
    """Fine-tune the model in `model_dir` as described above and save it back in place."""
    return fine_tune(
        model_dir,
        cfg,
        lambda tokenizer, vocab_size: build_examples(tokenizer, cfg, vocab_size),
        response_loss,
        target_entropy,
    )


def fine_tune(
    model_dir: str | Path,
    cfg: WarmStartConfig,
    build: Callable[[PreTrainedTokenizerBase, int], Any],
    loss_fn: LossFn,
    entropy: Callable[[Any], float],
) -> WarmStartResult:
    """Train the model in `model_dir` on the examples `build(tokenizer, vocab_size)` makes,
    with `loss_fn` and the optimizer settings of `cfg`, and save it back in place;
    `entropy(examples)` is the loss of a perfect fit."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"no HF model in {model_dir} (build one with make_tiny_model.py)")
    torch.manual_seed(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    examples = build(tokenizer, model.config.vocab_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.num_threads)
    try:
        start = time.perf_counter()
        losses, balances = train(model, examples, cfg, loss_fn)
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    model.save_pretrained(model_dir, safe_serialization=True)
    return WarmStartResult(
        num_steps=len(losses),
        final_loss=tail_mean(losses),
        target_entropy=entropy(examples),
        seconds=seconds,
        final_load_balancing_loss=tail_mean(balances) if balances else None,
    )


def tail_mean(values: list[float]) -> float:
    """The mean of the last 10% of `values` (at least one)."""
    tail = values[-max(1, len(values) // 10) :]
    return sum(tail) / len(tail)

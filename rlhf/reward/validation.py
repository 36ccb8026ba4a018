"""Validation metrics of N responses per prompt, under verl's names.

Per data source, with N = the responses sampled per prompt (`rollout.val_kwargs.n`, or
`rlhf-eval --n`), and the reward key `reward` (the score each response got):

- `val-core/<data_source>/reward/mean@N`: the mean score over all responses.
- `val-core/<data_source>/reward/best@N` (N > 1): the mean over prompts of the best of the
  prompt's N scores (exact, not bootstrapped).
- `val-core/<data_source>/reward/maj@N` (N > 1): the mean over prompts of the score of the
  prompt's majority answer. Responses vote with their final answer as the data source's rule
  extracts and normalises it (gsm8k: the number after `####`, `12.50` = `12.5`; math: the last
  `\\boxed{}`, `0.5` = `\\frac{1}{2}`); responses without an answer do not vote. The most
  frequent answer wins (a tie goes to the answer given first) and the prompt scores the mean
  score of the responses that gave it; a prompt without any answer scores the mean of its
  responses. Only data sources with an answer extractor (`rlhf.reward.registry`) report it.
- `val/test_score/<data_source>` and `val/test_score/all`: mean scores (the names the early
  stopper, `rlhf-plot` and older dashboards read).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.reward.registry import RuleSettings, answer_extractor

REWARD_KEY = "reward"


@dataclass(frozen=True)
class ValSample:
    """One scored validation response; `answer` is its canonical final answer (None: none)."""

    data_source: str
    uid: str
    score: float
    answer: str | None


def val_samples(
    data_sources: Sequence[str],
    uids: Sequence[str],
    scores: Sequence[float],
    texts: Sequence[str],
    reward_cfg: Any,
) -> list[ValSample]:
    """The samples of one validation round, with the answers their texts give."""
    settings = RuleSettings.of(reward_cfg)
    samples = []
    for source, uid, score, text in zip(data_sources, uids, scores, texts, strict=True):
        extract = answer_extractor(source)
        answer = extract(text, settings) if extract is not None else None
        samples.append(ValSample(source, uid, float(score), answer))
    return samples


def majority_score(group: Sequence[ValSample]) -> float:
    """The mean score of the responses that gave the most frequent answer (see the module)."""
    votes = Counter(s.answer for s in group if s.answer is not None)
    if not votes:
        return sum(s.score for s in group) / len(group)
    top = max(votes.values())
    winner = next(s.answer for s in group if s.answer is not None and votes[s.answer] == top)
    chosen = [s.score for s in group if s.answer == winner]
    return sum(chosen) / len(chosen)


def _source_metrics(source: str, samples: list[ValSample]) -> dict[str, float]:
    by_prompt: dict[str, list[ValSample]] = defaultdict(list)
    for sample in samples:
        by_prompt[sample.uid].append(sample)
    groups = list(by_prompt.values())
    n = Counter(len(g) for g in groups).most_common(1)[0][0]
    prefix = f"val-core/{source}/{REWARD_KEY}"
    metrics = {f"{prefix}/mean@{n}": sum(s.score for s in samples) / len(samples)}
    if n > 1:
        metrics[f"{prefix}/best@{n}"] = sum(max(s.score for s in g) for g in groups) / len(groups)
        if answer_extractor(source) is not None:
            metrics[f"{prefix}/maj@{n}"] = sum(majority_score(g) for g in groups) / len(groups)
    return metrics


def validation_metrics(samples: Sequence[ValSample]) -> dict[str, float]:
    """mean@N, best@N, maj@N per data source and the mean scores (see the module)."""
    by_source: dict[str, list[ValSample]] = defaultdict(list)
    for sample in samples:
        by_source[sample.data_source].append(sample)
    metrics: dict[str, float] = {}
    for source, group in sorted(by_source.items()):
        metrics |= _source_metrics(source, group)
        metrics[f"val/test_score/{source}"] = sum(s.score for s in group) / len(group)
    metrics["val/test_score/all"] = sum(s.score for s in samples) / len(samples)
    return metrics


def per_source_table(metrics: dict[str, float]) -> dict[str, dict[str, float]]:
    """`val-core/<source>/reward/<stat>` regrouped as {source: {stat: value}} (for tables)."""
    table: dict[str, dict[str, float]] = defaultdict(dict)
    for key, value in metrics.items():
        if key.startswith("val-core/"):
            source, stat = key[len("val-core/") :].rsplit(f"/{REWARD_KEY}/", 1)
            table[source][stat] = value
    return dict(table)

"""Model rewards (`reward_model.style=model`): a scalar-head model scores whole sequences.

The reward model is the value-model build of an HF `*ForSequenceClassification` checkpoint
(`rlhf.models.builder.value_model_from_hf`): its per-token outputs [b, s, 1] are the score
head applied at every position, and the reward of a sequence is the output at its last
token, which is what HF's sequence classifiers pool. Sequences are right-padded, so with
causal attention the padding cannot change that value.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def right_pad(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [b, s] right-padded with `pad_id`, and the lengths [b]."""
    if not sequences or min(len(s) for s in sequences) == 0:
        raise ValueError("model reward: every sequence needs at least one token")
    lengths = torch.tensor([len(s) for s in sequences])
    tokens = torch.full((len(sequences), int(lengths.max())), pad_id, dtype=torch.long)
    for row, seq in enumerate(sequences):
        tokens[row, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    return tokens, lengths


def last_token_values(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """values [b, s, 1] or [b, s] at position length-1 of each row: [b]."""
    if values.dim() == 3:
        values = values[..., 0]
    return values[torch.arange(values.shape[0]), lengths.to(values.device) - 1]


@torch.no_grad()
def score_sequences(
    model: Any,
    sequences: Sequence[Sequence[int]],
    pad_id: int,
    micro_batch_size: int | None = None,
) -> list[float] | None:
    """Reward of each prompt+response token sequence; None off the last pipeline stage."""
    from rlhf.models.forward import forward_logits

    tokens, lengths = right_pad(sequences, pad_id)
    device = next(model.parameters()).device
    values = forward_logits(model, tokens.to(device), micro_batch_size=micro_batch_size)
    if values is None:
        return None
    return last_token_values(values.float(), lengths).tolist()


def load_reward_model(path: str, placement: Any, params_dtype: torch.dtype = torch.float32):
    """This rank's reward model from an HF `*ForSequenceClassification` dir (eval mode)."""
    from pathlib import Path

    from rlhf.models.builder import value_model_from_hf
    from rlhf.models.hf_io import HFCheckpointReader

    if not Path(path).is_dir():
        raise FileNotFoundError(f"reward.model_path: directory not found: {path}")
    if "score.weight" not in HFCheckpointReader(path):
        raise ValueError(
            f"reward.model_path: {path} has no 'score.weight'; a reward model must be an HF "
            "*ForSequenceClassification checkpoint with num_labels=1"
        )
    model, _ = value_model_from_hf(path, placement, params_dtype=params_dtype)
    return model.eval()


class ModelReward:
    """Callable scoring token sequences with a loaded reward model (for `RewardScorer`)."""

    def __init__(self, model: Any, pad_id: int, micro_batch_size: int | None = None):
        self.model, self.pad_id, self.micro_batch_size = model, pad_id, micro_batch_size

    @classmethod
    def from_config(cls, reward_cfg: Any, placement: Any, pad_id: int, **kwargs: Any):
        if not reward_cfg.model_path:
            raise ValueError("reward.model_path is not set; model-style rows need a reward model")
        return cls(load_reward_model(reward_cfg.model_path, placement), pad_id, **kwargs)

    def __call__(self, sequences: Sequence[Sequence[int]]) -> list[float] | None:
        return score_sequences(self.model, sequences, self.pad_id, self.micro_batch_size)

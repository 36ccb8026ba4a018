"""Forward passes through Megatron's pipeline schedule (so PP works) returning full logits."""

from __future__ import annotations

import torch
import torch.distributed as dist


def gather_vocab(logits_local: torch.Tensor, tp_group, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits [..., V] from TP slices (for tests and verification only)."""
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        parts = [torch.empty_like(logits_local) for _ in range(dist.get_world_size(tp_group))]
        dist.all_gather(parts, logits_local.contiguous(), group=tp_group)
        logits_local = torch.cat(parts, dim=-1)
    return logits_local[..., :vocab_size]


@torch.no_grad()
def forward_logits(
    model,
    tokens_bs: torch.Tensor,
    micro_batch_size: int | None = None,
    sp=None,
    inputs: dict | None = None,
):
    """Local-vocabulary logits [b, s, V_local] on the last pipeline stage, None elsewhere.

    Runs Megatron's forward-only schedule over micro-batches, so any PP size works. With
    Ulysses (`sp`, a `SequenceShard` of size > 1) each rank feeds its zig-zag slice of the
    (padded) rows and the whole rows' logits are combined over the SP group. `inputs`: the
    model's further keyword inputs for the whole batch in one micro-batch (a vision-language
    model's `position_ids` [3, b, s], `pixel_values`, `image_grid_thw`).
    """
    if inputs is not None:
        micro_batch_size = tokens_bs.shape[0]
    if sp is not None and sp.size > 1:
        return _sequence_parallel_logits(model, tokens_bs, micro_batch_size, sp)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batch, seq = tokens_bs.shape
    micro = micro_batch_size or batch
    chunks = list(tokens_bs.split(micro))

    def forward_step(data_iterator, model):
        tokens = next(data_iterator)
        extra = dict(inputs or {})
        positions = extra.pop("position_ids", None)
        if positions is None:
            positions = torch.arange(seq, device=tokens.device).expand_as(tokens)
        output = model(tokens, positions, None, **extra)

        def keep(output_tensor):
            return output_tensor.sum() * 0.0, {"logits": output_tensor.detach().clone()}

        return output, keep

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(chunks),
        model=[model],
        num_microbatches=len(chunks),
        seq_length=seq,
        micro_batch_size=micro,
        forward_only=True,
    )
    if not outputs:
        return None
    return torch.cat([o["logits"] for o in outputs], dim=0)


def _sequence_parallel_logits(model, tokens_bs: torch.Tensor, micro_batch_size, sp):
    from rlhf.parallel.ulysses import combine_positions, zigzag_positions
    from rlhf.utils import round_up

    seq = tokens_bs.shape[1]
    padded = round_up(seq, 2 * sp.size)
    rows = torch.nn.functional.pad(tokens_bs, (0, padded - seq))
    positions = zigzag_positions(padded, sp.size, sp.rank)
    local = forward_logits(model, rows[:, positions].contiguous(), micro_batch_size)
    if local is None:
        return None
    return combine_positions(local, positions, padded, sp.group)[:, :seq]

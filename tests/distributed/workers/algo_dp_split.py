"""Worker: a fixed mini-batch split over data-parallel gloo ranks and micro-batches.

Every rank builds the same seeded mini-batch, keeps its own contiguous share of the rows,
cuts that share into micro-batches trimmed to their longest response, and computes every
loss with the global counts (all-reduced). The micro-batch losses are summed, the loss
and the gradient w.r.t. logp summed over ranks; advantages are whitened over the group.
Rank 0 writes `result.json`; the test compares it with the whole batch in one process.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf.algo import (
    aggregate_loss,
    compute_gae,
    global_batch_counts,
    masked_whiten,
    policy_loss,
)
from rlhf.config.choices import LOSS_AGG_MODES

WIDTH = 5
LENGTHS = [5, 3, 0, 1, 4, 2, 5, 3]  # one empty row; 23 tokens, 7 sequences
GAMMA, LAM = 0.9, 0.95


def make_batch() -> dict[str, torch.Tensor]:
    """The mini-batch (float64), identical in every process."""
    gen = torch.Generator().manual_seed(1234)
    batch = len(LENGTHS)
    logp = -3 * torch.rand(batch, WIDTH, generator=gen, dtype=torch.float64)
    return {
        "mask": torch.arange(WIDTH)[None, :] < torch.tensor(LENGTHS)[:, None],
        "logp": logp,
        "old_logp": logp + 0.3 * torch.randn(batch, WIDTH, generator=gen, dtype=torch.float64),
        "adv": torch.randn(batch, WIDTH, generator=gen, dtype=torch.float64),
        "rewards": torch.randn(batch, WIDTH, generator=gen, dtype=torch.float64),
        "values": torch.randn(batch, WIDTH, generator=gen, dtype=torch.float64),
    }


def token_loss(logp: torch.Tensor) -> torch.Tensor:
    """A nonlinear per-token loss for aggregate_loss: logp^2."""
    return logp.square()


def micro_batches(rows: list[int], mask: torch.Tensor, size: int) -> list[tuple[list[int], int]]:
    """(rows, width) pairs: `size` rows each, trimmed to their longest response."""
    chunks = [rows[i : i + size] for i in range(0, len(rows), size)]
    return [(c, max(1, int(mask[c].sum(1).max()))) for c in chunks]


def split_losses(b: dict, micro: list, group: dist.ProcessGroup) -> dict:
    """Per loss: micro-batch losses summed, then loss and grad summed over the group."""
    counts = global_batch_counts([b["mask"][r, :w] for r, w in micro], group=group)
    kw = dict(global_num_tokens=counts.num_tokens, global_num_seqs=counts.num_seqs)
    out = {}
    for mode in LOSS_AGG_MODES:
        for name in ("aggregate", "policy"):
            leaf = b["logp"].clone().requires_grad_()
            total, metrics = 0.0, torch.zeros(3, dtype=torch.float64)
            for rows, w in micro:
                logp, mask = leaf[rows, :w], b["mask"][rows, :w]
                if name == "aggregate":
                    loss = aggregate_loss(token_loss(logp), mask, mode, **kw, norm_length=WIDTH)
                else:
                    res = policy_loss(
                        logp,
                        b["old_logp"][rows, :w],
                        b["adv"][rows, :w],
                        mask,
                        0.2,
                        0.1,
                        0.3,
                        3.0,
                        mode,
                        **kw,
                        norm_length=WIDTH,
                    )
                    loss = res.loss
                    metrics += torch.stack([res.pg_clipfrac, res.pg_clipfrac_lower, res.ppo_kl])
                total = total + loss
            total.backward()
            summed = torch.cat([total.detach().view(1), metrics, leaf.grad.flatten()])
            dist.all_reduce(summed, group=group)
            out[f"{name}/{mode}"] = {
                "loss": summed[0].item(),
                "metrics": summed[1:4].tolist(),
                "grad": summed[4:].view(-1, WIDTH).tolist(),
            }
    return out


def gather_rows(local: torch.Tensor, group: dist.ProcessGroup) -> list:
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts).tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    group, rank, world = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    b = make_batch()
    share = len(LENGTHS) // world
    rows = list(range(rank * share, (rank + 1) * share))
    result = split_losses(b, micro_batches(rows, b["mask"], 2), group)
    mask, values = b["mask"][rows], b["values"][rows]
    result["whiten"] = gather_rows(masked_whiten(values, mask, group=group), group)
    adv, _ = compute_gae(b["rewards"][rows], values, mask, GAMMA, LAM, group=group)
    result["gae"] = gather_rows(adv, group)
    if rank == 0:
        Path(args.out_dir, "result.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

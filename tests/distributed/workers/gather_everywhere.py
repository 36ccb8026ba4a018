"""Worker: the buckets every rank gathers for the GPU tensor transport
(`SyncTopology.everywhere`) equal, bucket for bucket, the ones the sender alone gathers.

A model at a TP x PP x EP x expert-TP layout walks `iter_buckets` twice: sender only (the
CPU's and the other transports' way) and everywhere. Rank 0 writes OUT_DIR/report.json:
per rank, whether its everywhere buckets (names, dtypes, shapes, values, boundaries)
equal the sender's, and the number of buckets.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from rlhf.distributed import bootstrap


def digest(buckets) -> list[list[tuple]]:
    """Names, dtypes, shapes and a checksum of the values, bucket by bucket."""
    return [
        [(n, str(t.dtype), tuple(t.shape), t.double().sum().item(), t.device.type) for n, t in b]
        for b in buckets
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--hf-dir", "--out-dir"):
        parser.add_argument(flag, required=True)
    for flag in ("--tp", "--pp", "--ep"):
        parser.add_argument(flag, type=int, default=1)
    parser.add_argument("--etp", type=int, default=None)
    args = parser.parse_args()
    ctx = bootstrap.init_parallel(
        "cpu", tp_size=args.tp, pp_size=args.pp, ep_size=args.ep, etp_size=args.etp
    )
    from rlhf.models.builder import build_model, load_hf_weights
    from rlhf.models.families import load_arch
    from rlhf.models.hf_io import HFCheckpointReader
    from rlhf.weight_sync.gather import SyncTopology, iter_buckets

    topo = SyncTopology.of(ctx)
    arch = load_arch(args.hf_dir)
    model = build_model(arch, topo.placement, initialize=False)
    load_hf_weights(model, HFCheckpointReader(args.hf_dir), arch, topo.placement)
    sender_only = digest(iter_buckets(model, arch, topo, 4096))
    everywhere = digest(iter_buckets(model, arch, dataclasses.replace(topo, everywhere=True), 4096))
    reference = [sender_only if topo.is_sender else None]  # the sender is rank 0
    torch.distributed.broadcast_object_list(reference, src=0)
    mine = {"equal": everywhere == reference[0], "num_buckets": len(everywhere)}
    everyone = [None] * ctx.world_size
    torch.distributed.all_gather_object(everyone, mine)
    if ctx.rank == 0:
        (Path(args.out_dir) / "report.json").write_text(json.dumps(everyone))
    bootstrap.teardown()


if __name__ == "__main__":
    main()

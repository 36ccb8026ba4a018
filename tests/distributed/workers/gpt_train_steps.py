"""Worker: train a tiny Megatron GPTModel for a few steps under any TP/PP/DP layout.

Launched by torchrun from tests/distributed/test_megatron_parity.py. `--save-init DIR`
(1 process) writes the initial weights as a Megatron distributed checkpoint; `--load-init
DIR` starts every layout from those same weights, so that the losses and gradient norms
of all layouts can be compared with the 1-process run.
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from rlhf.distributed.bootstrap import init_parallel, seed_everything, teardown

VOCAB, SEQ, GLOBAL_BATCH, MICRO_BATCH = 64, 32, 8, 2


def transformer_config(tp: int, pp: int):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(
        num_layers=4,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        bias_activation_fusion=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )


def build(tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from rlhf.models.gpt import build_gpt_model

    config = transformer_config(tp, pp)
    model = build_gpt_model(
        config,
        VOCAB,
        SEQ,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(), model)
    config.finalize_model_grads_func = finalize_model_grads
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="sgd", lr=0.5, clip_grad=1.0, weight_decay=0.0), [ddp]
    )
    return model, ddp, opt


def batches(step: int, dp_rank: int, dp: int):
    """This DP rank's micro-batches of the global batch of `step` (same data for every layout)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    local = tokens.chunk(dp)[dp_rank]
    return [
        {"tokens": mb[:, :-1].contiguous(), "labels": mb[:, 1:].contiguous()}
        for mb in local.split(MICRO_BATCH)
    ]


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    positions = torch.arange(SEQ).unsqueeze(0).expand_as(batch["tokens"])
    loss_bs = model(batch["tokens"], positions, None, labels=batch["labels"])

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach().clone()}  # the schedule scales `loss` in place

    return loss_bs, partial(loss_func)


def train(args) -> list[dict]:
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model, ddp, opt = build(args.tp, args.pp)
    if args.load_init:
        from megatron.core import dist_checkpointing

        state = dist_checkpointing.load(model.sharded_state_dict(), args.load_init)
        model.load_state_dict(state)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    results = []
    for step in range(args.steps):
        micro = batches(step, dp_rank, dp)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        losses = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro),
            model=[ddp],
            num_microbatches=len(micro),
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        _, grad_norm, _ = opt.step()
        loss = torch.zeros(1)
        if ps.is_pipeline_last_stage():
            loss += torch.stack([x["loss"] for x in losses]).mean()
            dist.all_reduce(loss, group=ps.get_data_parallel_group())
            loss /= dp
        dist.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
        results.append({"step": step, "loss": loss.item(), "grad_norm": float(grad_norm)})
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--save-init")
    parser.add_argument("--load-init")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    env = init_parallel("cpu", tp_size=args.tp, pp_size=args.pp)
    seed_everything(1234)
    if args.save_init:
        from rlhf.models.dist_ckpt import save_distributed

        model, _, _ = build(args.tp, args.pp)
        Path(args.save_init).mkdir(parents=True, exist_ok=True)
        save_distributed(model.sharded_state_dict(), Path(args.save_init))
        results = []
    else:
        results = train(args)
    if env.is_main:
        Path(args.out).write_text(json.dumps(results))
    teardown()


if __name__ == "__main__":
    main()

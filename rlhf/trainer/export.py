"""What a trainer checkpoint needs so that the actor can leave the system.

`global_step_N/actor/` is a Megatron checkpoint in the layout `rlhf-convert` reads: `model/`
(Megatron's distributed format), `rlhf_checkpoint.json` (family, vocabulary, dtype, layout)
and `hf/` (the policy's config, generation config and tokenizer files). So

    rlhf-convert mcore-to-hf runs/quickstart/checkpoints/global_step_N/actor OUT_DIR

writes an HF directory from any TP/PP layout. `trainer.save_hf` does that at every
checkpoint into `global_step_N/actor_hf/`, in a separate single CPU process on rank 0 (it
loads the whole model in host memory), before the checkpoint is published.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from rlhf.models.convert import copy_hf_side_files, write_meta
from rlhf.models.families import ModelArch
from rlhf.models.mapping import Placement

# What torchrun sets: a converter started from a trainer rank must not inherit it.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "TORCHELASTIC_RUN_ID", "GROUP_WORLD_SIZE")  # fmt: skip


def write_export_files(actor_dir: Path, model_path: str, arch: ModelArch, padded_vocab: int,
                       dtype: torch.dtype, placement: Placement) -> None:  # fmt: skip
    """The checkpoint's meta file and the policy's HF side files (rank 0)."""
    copy_hf_side_files(Path(model_path), actor_dir / "hf")
    write_meta(actor_dir, arch, padded_vocab, dtype, placement)


def export_hf(actor_dir: Path, out_dir: Path) -> None:
    """`rlhf-convert mcore-to-hf actor_dir out_dir` in a fresh single CPU process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "rlhf.cli.convert", "mcore-to-hf", str(actor_dir), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"trainer.save_hf: exporting {actor_dir} failed:\n{proc.stderr[-3000:]}")

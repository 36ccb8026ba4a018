"""What a trainer checkpoint needs so that its models can leave the system.

`global_step_N/actor/` and `global_step_N/critic/` are Megatron checkpoints in the layout
`rlhf-convert` reads: `model/` (Megatron's distributed format), `rlhf_checkpoint.json`
(family, vocabulary, dtype, layout, head) and `hf/` (the model's config, generation config
and tokenizer files). So

    rlhf-convert mcore-to-hf runs/quickstart/checkpoints/global_step_N/actor OUT_DIR

writes an HF causal LM from any TP/PP layout, and `.../critic` a one-label
`*ForTokenClassification` model whose logits are the critic's values. `trainer.save_hf` does
that at every checkpoint into `global_step_N/actor_hf/` (and `critic_hf/`), in a separate
single CPU process on rank 0 (it loads the whole model in host memory), before the
checkpoint is published.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import torch

from rlhf.models.convert import copy_hf_side_files, write_meta
from rlhf.models.families import ModelArch, load_arch
from rlhf.models.lora import LoraSpec, spec_of
from rlhf.models.mapping import Placement
from rlhf.utils import torch_dtype

# What torchrun sets: a converter started from a trainer rank must not inherit it.
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "GROUP_WORLD_SIZE",
)


def write_export_files(
    model_dir: Path,
    model_path: str,
    arch: ModelArch,
    padded_vocab: int,
    dtype: torch.dtype,
    placement: Placement,
    head: str,
    lora: LoraSpec | None = None,
) -> None:
    """A checkpointed model's meta file and its HF side files (rank 0); `head`: "lm" for
    the actor, "value" for the critic; `lora`: its adapters (exported merged)."""
    copy_hf_side_files(Path(model_path), model_dir / "hf")
    write_meta(model_dir, arch, padded_vocab, dtype, placement, head, lora, model_path)


def export_hf(model_dir: Path, out_dir: Path) -> None:
    """`rlhf-convert mcore-to-hf model_dir out_dir` in a fresh single CPU process."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "rlhf.cli.convert", "mcore-to-hf", str(model_dir), str(out_dir)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"exporting {model_dir} to HF failed:\n{proc.stderr[-3000:]}")


def write_model_exports(
    checkpoint: Path,
    trained: dict,
    sources: Mapping[str, tuple[str, str]],
    save_hf: bool,
    placement: Placement,
):
    """Rank 0, inside the checkpoint being written: each trained model's export files (and
    its HF copy under `trainer.save_hf`). `trained`: directory name -> TrainableMegatronModel;
    `sources`: directory name -> (its HF model directory, its training dtype)."""
    for name, model in trained.items():
        path, dtype = sources[name]
        write_export_files(
            checkpoint / name,
            path,
            load_arch(path),
            model.module.padded_vocab_size,
            torch_dtype(dtype),
            placement,
            "lm" if name == "actor" else "value",
            spec_of(model.module),
        )
        if save_hf:
            export_hf(checkpoint / name, checkpoint / f"{name}_hf")

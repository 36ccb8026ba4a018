"""HF <-> Megatron distributed checkpoints, and logit-level verification against transformers.

Layout of a Megatron checkpoint written here (a directory):

    model/                 Megatron-Core distributed checkpoint (torch_dist), any TP/PP on load
    hf/                    the HF config, generation config and tokenizer files, verbatim
    rlhf_checkpoint.json   family, true and padded vocabulary, dtype, the TP/PP it was saved at,
                           head: "lm" (a policy), "value" (a critic's scalar head) or
                           "score" (a reward model's: the same head, read at the last token)

A value model (a trainer checkpoint's critic) exports as an HF `*ForTokenClassification`
model with one label: `score.weight` is the value head and `score.bias` is zero, so its
per-token logits are the critic's values. A reward model (rlhf-train-rm) exports as the
one-label `*ForSequenceClassification` of its family (`score.weight`, no bias), whose logit
is the head's output at the last non-padding token: usable as `reward.model_path`.

Each rank reads only its own slices of the HF safetensors. Output directories appear
atomically: everything is written under `<out>.partial` and renamed when complete.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from rlhf.models.builder import ValueHead, attach_value_head, build_model, load_hf_weights
from rlhf.models.chunks import ModelChunks
from rlhf.models.dist_ckpt import load_distributed, save_distributed
from rlhf.models.families import ModelArch, check_parallel_sizes, load_arch
from rlhf.models.hf_io import INDEX_NAME, HFCheckpointReader, write_sharded_safetensors
from rlhf.models.lora import (
    VALUE_HEAD,
    LoraAdapter,
    LoraSpec,
    add_lora,
    peft_config,
    peft_factors,
)
from rlhf.models.mapping import Placement, resolve, shards_to_hf, skip_on_export
from rlhf.models.model_dir import check_model_dir
from rlhf.models.vision_arch import mrope_positions
from rlhf.utils import torch_dtype

log = logging.getLogger(__name__)

META_NAME = "rlhf_checkpoint.json"
SCALAR_HEADS = ("value", "score")  # heads with one output per token (rlhf_checkpoint.json)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def copy_hf_side_files(src: Path, dst: Path) -> None:
    """Config, generation config and tokenizer files: everything but weights and their index."""
    dst.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and path.name != INDEX_NAME:
            shutil.copy2(path, dst / path.name)


def checkpoint_dtype(reader: HFCheckpointReader) -> torch.dtype:
    """The dtype of the HF weights (taken from the embedding)."""
    return reader.read("model.embed_tokens.weight", rows=(0, 1)).dtype


def read_meta(mcore_dir: str | Path) -> dict:
    path = Path(mcore_dir) / META_NAME
    if not path.is_file():
        raise FileNotFoundError(
            f"{path}: not found; is {mcore_dir} a checkpoint written by rlhf-convert or a "
            "trainer checkpoint's actor/ directory (global_step_N/actor)?"
        )
    return json.loads(path.read_text())


def write_meta(
    out_dir: Path,
    arch: ModelArch,
    padded_vocab: int,
    dtype: torch.dtype,
    placement: Placement,
    head: str = "lm",
    lora: LoraSpec | None = None,
    base_model: str | Path | None = None,
) -> None:
    """`rlhf_checkpoint.json`: what loading a Megatron checkpoint needs besides its tensors
    (`head`: "lm" for a policy, "value" for a critic, "score" for a reward model; `lora`:
    the adapters it holds alone, for the HF model at `base_model`)."""
    meta = {
        "format": "megatron-core-dist",
        "family": arch.family,
        "vocab_size": arch.vocab_size,
        "padded_vocab_size": padded_vocab,
        "dtype": str(dtype).removeprefix("torch."),
        "saved_tensor_model_parallel_size": placement.tp_size,
        "saved_pipeline_model_parallel_size": placement.pp_size,
        "saved_expert_model_parallel_size": placement.ep_size,
        "saved_expert_tensor_parallel_size": placement.etp_size,
        "head": head,
    }
    if lora is not None:  # the checkpoint holds the adapters; the weights are the base's
        meta["lora"] = dataclasses.asdict(lora)
        meta["base_model"] = str(base_model)
    (out_dir / META_NAME).write_text(json.dumps(meta, indent=2))


def _publish(partial: Path, out: Path) -> None:
    """fsync and rename the finished directory into place."""
    for path in partial.rglob("*"):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    os.replace(partial, out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def check_hf_to_mcore(hf_dir: Path, out_dir: Path, placement: Placement) -> ModelArch:
    """What `hf_to_mcore` needs of its inputs, from config.json and the safetensors headers
    alone: cheap enough to run before any worker process is launched (`placement`: the
    parallel sizes; the ranks do not matter)."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another OUT_DIR")
    arch = check_model_dir(hf_dir)
    _check_split(arch, hf_dir, placement)
    return arch


def check_verify(mcore_dir: Path, placement: Placement) -> None:
    """`verify`'s checkpoint is one written here, and its model splits over the layout."""
    read_meta(mcore_dir)
    _check_split(load_arch(mcore_dir / "hf"), mcore_dir / "hf", placement)


def _check_split(arch: ModelArch, hf_dir: Path, placement: Placement) -> None:
    p = placement
    try:
        check_parallel_sizes(arch, p.tp_size, p.pp_size, ep=p.ep_size, etp=p.etp_size)
    except ValueError as e:
        sizes = f"--tp {p.tp_size} --pp {p.pp_size}"
        if p.ep_size > 1 or p.etp_size != p.tp_size:
            sizes += f" --ep {p.ep_size} --etp {p.etp_size}"
        raise ValueError(f"{hf_dir / 'config.json'}: {e} ({sizes})") from None


def hf_to_mcore(hf_dir: Path, out_dir: Path, placement: Placement) -> None:
    """Convert on every rank of the current TP x PP world (call on all ranks)."""
    arch = check_hf_to_mcore(hf_dir, out_dir, placement)
    reader = HFCheckpointReader(hf_dir)
    dtype = checkpoint_dtype(reader)
    model = build_model(arch, placement, params_dtype=dtype, initialize=False)
    load_hf_weights(model, reader, arch, placement, progress=_is_main())
    partial = out_dir.with_name(out_dir.name + ".partial")
    if _is_main():
        shutil.rmtree(partial, ignore_errors=True)
        (partial / "model").mkdir(parents=True)
    _barrier()
    save_distributed(model.sharded_state_dict(), partial / "model")
    if _is_main():
        copy_hf_side_files(hf_dir, partial / "hf")
        write_meta(partial, arch, model.padded_vocab_size, dtype, placement)
        _publish(partial, out_dir)
    _barrier()


def load_mcore(mcore_dir: Path, placement: Placement, params_dtype: torch.dtype | None = None):
    """Build this rank's model from a converted checkpoint's config and load its weights."""
    meta = read_meta(mcore_dir)
    arch = load_arch(mcore_dir / "hf")
    model = build_model(
        arch,
        placement,
        padded_vocab=meta["padded_vocab_size"],
        params_dtype=params_dtype or torch_dtype(meta["dtype"]),
        initialize=False,
    )
    scalar = meta.get("head", "lm") in SCALAR_HEADS
    if "lora" in meta:  # the base model's weights, then the checkpoint's adapters (and head)
        return _load_adapted(model, arch, meta, mcore_dir, placement, scalar), arch
    if scalar:
        model = attach_value_head(model, arch)
    wanted = model.sharded_state_dict()
    state = load_distributed(wanted, mcore_dir / "model")
    # a trainer checkpoint also holds the plain optimizer's state: only the model's is read
    model.load_state_dict({key: value for key, value in state.items() if key in wanted})
    return model, arch


def _load_adapted(
    model, arch: ModelArch, meta: dict, mcore_dir: Path, placement: Placement, scalar: bool
):
    """`model` with the HF weights of the checkpoint's base model and its LoRA adapters
    (`scalar`: a value head is attached after the base weights, and loaded with them)."""
    base = Path(meta["base_model"])
    if not (base / "config.json").is_file():
        raise FileNotFoundError(
            f"{mcore_dir} holds LoRA adapters for the HF model at {base}, which is not there "
            f"(no config.json): put it back or edit base_model in {META_NAME}"
        )
    load_hf_weights(model, HFCheckpointReader(base), arch, placement)
    if scalar:
        model = attach_value_head(model, arch)
    chunks = ModelChunks.of(model, placement)
    keep = VALUE_HEAD if scalar else ()
    add_lora(chunks, LoraSpec.of(meta["lora"]), model.config, placement.tp_rank, keep=keep)
    wanted = chunks.sharded_state_dict(adapters_only=True)
    state = load_distributed(wanted, mcore_dir / "model")
    chunks.load_sharded({k: v for k, v in state.items() if k in wanted}, adapters_only=True)
    return model


def export_hf_tensors(
    model, arch: ModelArch, placement: Placement, progress: bool = False, bias: bool = True
):
    """(HF name, tensor) pairs from an unsharded (TP = PP = EP = 1) Megatron model; a value
    head as `score.weight` and, with `bias`, a zero `score.bias` (token classifiers have one,
    sequence classifiers not); LoRA adapters merged into their layers' weights."""
    assert placement.tp_size == placement.pp_size == placement.ep_size == placement.etp_size == 1
    params = [(n, p) for _, n, p in ModelChunks.of(model, placement).served_weights()]
    for name, param in tqdm(params, desc="export HF tensors", disable=not progress, unit="tensor"):
        if name == "output_layer.weight" and isinstance(model.output_layer, ValueHead):
            yield "score.weight", param.detach()
            if bias:
                yield "score.bias", torch.zeros(1, dtype=param.dtype)
            continue
        rule, layer = resolve(arch, name, placement)
        if not skip_on_export(arch, rule):
            yield from shards_to_hf(rule, layer, [param.detach()], arch)


def mcore_to_hf(mcore_dir: Path, out_dir: Path, max_shard_bytes: int) -> None:
    """Write sharded safetensors + index + config + tokenizer (single process, TP = PP = EP = 1)."""
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another OUT_DIR")
    placement = Placement()
    model, arch = load_mcore(mcore_dir, placement)
    reward_model = read_meta(mcore_dir).get("head") == "score"
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    tensors = export_hf_tensors(model, arch, placement, progress=True, bias=not reward_model)
    write_sharded_safetensors(tensors, partial, max_shard_bytes=max_shard_bytes)
    copy_hf_side_files(mcore_dir / "hf", partial)
    if isinstance(model.output_layer, ValueHead):
        kind = "ForSequenceClassification" if reward_model else "ForTokenClassification"
        as_classifier(partial / "config.json", kind)
    _publish(partial, out_dir)


def peft_tensors(model, arch: ModelArch, placement: Placement):
    """(PEFT name, tensor) of every adapter of an unsharded LoRA model (`peft_factors`)."""
    for name, layer in model.named_modules():
        adapter = getattr(layer, "lora", None)
        if isinstance(adapter, LoraAdapter):
            rule, index = resolve(arch, f"{name}.weight", placement)
            a, b = adapter.factors()
            split = [b if adapter.column else a]
            for peft, tensor in peft_factors(adapter, rule, index, split, arch):
                yield peft, tensor.clone()


def mcore_to_peft(mcore_dir: Path, out_dir: Path) -> None:
    """A LoRA checkpoint's adapters as a PEFT adapter directory (adapter_config.json,
    adapter_model.safetensors) for the HF model it was trained from."""
    from safetensors.torch import save_file

    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists; remove it or choose another OUT_DIR")
    meta = read_meta(mcore_dir)
    if "lora" not in meta:
        raise ValueError(f"{mcore_dir} holds no LoRA adapters (its {META_NAME} has no lora)")
    model, arch = load_mcore(mcore_dir, Placement())
    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors = dict(peft_tensors(model, arch, Placement()))
    save_file(tensors, str(partial / "adapter_model.safetensors"))
    config = peft_config(LoraSpec.of(meta["lora"]), str(mcore_dir / "hf"))
    (partial / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    _publish(partial, out_dir)


def as_classifier(config_path: Path, kind: str) -> None:
    """Rewrite an HF config as the one-label `*<kind>` of its family (kind:
    "ForTokenClassification" or "ForSequenceClassification")."""
    config = json.loads(config_path.read_text())
    name = (config.get("architectures") or ["ForCausalLM"])[0]
    for suffix in ("ForCausalLM", "ForSequenceClassification", "ForTokenClassification"):
        name = name.removesuffix(suffix)
    config |= {
        "architectures": [f"{name}{kind}"],
        "num_labels": 1,
        "id2label": {"0": "LABEL_0"},
        "label2id": {"LABEL_0": 0},
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")


def random_tokens(vocab_size: int, batch: int, seq: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


VERIFY_GRID = (1, 4, 4)  # verify's picture: 4 x 4 patches, merged into 2 x 2 image tokens


def image_rows(
    arch: ModelArch, batch: int, seq: int, seed: int = 0
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Rows of random text, each with one picture of random patches (`VERIFY_GRID`) after
    its second token, for a vision-language model: the tokens and the model's further
    inputs (`position_ids` [3, b, s] by `mrope_positions`, `pixel_values`,
    `image_grid_thw`)."""
    vision = arch.vision
    assert vision is not None
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(arch.vocab_size) if t not in vision.token_ids])
    picture = vision.picture_tokens(VERIFY_GRID)
    if seq < len(picture) + 3:
        raise ValueError(f"--seq {seq} is too short for a picture ({len(picture)} tokens) in a row")
    text = allowed[torch.randint(0, len(allowed), (batch, seq - len(picture)), generator=gen)]
    rows = [[*t[:2].tolist(), *picture, *t[2:].tolist()] for t in text]
    config = vision.config
    width = config.get("in_chans", 3) * config["temporal_patch_size"] * config["patch_size"] ** 2
    patches = batch * VERIFY_GRID[0] * VERIFY_GRID[1] * VERIFY_GRID[2]
    grids = [VERIFY_GRID] * batch
    inputs = {
        "position_ids": torch.stack([mrope_positions(r, [VERIFY_GRID], vision) for r in rows], 1),
        "pixel_values": torch.randn(patches, width, generator=gen),
        "image_grid_thw": torch.tensor(grids),
    }
    return torch.tensor(rows), inputs


def hf_logits(
    hf_dir: Path, tokens: torch.Tensor, images: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """Reference logits from HF transformers in fp32: [b, s, V] of a causal LM (or of a
    vision-language model, on text or with `images`: `image_rows`' inputs), or [b, s, 1]
    (the values) of an exported critic (`*ForTokenClassification`), or of an exported reward
    model (`*ForSequenceClassification`: its score head on every position, of which HF pools
    the last)."""
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoModelForTokenClassification,
    )

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    kinds = config["architectures"]
    if any(a.endswith("ForSequenceClassification") for a in kinds):
        scorer = AutoModelForSequenceClassification.from_pretrained(hf_dir, dtype=torch.float32)
        with torch.no_grad():
            return scorer.eval().score(scorer.base_model(tokens).last_hidden_state)
    token_classifier = any(a.endswith("ForTokenClassification") for a in kinds)
    auto: Any = AutoModelForTokenClassification if token_classifier else AutoModelForCausalLM
    if "vision_config" in config:  # a vision-language model (its text-only logits here)
        from transformers import AutoModelForImageTextToText

        auto = AutoModelForImageTextToText
    model = auto.from_pretrained(hf_dir, dtype=torch.float32).eval()
    extra: dict[str, torch.Tensor] = {}
    if images is not None:  # with the token kinds transformers takes 3-D positions
        kinds = (tokens == model.config.image_token_id).int()
        extra = {k: images[k] for k in ("pixel_values", "image_grid_thw")}
        extra["mm_token_type_ids"] = kinds
    with torch.no_grad():
        return model(tokens, **extra).logits

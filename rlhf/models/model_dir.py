"""An HF model directory checked up front: a config.json of a supported family, readable
safetensors shards.

A model the project cannot use (a Gemma config, a download cut short, weights of another
size than config.json says, a tokenizer larger than the embedding) used to surface as a
traceback minutes in, after SGLang had started loading it. These checks read only
config.json and the safetensors headers, so the trainer, `rlhf-convert` and `rlhf-doctor`
run them before anything expensive starts; each error names the directory's config key
(when given) and the file.
"""

from __future__ import annotations

from pathlib import Path

from rlhf.errors import UserError
from rlhf.models.families import ModelArch, load_arch
from rlhf.models.hf_io import CheckpointFileError, HFCheckpointReader
from rlhf.models.mapping import expected_hf_shape
from rlhf.models.moe_arch import sglang_serving_problem


class ModelDirError(ValueError, UserError):
    """A model directory the project cannot use (an unsupported or incomplete config.json, a
    model SGLang would serve wrongly, a tokenizer larger than the embedding); the message
    names the directory's config key when given."""


def _where(model_dir: str | Path, key: str | None) -> str:
    return f"{key}={model_dir}" if key else str(model_dir)


def read_model_arch(model_dir: str | Path, key: str | None = None) -> ModelArch:
    """The architecture in `model_dir`/config.json; an unsupported or unreadable config is a
    `ModelDirError` naming `key` and the directory."""
    if not Path(model_dir, "config.json").is_file():
        raise FileNotFoundError(
            f"{_where(model_dir, key)}: no config.json there (an HF model directory is "
            "expected; 'make quickstart' builds a tiny one)"
        )
    try:
        return load_arch(model_dir)
    except KeyError as e:
        raise ModelDirError(f"{_where(model_dir, key)}: config.json lacks {e}") from None
    except ValueError as e:  # an unsupported family or setting, or not JSON at all
        raise ModelDirError(f"{_where(model_dir, key)}: {e}") from None


def check_model_dir(model_dir: str | Path, key: str | None = None) -> ModelArch:
    """`read_model_arch`, then every weights shard opened (headers only): a missing shard is
    a `FileNotFoundError`, a damaged one a `CheckpointFileError`, both naming the file."""
    arch = read_model_arch(model_dir, key)
    try:
        reader = HFCheckpointReader(model_dir)
        reader.check_files()
    except (FileNotFoundError, CheckpointFileError) as e:
        if not key:
            raise
        raise type(e)(f"{key}: {e}") from None
    mismatch = _shape_mismatch(reader, arch)
    if mismatch:
        raise CheckpointFileError(f"{_where(model_dir, key)}: {mismatch}")
    return arch


def _shape_mismatch(reader: HFCheckpointReader, arch: ModelArch) -> str | None:
    """The first tensor whose shape (from the safetensors header) is not what config.json
    implies, in words; heads the mapping does not know (a classifier's score) are skipped."""
    for name in reader.weight_map:
        try:
            expected = expected_hf_shape(arch, name)
        except KeyError:
            continue
        shape = reader.shape(name)
        if shape != expected:
            return (
                f"tensor {name!r} is {list(shape)} in the safetensors but config.json implies "
                f"{list(expected)} (hidden_size {arch.hidden_size}, intermediate_size "
                f"{arch.ffn_hidden_size}, vocab_size {arch.vocab_size}): the weights and "
                "config.json are of different models"
            )
    return None


def check_servable_policy(arch: ModelArch, model_dir: str | Path, key: str) -> None:
    """The policy is served by SGLang for rollouts: refuse, before any server starts, a
    model SGLang would serve wrongly (`sglang_serving_problem`)."""
    problem = sglang_serving_problem(arch.moe, arch.family)
    if problem is not None:
        raise ModelDirError(f"{_where(model_dir, key)}: {problem}")


def check_tokenizer_fits(tokenizer, arch: ModelArch, model_dir: str | Path, key: str) -> None:
    """A tokenizer with more tokens than the embedding has rows would hand SGLang and the
    trainer ids past the embedding (SGLang crashes on them, and is restarted in vain)."""
    if len(tokenizer) > arch.vocab_size:
        raise ModelDirError(
            f"{_where(model_dir, key)}: the tokenizer has {len(tokenizer)} tokens but the "
            f"model's embedding has {arch.vocab_size} rows (config.json vocab_size): ids "
            f"from {arch.vocab_size} on have no embedding"
        )

"""An HF model directory checked up front: a config.json of a supported family, readable
safetensors shards.

A model the project cannot use (a Gemma config, a download cut short) used to surface as a
traceback minutes in, after SGLang had started loading it. These checks read only
config.json and the safetensors headers, so the trainer, `rlhf-convert` and `rlhf-doctor`
run them before anything expensive starts; each error names the directory's config key
(when given) and the file.
"""

from __future__ import annotations

from pathlib import Path

from rlhf.config import ConfigError
from rlhf.models.families import ModelArch, load_arch
from rlhf.models.hf_io import CheckpointFileError, HFCheckpointReader


def _where(model_dir: str | Path, key: str | None) -> str:
    return f"{key}={model_dir}" if key else str(model_dir)


def read_model_arch(model_dir: str | Path, key: str | None = None) -> ModelArch:
    """The architecture in `model_dir`/config.json; an unsupported or unreadable config is a
    `ConfigError` naming `key` and the directory."""
    if not Path(model_dir, "config.json").is_file():
        raise FileNotFoundError(
            f"{_where(model_dir, key)}: no config.json there (an HF model directory is "
            "expected; 'make quickstart' builds a tiny one)"
        )
    try:
        return load_arch(model_dir)
    except KeyError as e:
        raise ConfigError(f"{_where(model_dir, key)}: config.json lacks {e}") from None
    except ValueError as e:  # an unsupported family or setting, or not JSON at all
        raise ConfigError(f"{_where(model_dir, key)}: {e}") from None


def check_model_dir(model_dir: str | Path, key: str | None = None) -> ModelArch:
    """`read_model_arch`, then every weights shard opened (headers only): a missing shard is
    a `FileNotFoundError`, a damaged one a `CheckpointFileError`, both naming the file."""
    arch = read_model_arch(model_dir, key)
    try:
        HFCheckpointReader(model_dir).check_files()
    except (FileNotFoundError, CheckpointFileError) as e:
        if not key:
            raise
        raise type(e)(f"{key}: {e}") from None
    return arch

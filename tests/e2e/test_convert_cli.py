"""rlhf-convert as a user runs it: HF -> Megatron (TP2) -> HF is bitwise, a TP2 checkpoint
loads at TP1 and PP2 with identical logits, verify catches corruption, inputs fail clearly
(checked before any process group or worker starts, so those cases call `main` here)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlhf.cli.convert import main
from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

CONVERT = str(Path(sys.executable).with_name("rlhf-convert"))


def rlhf_convert(*args) -> subprocess.CompletedProcess:
    cmd = [CONVERT, *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    spec = TinyModelSpec(family="qwen2", tie_word_embeddings=True, seed=7)
    return save_tiny_model(tmp_path_factory.mktemp("tied"), spec)


@pytest.fixture(scope="module")
def tp2_checkpoint(tiny_qwen2_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("mcore") / "tp2"
    proc = rlhf_convert("hf-to-mcore", tiny_qwen2_dir, out, "--tp", 2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


TIED_SLOW = pytest.mark.slow(
    reason="a second hf-to-mcore conversion at TP2; tests/distributed/test_hf_parity.py "
    "checks the tied model's TP2 parity in make test"
)


@pytest.mark.parametrize("which", ["untied", pytest.param("tied", marks=TIED_SLOW)])
def test_round_trip_through_tp2_is_bitwise(
    which, tiny_qwen2_dir, tied_dir, tp2_checkpoint, tmp_path
):
    hf_dir = tiny_qwen2_dir if which == "untied" else tied_dir
    mcore = tp2_checkpoint
    if which == "tied":
        mcore = tmp_path / "mcore"
        assert rlhf_convert("hf-to-mcore", hf_dir, mcore, "--tp", 2).returncode == 0
    meta = json.loads((mcore / "rlhf_checkpoint.json").read_text())
    assert meta["saved_tensor_model_parallel_size"] == 2 and meta["padded_vocab_size"] % 256 == 0
    back = tmp_path / "hf_back"
    proc = rlhf_convert("mcore-to-hf", mcore, back)
    assert proc.returncode == 0, proc.stderr[-3000:]

    original, restored = read_all(hf_dir), read_all(back)
    assert sorted(original) == sorted(restored)
    for name, tensor in original.items():
        assert torch.equal(tensor, restored[name]), name
    assert json.loads((back / "config.json").read_text()) == json.loads(
        (hf_dir / "config.json").read_text()
    )
    assert (back / "tokenizer.json").read_bytes() == (hf_dir / "tokenizer.json").read_bytes()
    index = json.loads((back / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(original)


@pytest.mark.slow(reason="three rlhf-convert verify runs, two relaunched under torchrun")
def test_tp2_checkpoint_loads_at_tp1_and_pp2_with_identical_logits(
    tiny_qwen2_dir, tp2_checkpoint, tmp_path
):
    dumps = {}
    for name, layout in {"tp1": [], "pp2": ["--pp", 2], "tp2": ["--tp", 2]}.items():
        dumps[name] = tmp_path / f"{name}.pt"
        proc = rlhf_convert(
            "verify", tiny_qwen2_dir, tp2_checkpoint, *layout, "--dump-logits", dumps[name]
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "max |logit diff|" in proc.stdout and ": OK" in proc.stdout
    tp1 = torch.load(dumps["tp1"])
    assert torch.equal(tp1, torch.load(dumps["pp2"]))
    torch.testing.assert_close(tp1, torch.load(dumps["tp2"]), rtol=0, atol=1e-5)


def test_verify_fails_on_corrupted_checkpoint(tiny_qwen2_dir, tmp_path):
    corrupted = tmp_path / "corrupted_hf"
    shutil.copytree(tiny_qwen2_dir, corrupted)
    tensors = load_file(corrupted / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"][3] += 0.5  # one head dimension of one layer
    save_file(tensors, corrupted / "model.safetensors", metadata={"format": "pt"})
    mcore = tmp_path / "mcore"
    assert rlhf_convert("hf-to-mcore", corrupted, mcore).returncode == 0
    proc = rlhf_convert("verify", tiny_qwen2_dir, mcore)
    assert proc.returncode == 1
    assert "FAILED" in proc.stdout


def test_clear_errors_for_bad_inputs(tiny_qwen2_dir, tp2_checkpoint, tmp_path, capsys):
    def fails(*args) -> str:
        """`rlhf-convert ARGS` exits 2; its one error line."""
        assert main([str(a) for a in args]) == 2
        err = capsys.readouterr().err
        (line,) = [x for x in err.splitlines() if x.startswith("rlhf-convert:")]
        assert line.startswith("rlhf-convert: error: ") and "Traceback" not in err
        return line

    # a shard listed in the index is missing
    missing = tmp_path / "missing_shard"
    shutil.copytree(tiny_qwen2_dir, missing)
    weights = load_file(missing / "model.safetensors")
    (missing / "model.safetensors").unlink()
    save_file(weights, missing / "model-00001-of-00001.safetensors")
    index = {"weight_map": {name: "model-00001-of-00002.safetensors" for name in weights}}
    (missing / "model.safetensors.index.json").write_text(json.dumps(index))
    line = fails("hf-to-mcore", missing, tmp_path / "a")
    assert "model-00001-of-00002.safetensors" in line and "is missing" in line

    # config and tensors disagree: the error names the tensor
    mismatch = tmp_path / "mismatch"
    shutil.copytree(tiny_qwen2_dir, mismatch)
    config = json.loads((mismatch / "config.json").read_text())
    config["intermediate_size"] = 96
    (mismatch / "config.json").write_text(json.dumps(config))
    line = fails("hf-to-mcore", mismatch, tmp_path / "b")
    assert "tensor 'model.layers.0.mlp." in line and "in the safetensors but config.json" in line
    assert "intermediate_size 96" in line

    # unsupported family
    other = tmp_path / "gpt2"
    shutil.copytree(tiny_qwen2_dir, other)
    (other / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    line = fails("hf-to-mcore", other, tmp_path / "c")
    assert (
        "unsupported model family 'gpt2'" in line
        and "llama, qwen2, qwen2_5_vl, qwen2_moe, qwen3, qwen3_moe" in line
    )

    # never overwrite, and a missing Megatron checkpoint is named
    assert "already exists" in fails("hf-to-mcore", tiny_qwen2_dir, tp2_checkpoint)
    assert "rlhf_checkpoint.json: not found" in fails(
        "mcore-to-hf", tmp_path / "no", tmp_path / "d"
    )
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    # a Megatron checkpoint missing one of its files, or with one damaged at the same size
    shard = sorted((tp2_checkpoint / "model").glob("*.distcp"))[0]
    gone = tmp_path / "gone"
    shutil.copytree(tp2_checkpoint, gone)
    (gone / "model" / shard.name).unlink()
    line = fails("mcore-to-hf", gone, tmp_path / "e")
    assert f"{gone / 'model'}: the Megatron checkpoint cannot be read (" in line
    assert "missing or damaged" in line
    damaged = tmp_path / "damaged"
    shutil.copytree(tp2_checkpoint, damaged)
    data = bytearray((damaged / "model" / shard.name).read_bytes())
    data[::7] = bytes(b ^ 0x55 for b in data[::7])
    (damaged / "model" / shard.name).write_bytes(bytes(data))
    line = fails("mcore-to-hf", damaged, tmp_path / "f")
    assert f"{damaged / 'model'}: the Megatron checkpoint cannot be read (" in line
    assert "weights_only=False" not in line

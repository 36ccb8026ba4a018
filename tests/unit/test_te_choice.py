"""Transformer Engine or Megatron's local layers (rlhf/models/gpt.py; issue 51, item 9): the
choice is a real import of `transformer_engine.pytorch`, made once per process, decided here
on the CPU with stand-in `transformer_engine` packages and CUDA reported present. A package
that is found but does not import (a missing core library, a failed install check, no torch
extension) gives the local spec and a logged reason; one that imports gives TE's spec."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer import TransformerConfig

from rlhf.models import gpt
from rlhf.models.packed_attention import PackedDotProductAttention


def _forget_transformer_engine() -> None:
    for name in [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]:
        del sys.modules[name]


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """Install a stand-in `transformer_engine` package whose `pytorch` module is `body`
    (None: no such module); each import of it appends a line to the returned file."""
    imports = tmp_path / "imports.txt"

    def install(body: str | None, cuda: bool = True) -> Path:
        package = tmp_path / "site" / "transformer_engine"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("")
        if body is not None:
            (package / "pytorch.py").write_text(
                f"open({str(imports)!r}, 'a').write('x\\n')\n{body}"
            )
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        return imports

    _forget_transformer_engine()
    gpt.transformer_engine_problem.cache_clear()
    yield install
    _forget_transformer_engine()  # later tests must not import the stand-in
    gpt.transformer_engine_problem.cache_clear()


def _config() -> TransformerConfig:
    return TransformerConfig(
        num_layers=2,
        hidden_size=64,
        ffn_hidden_size=128,
        num_attention_heads=4,
        num_query_groups=2,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
    )


def _no_te_spec(*args, **kwargs):
    raise AssertionError("the Transformer Engine spec was chosen")


BROKEN = {
    "core library missing": "raise OSError('libtransformer_engine.so: cannot open shared object')",
    "install check": "assert False, 'Could not find TE core package `transformer-engine-cu*`.'",
    "torch extension missing": "raise ImportError('No module named transformer_engine_torch')",
    "no pytorch module": None,  # `find_spec('transformer_engine')` alone said usable
}


@pytest.mark.parametrize("body", BROKEN.values(), ids=BROKEN.keys())
def test_a_transformer_engine_that_does_not_import_gives_the_local_spec_and_says_why(
    stand_in, monkeypatch, caplog, body
):
    stand_in(body)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", _no_te_spec)
    with caplog.at_level(logging.WARNING, logger="rlhf.models.gpt"):
        spec = gpt.gpt_layer_spec(_config())
    attention = spec.submodules.self_attention.submodules
    assert attention.core_attention is PackedDotProductAttention  # the local spec's
    assert not gpt.transformer_engine_usable()
    reason = gpt.transformer_engine_problem()
    assert reason.startswith("import transformer_engine.pytorch failed: ")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and reason in warnings[0] and "local layer spec" in warnings[0]


def test_the_import_is_tried_once_per_process(stand_in):
    imports = stand_in("raise OSError('libcudnn.so.9: cannot open shared object file')")
    for _ in range(3):
        assert not gpt.transformer_engine_usable()
    assert imports.read_text() == "x\n"


def test_a_transformer_engine_that_imports_gives_its_spec(stand_in, monkeypatch):
    stand_in("")
    chosen = []

    def te_spec(num_experts=None, qk_layernorm=False, **kwargs):
        chosen.append((num_experts, qk_layernorm))
        return gpt_layer_specs.get_gpt_layer_local_spec()  # any spec: only the choice counts

    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", te_spec)
    assert gpt.transformer_engine_usable() and gpt.transformer_engine_problem() is None
    gpt.gpt_layer_spec(_config(), qk_layernorm=True)
    assert chosen == [(None, True)]


def test_without_cuda_the_local_spec_is_chosen_without_importing_it(stand_in, monkeypatch):
    imports = stand_in("", cuda=False)
    monkeypatch.setattr(gpt_layer_specs, "get_gpt_layer_with_transformer_engine_spec", _no_te_spec)
    gpt.gpt_layer_spec(_config())
    assert gpt.transformer_engine_problem() == "no CUDA device"
    assert not imports.exists()

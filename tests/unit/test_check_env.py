"""The lock-file check that `make setup` runs last."""

from __future__ import annotations

from importlib.metadata import requires
from pathlib import Path

from packaging.requirements import Requirement

from rlhf.cli.check_env import canonical, main, mismatches, read_pins

LOCK = Path(__file__).resolve().parents[2] / "requirements" / "cpu.lock"


def test_names_are_canonicalised():
    assert canonical("Typing_Extensions") == "typing-extensions"
    assert canonical("zope.interface") == "zope-interface"


def test_reports_missing_and_different_versions():
    pins = {"torch": "2.14.1", "numpy": "2.4.6", "ghost": "1.0"}
    installed = {"torch": "2.13.0+cpu", "numpy": "2.4.6"}
    assert mismatches(pins, installed) == [
        "ghost: pinned 1.0, not installed",
        "torch: pinned 2.14.1, installed 2.13.0+cpu",
    ]


def test_lock_pins_the_stack_named_by_the_foundation():
    pins = read_pins(LOCK)
    for name, version in {
        "torch": "2.14.1",
        "torchvision": "0.29.1",
        "megatron-core": "0.16.1",
        "sglang": "0.5.23",
        "sglang-router": "0.3.2",
    }.items():
        assert pins[name] == version
    for name in ("psutil", "transformers", "tokenizers", "safetensors", "pyarrow", "pyyaml"):
        assert name in pins
    for name in ("tensorboard", "tqdm", "pytest", "hypothesis", "ruff"):
        assert name in pins


def test_this_environment_matches_the_lock(capsys):
    assert main([str(LOCK)]) == 0
    assert "pinned packages match" in capsys.readouterr().out


def test_mismatch_exits_nonzero(tmp_path, capsys):
    lock = tmp_path / "lock.txt"
    lock.write_text("# comment\ntorch==0.0.1\n")
    assert main([str(lock)]) == 1
    assert "torch: pinned 0.0.1" in capsys.readouterr().err


def test_vendored_duplicates_do_not_shadow_the_installed_package(monkeypatch):
    from types import SimpleNamespace

    import rlhf.cli.check_env as check_env

    installed = SimpleNamespace(metadata={"Name": "packaging"}, version="26.4")
    vendored = SimpleNamespace(metadata={"Name": "packaging"}, version="26.3")  # later on sys.path
    monkeypatch.setattr(check_env.metadata, "distributions", lambda: [installed, vendored])
    assert check_env.installed_versions() == {"packaging": "26.4"}


def test_the_lock_agrees_with_what_sglang_declares():
    """SGLang is installed --no-deps on the CPU, but whole by `pip install .[gpu]` with the
    lock as constraints: every package its wheel requires that the lock pins must be pinned
    to a version it accepts, or the GPU install cannot resolve (apache-tvm-ffi and
    python-dateutil once were not)."""
    pins = read_pins(LOCK)
    declared = [Requirement(text) for text in requires("sglang") or []]
    checked = [r for r in declared if r.marker is None or r.marker.evaluate({"extra": ""})]
    clashes = [
        f"{r} (lock: {pins[canonical(r.name)]})"
        for r in checked
        if canonical(r.name) in pins
        and not r.specifier.contains(pins[canonical(r.name)], prereleases=True)
    ]
    assert len(checked) > 50 and clashes == []

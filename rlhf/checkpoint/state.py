"""Trainer state that is not a model: step, sampler, KL controller, ... and every RNG stream.

An exact resume needs the same random numbers after the restart as without it, so each rank
saves all its generators: Python `random`, NumPy's global RNG, torch's CPU (and CUDA)
generators and Megatron's tensor-parallel RNG tracker (on the CPU its states are CPU generator
states, see `rlhf.distributed.cpu_compat`). The JSON-able part is the same on every rank and is
written once by rank 0; RNG states differ per rank (TP ranks have their own streams), so each
rank writes its own file. Files are loaded with `weights_only=True`: no pickled code.
"""

from __future__ import annotations

import importlib
import io
import json
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf.checkpoint.manager import write_durable

TRAINER_STATE_FILE = "trainer_state.json"
RNG_DIR = "rng"
_TRACKER_MODULE = "megatron.core.tensor_parallel.random"


def _tracker():
    """Megatron's RNG tracker, or None if Megatron was never imported (then it has no states)."""
    module = sys.modules.get(_TRACKER_MODULE)
    return module.get_cuda_rng_tracker() if module is not None else None


def _as_tensor(state: Any) -> torch.Tensor:
    # A graph-safe tracker keeps torch.Generator objects instead of state tensors.
    return state.get_state() if isinstance(state, torch.Generator) else state.clone()


def capture_rng_state() -> dict:
    """All RNG states of this process, as tensors and plain Python values."""
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["torch_cuda"] = torch.cuda.get_rng_state_all()
    tracker = _tracker()
    tracker_states = tracker.get_states() if tracker is not None else {}
    state["megatron_tracker"] = {name: _as_tensor(s) for name, s in tracker_states.items()}
    return state


def restore_rng_state(state: dict) -> None:
    """Put back the RNG states captured by `capture_rng_state`."""
    random.setstate(_as_python_state(state["python"]))
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["torch_cuda"])
    if state.get("megatron_tracker"):
        _restore_tracker(state["megatron_tracker"])


def _as_python_state(value: Any) -> tuple:
    """`random.setstate` needs tuples; a JSON or list round trip may have made them lists."""
    version, internal, gauss = value
    return (version, tuple(internal), gauss)


def _restore_tracker(saved: dict[str, torch.Tensor]) -> None:
    tracker = importlib.import_module(_TRACKER_MODULE).get_cuda_rng_tracker()
    current = tracker.get_states()
    states = {}
    for name, tensor in saved.items():
        if isinstance(current.get(name), torch.Generator):
            current[name].set_state(tensor)
            states[name] = current[name]
        else:
            states[name] = tensor.clone()
    tracker.set_states(states)


def rng_file(ckpt_dir: Path | str, rank: int) -> Path:
    """Where `rank` keeps its RNG states inside a checkpoint."""
    return Path(ckpt_dir) / RNG_DIR / f"rank_{rank}.pt"


def save_trainer_state(ckpt_dir: Path | str, state: dict, rank: int) -> None:
    """Rank 0 writes `state` (JSON-able) as trainer_state.json; every rank writes its RNG."""
    ckpt_dir = Path(ckpt_dir)
    if rank == 0:
        text = json.dumps(state, indent=2, sort_keys=True)  # raises TypeError if not JSON-able
        write_durable(ckpt_dir / TRAINER_STATE_FILE, text.encode())
    path = rng_file(ckpt_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(capture_rng_state(), buffer)
    write_durable(path, buffer.getvalue())


def read_trainer_state(ckpt_dir: Path | str) -> dict:
    """The JSON-able state of a checkpoint, without touching any RNG (what rank 0 reads
    before the models are built, e.g. the tracker run ids)."""
    json_path = Path(ckpt_dir) / TRAINER_STATE_FILE
    if not json_path.is_file():
        raise FileNotFoundError(f"{json_path} not found: {ckpt_dir} holds no trainer state")
    return json.loads(json_path.read_text())


def load_trainer_state(ckpt_dir: Path | str, rank: int, restore_rng: bool = True) -> dict:
    """The JSON-able state of a checkpoint; also restores this rank's RNG unless told not to.

    Call it after the models are built: building them draws random numbers.
    """
    ckpt_dir = Path(ckpt_dir)
    state = read_trainer_state(ckpt_dir)
    path = rng_file(ckpt_dir, rank)
    if not path.is_file():
        raise FileNotFoundError(_missing_rank_message(ckpt_dir, rank))
    rng = torch.load(path, weights_only=True)
    if restore_rng:
        restore_rng_state(rng)
    return state


def _missing_rank_message(ckpt_dir: Path, rank: int) -> str:
    rng_dir = ckpt_dir / RNG_DIR
    saved = sorted(
        int(p.stem.removeprefix("rank_"))
        for p in (rng_dir.glob("rank_*.pt") if rng_dir.is_dir() else [])
        if p.stem.removeprefix("rank_").isdigit()
    )
    return (
        f"{rng_file(ckpt_dir, rank)} not found: the checkpoint has RNG states for ranks {saved} "
        f"(world size {len(saved)}). Resuming with a different world size than the one that "
        f"saved it is not supported for RNG state"
    )

"""Save/resume of everything a run needs; this package holds the framework-agnostic part.

`CheckpointManager` owns the directory layout and crash safety; `state` saves the trainer
state that is not a model (step, sampler, KL controller, RNG streams). Model and optimizer
shards are written by their owners into the directory `CheckpointManager.writing` yields.
"""

from rlhf.checkpoint.manager import (
    COMPLETE_MARKER,
    POINTER_FILE,
    CheckpointManager,
    complete_steps_in,
    find_latest,
    is_complete,
    step_of,
    write_durable,
)
from rlhf.checkpoint.state import (
    TRAINER_STATE_FILE,
    capture_rng_state,
    load_trainer_state,
    read_trainer_state,
    restore_rng_state,
    rng_file,
    save_trainer_state,
)
from rlhf.checkpoint.storage import CheckpointStorageError, probe_storage

__all__ = [
    "COMPLETE_MARKER",
    "POINTER_FILE",
    "TRAINER_STATE_FILE",
    "CheckpointManager",
    "CheckpointStorageError",
    "capture_rng_state",
    "complete_steps_in",
    "find_latest",
    "is_complete",
    "load_trainer_state",
    "probe_storage",
    "read_trainer_state",
    "restore_rng_state",
    "rng_file",
    "save_trainer_state",
    "step_of",
    "write_durable",
]

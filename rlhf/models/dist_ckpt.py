"""Reading and writing a Megatron distributed checkpoint, a damaged or incomplete one said in
one line.

A checkpoint missing one of its `.distcp` files, or holding one damaged at the same size (so
the size check of `rlhf.checkpoint.manager.damage` passes), used to end in a traceback of
torch's loader; a damaged pickle even advised `weights_only=False`, i.e. running whatever
the file holds. The reader's failure is reported with the directory and the first line of
its innermost cause instead, and nothing is loaded with `weights_only=False`.

Reading across layer specs: Transformer Engine's norms (and other TE modules) keep an
`_extra_state` (FP8 metadata, empty without FP8) that Megatron's local layers do not have, so
a checkpoint written on the CPU lacks objects a GPU model asks for. Those absent
`_extra_state` objects are not asked for and come back as None (which TE's modules take as
"no state"); every weight must still be there.

Writing: Megatron-Core 0.16's file writer collects its writer processes' results in a
`multiprocessing` manager queue that it starts with the *spawn* method, once per process at
the first save: a new interpreter that imports the trainer's main module again (2.0 s on
this machine idle, per rank and run, before the first checkpoint is written). Its writers
are forked from the saving process and the queue is only read there, so `save_distributed`
gives Megatron a manager queue started by *fork* instead (0.02 s): the same proxy queue
(puts never block on a pipe, whatever the size of the results), without the re-import.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path

from rlhf.models.hf_io import CheckpointFileError
from rlhf.utils import die_with_parent


def innermost(error: BaseException) -> BaseException:
    """The error at the bottom of `error`'s chain of causes."""
    seen = {id(error)}
    while True:
        nxt = error.__cause__ or error.__context__
        if nxt is None or id(nxt) in seen:
            return error
        seen.add(id(nxt))
        error = nxt


EXTRA_STATE = "_extra_state"


def _without_absent_extra_states(sharded_state_dict: dict, directory: Path):
    """`sharded_state_dict` (its dicts copied, leaves shared) without the `_extra_state`
    objects `directory` does not hold (see the module docstring), and their key paths."""
    from megatron.core.dist_checkpointing import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    metadata = load_sharded_metadata(str(directory))
    saved = {v.key for v in metadata.values() if isinstance(v, ShardedObject)}
    dropped: list[tuple] = []

    def absent(value) -> bool:
        extra = isinstance(value, ShardedObject) and value.key.endswith(EXTRA_STATE)
        return extra and value.key not in saved

    def pruned(tree: dict, path: tuple) -> dict:
        kept = {}
        for key, value in tree.items():
            if isinstance(value, dict):
                kept[key] = pruned(value, (*path, key))
            elif absent(value):
                dropped.append((*path, key))
            else:
                kept[key] = value
        return kept

    return pruned(sharded_state_dict, ()), dropped


def _put_none(state: dict, paths: list[tuple]) -> None:
    for *parents, key in paths:
        tree = state
        for parent in parents:
            tree = tree.setdefault(parent, {})
        tree[key] = None


def load_distributed(sharded_state_dict: dict, directory: Path) -> dict:
    """`dist_checkpointing.load` of `directory` (absent `_extra_state` objects: None); a
    missing or damaged file is a `CheckpointFileError` naming the directory and what the
    reader hit."""
    from megatron.core import dist_checkpointing

    try:
        wanted, absent = _without_absent_extra_states(sharded_state_dict, directory)
        state = dist_checkpointing.load(wanted, str(directory))
        _put_none(state, absent)
        return state
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # torch's CheckpointException is a BaseException
        cause = innermost(e)
        first = (str(cause).strip().splitlines() or [""])[0][:300]
        raise CheckpointFileError(
            f"{directory}: the Megatron checkpoint cannot be read ({type(cause).__name__}: "
            f"{first}); a file of it is missing or damaged: use an earlier checkpoint"
        ) from e


def _forked_results_queue() -> None:
    """Megatron's writer-results queue of this process, its manager started by fork (see the
    module). The manager dies with this process (a forked child holds this process's open
    files, the run directory's lock among them, so it must not outlive a killed trainer);
    the kernel ties that to the forking thread, hence only from the main thread (elsewhere
    Megatron starts its own)."""
    import multiprocessing
    import threading
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    if threading.current_thread() is not threading.main_thread():
        return
    manager = SyncManager(ctx=multiprocessing.get_context("fork"))
    manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps the manager alive


def save_distributed(sharded_state_dict: dict, directory: Path, **kwargs):
    """`dist_checkpointing.save(sharded_state_dict, directory, **kwargs)` (collective), its
    writers' results collected without a spawned process."""
    from megatron.core import dist_checkpointing

    _forked_results_queue()
    return dist_checkpointing.save(sharded_state_dict, str(directory), **kwargs)


def save_distributed_in_background(
    sharded_state_dict: dict, directory: Path
) -> tuple[Callable[[], None] | None, list[Callable[[], None]]]:
    """`dist_checkpointing.save` of `directory` split for a background save: the plan (a
    collective) and the copy of every tensor to host memory now; returned, the file writes
    for the writer process (None: this rank writes none) and Megatron's finalize steps
    (`.metadata`, `metadata.json`; collective) for after them."""
    request = save_distributed(sharded_state_dict, directory, async_sharded_save=True)
    if request.async_fn is None:
        return None, list(request.finalize_fns)
    args = list(request.async_fn_args)
    if request.preload_fn is not None:  # args[1]: the write buckets, now in host memory
        args[1] = request.preload_fn()
    write = partial(request.async_fn, *args, **request.async_fn_kwargs)
    return write, list(request.finalize_fns)

"""Python's garbage collector during a process's start (`rlhf.utils.collection_deferred`):
off while the trainer imports and builds, then the start's objects frozen out of every later
scan; SGLang's processes freeze theirs as they load the plugin (`rlhf.rollout.sglang_plugin`,
job 10). A held server launch imports with it off (tests/unit/test_held_launch.py)."""

from __future__ import annotations

import gc
import weakref

from rlhf.utils import collection_deferred
from tests.helpers import REPO, python_output


def test_collection_waits_until_started_then_skips_what_the_start_made():
    before = gc.get_freeze_count()
    try:
        with collection_deferred() as started:
            assert not gc.isenabled()
            made = [[] for _ in range(1000)]  # tracked objects of "the start"
            started()
            assert gc.isenabled() and gc.get_freeze_count() >= before + len(made)
            started()  # once only
            assert gc.isenabled()
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_what_the_start_left_as_garbage_is_collected_not_frozen():
    class Held:
        pass

    freed: list[str] = []
    try:
        with collection_deferred() as started:
            cycle = Held()
            cycle.me = cycle  # garbage only a collection frees
            weakref.finalize(cycle, freed.append, "freed")
            del cycle
            assert freed == []
            started()
            assert freed == ["freed"]
    finally:
        gc.unfreeze()


def test_collection_stays_as_it_was_when_the_block_ends_without_started():
    gc.disable()
    try:
        with collection_deferred():
            assert not gc.isenabled()
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # frozen, still off
    finally:
        gc.enable()
        gc.unfreeze()


def test_the_trainer_builds_with_the_collector_off_and_trains_with_it_on(tmp_path):
    code = (
        "import contextlib, gc, types\n"
        "from rlhf.cli import train\n"
        "import rlhf.trainer.loop as loop, rlhf.trainer.preflight as checks\n"
        "from rlhf.distributed import bootstrap\n"
        f"args = train.parse_args(['--config', '{REPO / 'configs' / 'quickstart_cpu.yaml'}',\n"
        f"    'trainer.default_local_dir={tmp_path / 'run'}'])\n"
        "cfg, _ = train.resolve(args)\n"
        "train.held_servers = lambda *args: contextlib.nullcontext()\n"
        "checks.preflight = lambda *args: types.SimpleNamespace(layout=None)\n"
        "train.bootstrap_layout = lambda *args: types.SimpleNamespace(is_main=False)\n"
        "bootstrap.seed_everything = lambda seed: None\n"
        "class Trainer:\n"
        "    def __init__(self, *args):\n"
        "        print('build', gc.isenabled())\n"
        "    def fit(self):\n"
        "        print('fit', gc.isenabled(), gc.get_freeze_count() > 10000)\n"
        "        return 0\n"
        "    def close(self):\n"
        "        pass\n"
        "loop.PPOTrainer = Trainer\n"
        "train.run(cfg)\n"
        "print('after', gc.isenabled())\n"
    )
    lines = python_output(code).splitlines()
    assert lines == ["build False", "fit True True", "after True"]


def test_a_server_process_freezes_its_imports_as_it_loads_the_plugin_and_before_it_forks():
    code = (
        "import gc\n"
        "from rlhf.rollout import sglang_plugin\n"
        "before = gc.get_freeze_count()\n"
        "sglang_plugin.register()\n"
        "frozen = gc.get_freeze_count()\n"
        "later = [[] for _ in range(5000)]  # what the server imports after its plugins\n"
        "sglang_plugin.forked_processes(None)\n"
        "print(before, frozen > 10000, gc.get_freeze_count() - frozen >= len(later))\n"
    )
    env = {"RLHF_SGLANG_BOUND_STORES": "1"}
    assert python_output(code, env).split() == ["0", "True", "True"]

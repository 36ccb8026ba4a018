"""Rounds ahead of training (`trainer.rollout_mode` one_step_off / async), on scripted servers.

The servers here are a stand-in that answers each round at once with scripted versions and
scores, and records every call, so that the order of draws, loads and pauses and the
accounting of every sample are fixed by the test. The real servers (SGLang pausing requests
in flight) run the same strategy in tests/e2e/test_async_rollout.py.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from rlhf.config import load_config
from rlhf.config.loader import ConfigError
from rlhf.data.sampler import PromptSampler
from rlhf.rollout.batch import RolloutBatch, RolloutResult
from rlhf.rollout.partial import first_and_last_version
from rlhf.trainer.rollouts import AheadRollout, BatchShaping, fresh_groups, overlap

N = 2  # samples per prompt
BATCH = 2  # prompts per step
PROMPTS = 12
EXTERNAL = "actor_rollout_ref.rollout.server_urls=[http://127.0.0.1:1]"
TIS = "algorithm.rollout_correction.rollout_is=token"


class Policy:
    """The trained policy as a strategy publishes it: these servers take any weights."""

    @staticmethod
    @contextlib.contextmanager
    def serving(probe, weights_only):
        yield None


POLICY = Policy()


@dataclass
class ScriptedServers:
    """Answers a round with N samples per prompt, every token of the version it holds when
    the round starts (or `versions`, when scripted); scores alternate 0/1 unless all_same."""

    version: int = 0
    calls: list[tuple] = field(default_factory=list)
    all_same_rounds: set[int] = field(default_factory=set)  # rounds whose scores are equal
    versions: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    held_round: int | None = None  # this round answers only once `release` is set
    release: threading.Event = field(default_factory=threading.Event)
    probe_sequence: object = None  # what a policy's probe log-probs are of
    sleeps: bool = False

    def generate_here(self, prompts, uids, indices, params) -> RolloutResult:
        with self.lock:
            number = sum(c[0] == "generate" for c in self.calls)
            self.calls.append(("generate", tuple(indices), self.version))
        if number == self.held_round:
            self.release.wait(timeout=30)
            self.calls.append(("finished", number))
        size = len(uids) * N
        same = number in self.all_same_rounds
        batch = RolloutBatch(
            prompt_ids=[[7]] * size,
            response_ids=[[5, 6]] * size,
            scores_b=torch.tensor([1.0 if same else float(j % 2) for j in range(size)]),
            data_sources=["t"] * size,
            uids=[u for u in uids for _ in range(N)],
        )
        versions = self.versions.get(number, [(self.version, self.version)] * size)
        return RolloutResult(batch, [], 0.0, self.version, None, versions)

    def share(self, mine):
        return mine

    def load_weights(self, policy, version, pause=False):
        self.calls.append(("load", version, pause))
        self.version = version
        return version


def config(mode: str, *overrides: str):
    return load_config(
        None,
        [
            f"data.train_batch_size={BATCH}",
            f"actor_rollout_ref.rollout.n={N}",
            f"trainer.rollout_mode={mode}",
            EXTERNAL,
            TIS,
            *overrides,
        ],
    )


def strategy(mode: str, servers: ScriptedServers, *overrides: str, sampler=None, last_step=None):
    cfg = config(mode, *overrides)
    sampler = sampler or PromptSampler(PROMPTS, BATCH, N, seed=3)
    data = list(range(PROMPTS))
    shaping = BatchShaping.of(cfg.actor_rollout_ref, cfg.data, cfg.algorithm, cfg.reward)
    return AheadRollout(servers, sampler, data, shaping, None, cfg.trainer, last_step)  # type: ignore[arg-type]


def run_steps(rollout: AheadRollout, first: int, last: int) -> list[list[str]]:
    """Steps first..last as the trainer runs them: batch, then publish; the uids per step."""
    uids = []
    for step in range(first, last + 1):
        uids.append(rollout.next_batch(step).batch.uids)
        rollout.publish(POLICY, step)
    return uids


def sampler_draws(count: int) -> list[list[str]]:
    """The uids (N per prompt) of the first `count` draws of an independent sampler."""
    sampler = PromptSampler(PROMPTS, BATCH, N, seed=3)
    return [sampler.next_batch().sample_uids for _ in range(count)]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["trainer.rollout_mode=async", TIS], "needs disaggregated servers"),
        (["trainer.rollout_mode=one_step_off", EXTERNAL], "rollout_is=token"),
        (["trainer.async_rollout.max_staleness=2"], "applies to rollout_mode=async only"),
        (
            ["trainer.rollout_mode=one_step_off", "trainer.async_rollout.partial_rollout=false"],
            "applies to rollout_mode=async only",
        ),
        (
            [
                "trainer.rollout_mode=async",
                EXTERNAL,
                TIS,
                "actor_rollout_ref.actor.router_replay.mode=R3",
            ],
            "router_replay.mode=R3",
        ),
    ],
)
def test_modes_that_cannot_run_are_refused(overrides, message):
    from rlhf.config.validate import validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(None, ["actor_rollout_ref.model.path=m", *overrides]))


def test_bypass_mode_is_a_correction_too():
    from rlhf.config.validate import validate_config

    overrides = ["trainer.rollout_mode=async", EXTERNAL]
    bypass = "algorithm.rollout_correction.bypass_mode=true"
    validate_config(load_config(None, ["actor_rollout_ref.model.path=m", *overrides, bypass]))


@pytest.mark.parametrize(("mode", "ahead"), [("one_step_off", 1), ("async", 3)])
def test_every_round_is_trained_once_in_draw_order(mode, ahead):
    servers = ScriptedServers()
    extra = [f"trainer.async_rollout.max_staleness={ahead}"] if mode == "async" else []
    rollout = strategy(mode, servers, *extra)
    rollout.publish(POLICY, 0)  # the trainer's first load
    got = run_steps(rollout, 1, 4)
    assert got == sampler_draws(4)  # each step trains the next draw, none twice or skipped
    assert len(rollout.queue) == 1 + ahead  # and 1 + ahead rounds are ahead after the load
    for round_ in rollout.queue:
        round_.future.result()
    drawn = [c for c in servers.calls if c[0] == "generate"]
    assert len(drawn) == 4 + 1 + ahead
    # a round starts generating after the load before it: version v rounds train at v+1..v+1+K
    loads = [c for c in servers.calls if c[0] == "load"]
    assert [c[2] for c in loads] == [mode == "async"] * 5  # async pauses, one_step_off not
    step_of_round = range(1, len(drawn) + 1)
    assert all(step - 1 - version <= ahead for step, (_, _, version) in zip(step_of_round, drawn))
    rollout.close()


def test_one_step_off_waits_for_the_rounds_ahead_before_loading():
    servers = ScriptedServers(held_round=1)  # the round of step 2 generates until released
    rollout = strategy("one_step_off", servers)
    rollout.publish(POLICY, 0)
    rollout.next_batch(1)
    load = threading.Thread(target=rollout.publish, args=(POLICY, 1))
    load.start()
    load.join(timeout=0.5)
    assert load.is_alive() and ("load", 1, False) not in servers.calls  # no sync under it
    servers.release.set()
    load.join(timeout=30)
    assert servers.calls.index(("load", 1, False)) > servers.calls.index(("finished", 1))
    # the round of step 2 generated with version 0: staleness 1 when step 2 trains on v1
    assert rollout.next_batch(2).metrics["async/staleness_max"] == 1.0
    rollout.close()


def test_dynamic_sampling_takes_the_next_rounds_and_resume_redraws_those_ahead():
    servers = ScriptedServers(all_same_rounds={1})  # step 2's first round has no signal
    filtering = "algorithm.filter_groups.enable=true"
    rollout = strategy("async", servers, filtering, "trainer.async_rollout.max_staleness=2")
    rollout.publish(POLICY, 0)
    got = run_steps(rollout, 1, 2)
    draws = sampler_draws(6)
    assert got == [draws[0], draws[2]]  # round 1 (index) dropped whole, round 2 took its place
    state = rollout.sampler_state()  # after the 3 consumed draws, not the rounds ahead
    rollout.close()
    # a run resumed from this state trains the next draws: none repeated, none skipped
    resumed_sampler = PromptSampler(PROMPTS, BATCH, N, seed=3)
    resumed_sampler.load_state_dict(state)
    resumed = strategy("async", ScriptedServers(version=2), filtering, sampler=resumed_sampler)
    resumed.publish(POLICY, 2)
    assert run_steps(resumed, 3, 4) == [draws[3], draws[4]]
    resumed.close()


def test_stale_groups_are_dropped_and_counted():
    # round 0: sample 1 (prompt group 0) has a token of version -2 (too old for K=1 at v0)
    old = [(0, 0), (-2, 0), (0, 0), (0, 0)]
    servers = ScriptedServers(versions={0: old})
    rollout = strategy("async", servers)
    rollout.publish(POLICY, 0)
    step = rollout.next_batch(1)
    first, second = sampler_draws(2)
    assert step.batch.uids == first[N:] + second[:N]  # group 0 dropped, the next filled in
    assert step.metrics["async/dropped_stale"] == 2.0
    rollout.close()


def test_fresh_groups_by_hand():
    batch = RolloutBatch([[1]] * 4, [[2]] * 4, torch.zeros(4), ["t"] * 4, ["a", "a", "b", "b"])
    versions = [(3, 5), (4, 5), (5, 5), (None, None)]
    result = RolloutResult(batch, [], 0.0, 5, None, versions)  # type: ignore[arg-type]
    assert fresh_groups(result, trained_version=5, max_staleness=2) == ([0, 1], [2, 1])
    assert fresh_groups(result, trained_version=6, max_staleness=2) == ([], [])
    one_version = RolloutResult(batch, [], 0.0, 4)
    assert fresh_groups(one_version, 5, 1) == ([0, 1, 2, 3], [1, 1, 1, 1])


def test_versions_of_spans_and_overlap_by_hand():
    assert first_and_last_version((("3", 0, 4), ("5", 4, 9)), None) == (3, 5)
    assert first_and_last_version((("default", 0, 4),), 2) == (2, 2)
    assert first_and_last_version((), None) == (None, None)
    assert overlap((1.0, 5.0), [(0.0, 2.0), (3.0, 4.0), (4.5, 9.0)]) == pytest.approx(2.5)


def test_the_trained_account_matches_the_draws():
    servers = ScriptedServers()
    rollout = strategy("async", servers, "trainer.async_rollout.max_staleness=2")
    rollout.publish(POLICY, 0)
    trained = Counter(uid for uids in run_steps(rollout, 1, 5) for uid in uids)
    drawn = Counter(uid for uids in sampler_draws(5) for uid in uids)
    assert trained == drawn
    rollout.close()


def test_truncated_is_on_a_stale_partial_sample_by_hand():
    """A sample of a round generated at version 3, cut by the load of version 4 after its
    second token and finished by version 4, trained at version 4 (staleness 1): its first two
    tokens are weighted by min(pi_4 / pi_3, C), the rest by exactly 1 (same policy)."""
    from rlhf.config.algorithm import RolloutCorrectionConfig
    from rlhf.trainer.step import rollout_correction

    v3 = [-0.2, -1.5]  # what version 3 gave its tokens (the engine's log-probs)
    v4 = [-0.9, -0.1, -0.7, -2.0]  # what version 4 (the trainer's old log-probs) gives them
    batch = RolloutBatch(
        [[1, 2]],
        [[5, 6, 7, 8]],
        torch.zeros(1),
        ["t"],
        ["a"],
        rollout_logprobs=[[*v3, *v4[2:]]],
    )
    settings = RolloutCorrectionConfig(rollout_is="token", rollout_is_threshold=2.0)
    weights, metrics = rollout_correction(batch, torch.tensor([v4]), settings)
    expected = [min(math.exp(v4[0] - v3[0]), 2.0), min(math.exp(v4[1] - v3[1]), 2.0), 1.0, 1.0]
    assert weights is not None
    assert weights[0].tolist() == pytest.approx(expected)
    assert metrics["rollout_corr/rollout_is_clip_frac"] == pytest.approx(1 / 4)  # e^1.4 > 2
    assert metrics["rollout_corr/max_abs_diff"] == pytest.approx(1.4)


def test_nothing_is_generated_ahead_for_steps_after_the_last():
    servers = ScriptedServers()
    rollout = strategy("async", servers, "trainer.async_rollout.max_staleness=3", last_step=4)
    rollout.publish(POLICY, 0)
    assert run_steps(rollout, 1, 4) == sampler_draws(4)
    assert not rollout.queue  # the last step's load submits nothing
    assert sum(c[0] == "generate" for c in servers.calls) == 4
    rollout.close()

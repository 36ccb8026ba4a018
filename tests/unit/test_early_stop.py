"""Early-stop and rollback rules: each rule, patience resets, resume mid-count, disabled rules."""

from __future__ import annotations

import json
import math

import pytest

from rlhf.config import ConfigError, load_config
from rlhf.config.schema import EarlyStopConfig
from rlhf.engine.engine import should_stop_epochs
from rlhf.trainer.stopping import Decision, EarlyStopper


def make_stopper(target_kl: float = 0.1, **section) -> EarlyStopper:
    """A stopper for `trainer.early_stop` = `section`, every rule off unless given."""
    defaults = {"kl_patience": 0, "reward_plateau_patience": 0, "rollback_val_ratio": None}
    defaults["reward_plateau_min_delta"] = 0.0
    return EarlyStopper(EarlyStopConfig(**{**defaults, **section}), target_kl)


def run_steps(stopper: EarlyStopper, steps: list[tuple[float, float]], start: int = 1) -> list:
    """Decisions of consecutive steps given as (mean_kl, mean_score)."""
    return [stopper.observe_step(start + i, kl, score) for i, (kl, score) in enumerate(steps)]


def test_kl_rule_stops_after_patience_consecutive_high_steps():
    stopper = make_stopper(kl_threshold=0.2, kl_patience=3)
    decisions = run_steps(stopper, [(0.3, 0.0), (0.25, 0.0), (0.5, 0.0)])
    assert decisions[:2] == [None, None]
    assert decisions[2].action == "stop"
    assert decisions[2].step == 3
    assert "0.5 above 0.2 for 3 consecutive steps" in decisions[2].reason


def test_a_normal_kl_step_resets_the_patience():
    stopper = make_stopper(kl_threshold=0.2, kl_patience=2)
    decisions = run_steps(stopper, [(0.3, 0.0), (0.1, 0.0), (0.3, 0.0), (0.2, 0.0), (0.3, 0.0)])
    assert decisions == [None] * 5  # exactly the threshold is not above it
    assert run_steps(stopper, [(0.3, 0.0)], start=6)[0].action == "stop"


def test_non_finite_kl_counts_as_high():
    stopper = make_stopper(kl_threshold=0.2, kl_patience=2)
    decisions = run_steps(stopper, [(math.nan, 0.0), (math.inf, 0.0)])
    assert decisions[0] is None
    assert decisions[1].action == "stop"


def test_kl_threshold_defaults_to_twice_target_kl_and_zero_patience_turns_rules_off():
    assert make_stopper(target_kl=0.1, kl_patience=5).kl_threshold == pytest.approx(0.2)
    assert make_stopper(target_kl=0.1, kl_patience=5, kl_threshold=0.7).kl_threshold == 0.7
    off = make_stopper(target_kl=0.1, kl_threshold=0.7)
    assert (off.kl_threshold, off.plateau_patience) == (None, None)
    assert make_stopper(reward_plateau_patience=7).plateau_patience == 7


def test_reward_plateau_stops_when_best_does_not_improve_by_min_delta():
    stopper = make_stopper(reward_plateau_patience=3, reward_plateau_min_delta=0.05)
    # 0.5 is the best; 0.54 and 0.52 are within min_delta, 0.3 is worse.
    decisions = run_steps(stopper, [(0.0, 0.5), (0.0, 0.54), (0.0, 0.3), (0.0, 0.52)])
    assert decisions[:3] == [None, None, None]
    assert decisions[3] == Decision(
        "stop",
        "best mean score 0.5 not improved by more than 0.05 for 3 steps (patience 3); last 0.52",
        4,
    )


def test_an_improvement_resets_the_plateau_count():
    stopper = make_stopper(reward_plateau_patience=2)
    scores = [0.1, 0.1, 0.2, 0.2, 0.3, 0.3]
    assert run_steps(stopper, [(0.0, s) for s in scores]) == [None] * 6
    assert run_steps(stopper, [(0.0, 0.25)], start=7)[0].action == "stop"


def test_kl_decision_comes_first_when_both_rules_fire():
    stopper = make_stopper(kl_threshold=0.1, kl_patience=1, reward_plateau_patience=1)
    run_steps(stopper, [(0.0, 1.0)])
    decision = stopper.observe_step(2, 0.5, 0.5)
    assert decision.action == "stop"
    assert "mean KL" in decision.reason


def test_rollback_when_validation_falls_below_ratio_of_recent_training():
    stopper = make_stopper(rollback_val_ratio=0.5)
    run_steps(stopper, [(0.0, 0.8), (0.0, 0.6)])
    assert stopper.observe_validation(2, 0.4) is None  # limit 0.5 * 0.7 = 0.35
    stopper.mark_good(2)
    assert stopper.last_good_step == 2
    # Only the steps since the previous validation count: mean of 0.9 and 0.7 is 0.8.
    run_steps(stopper, [(0.0, 0.9), (0.0, 0.7)], start=3)
    decision = stopper.observe_validation(4, 0.39)
    assert decision.action == "rollback"
    assert decision.step == 4
    assert "0.39 below 0.4" in decision.reason
    assert "over the last 2 steps" in decision.reason
    assert "roll back to step 2" in decision.reason


def test_rollback_limit_for_negative_training_scores_is_below_the_mean():
    stopper = make_stopper(rollback_val_ratio=0.5)
    run_steps(stopper, [(0.0, -2.0)])
    assert stopper.observe_validation(1, -2.9) is None  # limit -2 - 0.5 * 2 = -3
    run_steps(stopper, [(0.0, -2.0)], start=2)
    decision = stopper.observe_validation(2, -3.1)
    assert decision.action == "rollback"
    assert "no checkpoint has passed validation yet" in decision.reason


def test_validation_without_training_steps_since_the_last_one_decides_nothing():
    stopper = make_stopper(rollback_val_ratio=0.9)
    assert stopper.observe_validation(0, 0.0) is None
    run_steps(stopper, [(0.0, 1.0)])
    assert stopper.observe_validation(1, 0.95) is None
    assert stopper.observe_validation(1, 0.0) is None


def test_state_round_trip_mid_count_continues_exactly():
    settings = {
        "kl_threshold": 0.2,
        "kl_patience": 3,
        "reward_plateau_patience": 3,
        "rollback_val_ratio": 0.5,
    }
    steps = [(0.3, 0.5), (0.3, 0.4), (0.1, 0.45), (0.3, 0.3), (0.3, 0.2)]
    first = make_stopper(**settings)
    run_steps(first, steps[:3])
    first.mark_good(2)
    state = json.loads(json.dumps(first.state_dict()))

    resumed = make_stopper(**settings)
    resumed.load_state_dict(state)
    uninterrupted = make_stopper(**settings)
    run_steps(uninterrupted, steps[:3])
    uninterrupted.mark_good(2)
    assert resumed.state_dict() == uninterrupted.state_dict()
    assert resumed.last_good_step == 2
    steps += [(0.3, 0.1)]
    decisions = run_steps(resumed, steps[3:], 4)
    assert decisions == run_steps(uninterrupted, steps[3:], 4)
    # The plateau (best 0.5 at step 1) fires at steps 4 and 5; the KL streak reaches 3 at 6.
    assert [d.reason.split()[0] for d in decisions] == ["best", "best", "mean"]
    assert resumed.observe_validation(6, 0.1) == uninterrupted.observe_validation(6, 0.1)


def test_load_state_dict_names_missing_keys():
    stopper = make_stopper()
    state = stopper.state_dict()
    del state["score_count"]
    with pytest.raises(ValueError, match=r"missing \['score_count'\]"):
        stopper.load_state_dict(state)


def test_disabled_settings_never_decide():
    stopper = make_stopper()
    decisions = run_steps(stopper, [(1e9, 0.0)] * 20 + [(math.nan, math.nan)])
    assert decisions == [None] * 21
    assert stopper.observe_validation(21, -1e9) is None
    assert stopper.last_good_step is None


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("kl_threshold=0", "trainer.early_stop.kl_threshold: must be > 0"),
        ("kl_patience=-1", "trainer.early_stop.kl_patience: must be >= 0"),
        ("reward_plateau_min_delta=-0.1", "reward_plateau_min_delta: must be >= 0"),
        ("rollback_val_ratio=1.5", "trainer.early_stop.rollback_val_ratio: must be <= 1"),
    ],
)
def test_invalid_settings_are_clear_errors(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"trainer.early_stop.{override}"])


def test_should_stop_epochs():
    assert not should_stop_epochs(0.05, 0.1)
    assert not should_stop_epochs(0.1, 0.1)
    assert should_stop_epochs(0.11, 0.1)
    assert should_stop_epochs(math.nan, 0.1)
    assert not should_stop_epochs(100.0, None)

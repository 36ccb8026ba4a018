"""Full trainer steps per algorithm variant through the real Megatron stages and updates
(tests/distributed/workers/trainer_step.py), checked against hand computations.

What each variant must show: the models its config needs and no others; advantages equal
to the estimator's formula written out here from the scores, KL and values; a KL controller
that moves only with the KL in the reward; the KL loss where asked; and an update that
raises the log-probs of positive-advantage responses relative to negative ones.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.distributed.workers.trainer_step import SCORES
from tests.helpers import run_worker_layouts

# The numerics guard: the 1-rank steps of every variant as the code before the issue-53
# renovation computed them (same tiny model, same seeds); a refactor must reproduce them.
REFERENCE = Path(__file__).parent / "data" / "trainer_step_reference.json"
GSPO = ("gspo", "vanilla_gspo_settings")
GRPO_LIKE = ("grpo", "dr_grpo", "grpo_tis", "grpo_seq_is", "grpo_bypass", *GSPO)  # KL in reward
BETA = 0.05  # algorithm.kl_ctrl.kl_coef in the worker
GROUPS = [list(range(0, 4)), list(range(4, 8))]
# Up to float32 rounding: on the machine that stored the run these were the same bits; on
# another CPU (an AMD EPYC against it) torch's kernels sum in another order, and log-probs
# of ~7 moved by up to 3.3e-6, perplexities of ~400 by up to 1e-7 of their size
CLOSE = {"rel_tol": 1e-6, "abs_tol": 1e-5}


@pytest.fixture(scope="module")
def steps(tiny_qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_step")
    return run_worker_layouts("trainer_step.py", {"one": (1, [])}, tiny_qwen2_dir, out)["one"]


def test_the_steps_reproduce_the_stored_run(steps):
    """Every variant's two steps (log-probs before and after, reference log-probs, values,
    advantages, returns, importance weights, the probe, the synced tensors, metrics, the KL
    coefficient) equal the stored run up to float32 rounding (`CLOSE`)."""
    stored = json.loads(REFERENCE.read_text())
    assert sorted(stored) == sorted(steps)
    differences = list(_differences(stored, steps, ""))
    assert not differences, f"{len(differences)} values moved, e.g. {differences[:3]}"


def _differences(stored, now, path: str) -> Iterator[str]:
    """Where `now` (a worker's result) is not `stored` (its JSON form)."""
    if isinstance(now, dict):
        if sorted(map(str, now)) != sorted(stored):
            yield f"{path}: keys {sorted(map(str, now))} != {sorted(stored)}"
            return
        for key, value in now.items():
            yield from _differences(stored[str(key)], value, f"{path}/{key}")
    elif isinstance(now, torch.Tensor):
        expected = torch.tensor(stored["tensor"], dtype=torch.float64)
        got = now.double()
        close = torch.allclose(got, expected, rtol=CLOSE["rel_tol"], atol=CLOSE["abs_tol"])
        if got.shape != expected.shape or not close:
            yield path
    elif isinstance(now, (list, tuple)):
        if len(now) != len(stored):
            yield f"{path}: {len(now)} items != {len(stored)}"
            return
        for i, (a, b) in enumerate(zip(stored, now)):
            yield from _differences(a, b, f"{path}[{i}]")
    elif isinstance(now, float) and math.isnan(now):
        if not (isinstance(stored, float) and math.isnan(stored)):
            yield path
    elif isinstance(now, float):
        if not math.isclose(now, stored, **CLOSE):
            yield f"{path}: {now} != {stored}"
    elif now != stored:
        yield f"{path}: {now!r} != {stored!r}"


def per_token(values: list[float], mask: torch.Tensor) -> torch.Tensor:
    """One value per sample, on each of its response tokens."""
    return torch.tensor(values)[:, None] * mask


def grpo(scores: list[float], by_std: bool) -> list[float]:
    adv = [0.0] * len(scores)
    for group in GROUPS:
        values = [scores[i] for i in group]
        mean, std = statistics.fmean(values), statistics.stdev(values)
        for i in group:
            adv[i] = (scores[i] - mean) / (std + 1e-6) if by_std else scores[i] - mean
    return adv


def rloo(scores: list[float]) -> list[float]:
    adv = [0.0] * len(scores)
    for group in GROUPS:
        for i in group:
            others = [scores[j] for j in group if j != i]
            adv[i] = scores[i] - sum(others) / len(others)
    return adv


def token_rewards(step: dict, beta: float) -> list[list[float]]:
    """score on the last response token minus beta x (old - ref) on every token."""
    rows = []
    for i, row_mask in enumerate(step["mask"]):
        n = int(row_mask.sum())
        kl = [0.0] * n
        if step["ref_logprobs"] is not None:
            kl = (step["old_logprobs"][i, :n] - step["ref_logprobs"][i, :n]).tolist()
        rows.append([-beta * k + (SCORES[i] if t == n - 1 else 0.0) for t, k in enumerate(kl)])
    return rows


def whiten(rows: list[list[float]]) -> list[list[float]]:
    flat = [x for row in rows for x in row]
    mean, var = statistics.fmean(flat), statistics.variance(flat)
    return [[(x - mean) / math.sqrt(var + 1e-8) for x in row] for row in rows]


def padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.tensor(row)
    return out


def expected_advantages(name: str, step: dict) -> torch.Tensor:
    mask = step["mask"]
    if name in (*GRPO_LIKE, "grpo_kl_loss", "grpo_no_kl"):
        # GRPO scores a response by the sum of its token rewards (KL included when in reward)
        in_reward = name in GRPO_LIKE  # the others: use_kl_in_reward=false
        scores = [sum(row) for row in token_rewards(step, BETA if in_reward else 0.0)]
        return per_token(grpo(scores, by_std=name != "dr_grpo"), mask)
    rewards = token_rewards(step, BETA)
    if name == "rloo":
        return per_token(rloo([sum(row) for row in rewards]), mask)
    to_go = [[sum(row[t:]) for t in range(len(row))] for row in rewards]  # gamma = lam = 1
    if name == "reinforce_plus_plus":
        return padded(whiten(to_go), mask.float())
    values = step["values"]
    return padded(
        whiten(
            [[g - float(values[i, t]) for t, g in enumerate(row)] for i, row in enumerate(to_go)]
        ),
        mask.float(),
    )


VARIANTS = [
    "gae",
    "grpo",
    "dr_grpo",
    "rloo",
    "reinforce_plus_plus",
    "grpo_kl_loss",
    "grpo_no_kl",
    "gspo",
    "vanilla_gspo_settings",
    "grpo_tis",
    "grpo_seq_is",
]


@pytest.mark.parametrize("name", VARIANTS)
def test_models_built_are_the_ones_the_algorithm_needs(steps, name):
    step = steps[name]
    assert step["has_critic"] == (name == "gae")
    assert step["has_ref"] == (name != "grpo_no_kl")
    assert ("critic/vf_loss" in step["metrics"]) == (name == "gae")
    assert (step["values"] is not None) == (name == "gae")


@pytest.mark.parametrize("name", VARIANTS)
def test_advantages_match_the_estimator_written_out(steps, name):
    step = steps[name]
    torch.testing.assert_close(
        step["advantages"], expected_advantages(name, step), rtol=1e-3, atol=1e-4
    )


def test_dr_grpo_differs_from_grpo_only_by_the_std(steps):
    assert not torch.allclose(steps["grpo"]["advantages"], steps["dr_grpo"]["advantages"])


@pytest.mark.parametrize("name", VARIANTS)
def test_kl_controller_moves_only_with_the_kl_in_the_reward(steps, name):
    before, after = steps[name]["kl_coef"]
    assert (after != before) == (name not in ("grpo_kl_loss", "grpo_no_kl"))


def test_kl_loss_is_logged_and_changes_the_update(steps):
    with_loss, without = steps["grpo_kl_loss"]["metrics"], steps["grpo_no_kl"]["metrics"]
    assert with_loss["actor/kl_coef"] == 0.5 and with_loss["actor/kl_loss"] > 0
    assert "actor/kl_loss" not in without and "actor/reward_kl_penalty" not in without
    # Same batch, advantages and start: only the KL loss makes the updates differ.
    torch.testing.assert_close(
        steps["grpo_kl_loss"]["advantages"], steps["grpo_no_kl"]["advantages"]
    )
    # ... and it pulls the actor towards the reference.
    ref = steps["grpo_kl_loss"]["ref_logprobs"]
    mask = steps["grpo_kl_loss"]["mask"]

    def distance(name: str) -> float:
        return float(((steps[name]["logprobs_after"] - ref) * mask).abs().sum())

    assert distance("grpo_kl_loss") < distance("grpo_no_kl")


def test_ppo_kl_bound_ends_the_epochs_early(steps):
    """`trainer.early_stop.ppo_kl_bound` through the trainer's update loop: GRPO's 2
    mini-batches x 2 epochs end at the first update whose actor/ppo_kl exceeds 1e-6."""
    bounded, free = steps["grpo_kl_bound"], steps["grpo"]
    assert "actor/ppo_kl_stop_after_updates" not in free["metrics"]
    assert bounded["metrics"]["actor/ppo_kl_stop_after_updates"] in (1.0, 2.0, 3.0)
    assert not torch.allclose(bounded["logprobs_after"], free["logprobs_after"])


def test_gspo_trains_with_its_own_loss(steps):
    """Same advantages as GRPO (the estimator), a different update (the sequence ratio);
    the loss itself is checked against a hand computation in tests/unit/test_algo_losses.py."""
    gspo, vanilla = steps["gspo"], steps["vanilla_gspo_settings"]  # only loss_mode differs
    assert gspo["metrics"]["actor/pg_clipfrac"] > 0.5  # ranges of 3e-4: clipped after step one
    assert not torch.allclose(gspo["logprobs_after"], vanilla["logprobs_after"])


def test_mismatch_metrics_written_out(steps):
    step = steps["grpo"]
    mask, old, rollout = step["mask"], step["old_logprobs"], step["rollout_logprobs"]
    tokens = [(old[i, t], rollout[i, t]) for i, t in mask.nonzero().tolist()]
    kl = statistics.fmean(float(r - o) for o, r in tokens)
    k3 = statistics.fmean(math.exp(float(o - r)) - float(o - r) - 1 for o, r in tokens)
    gaps = []
    for i, row in enumerate(mask):
        n = int(row.sum())
        gaps.append(float(-old[i, :n].mean() + rollout[i, :n].mean()))
    metrics = step["metrics"]
    assert metrics["rollout_corr/kl"] == pytest.approx(kl, rel=1e-5)
    assert metrics["rollout_corr/k3_kl"] == pytest.approx(k3, rel=1e-5)
    assert metrics["rollout_corr/log_ppl_diff"] == pytest.approx(statistics.fmean(gaps), rel=1e-5)
    assert "rollout_corr/rollout_is_mean" not in metrics and step["is_weights"] is None


@pytest.mark.parametrize(("name", "cap"), [("grpo_tis", 2.0), ("grpo_seq_is", 1.5)])
def test_truncated_importance_weights_written_out(steps, name, cap):
    step = steps[name]
    mask, old, rollout = step["mask"], step["old_logprobs"], step["rollout_logprobs"]
    expected = torch.zeros_like(old)
    for i, row in enumerate(mask):
        n = int(row.sum())
        if name == "grpo_tis":
            expected[i, :n] = torch.exp(old[i, :n] - rollout[i, :n]).clamp(max=cap)
        else:
            expected[i, :n] = min(math.exp(float((old[i, :n] - rollout[i, :n]).sum())), cap)
    torch.testing.assert_close(step["is_weights"], expected)
    clipped = (step["is_weights"] == cap) & mask
    assert 0 < int(clipped.sum()) < int(mask.sum())  # some capped, some not
    assert step["metrics"]["rollout_corr/rollout_is_mean"] > 0
    # Same batch and start as plain GRPO: the weights change the update.
    assert not torch.allclose(step["logprobs_after"], steps["grpo"]["logprobs_after"])


@pytest.mark.parametrize("name", VARIANTS)
def test_update_favours_positive_advantages(steps, name):
    step = steps[name]
    mask = step["mask"]
    delta = (step["logprobs_after"] - step["old_logprobs"]) * mask
    adv = step["advantages"]
    up = delta[(adv > 0) & mask].mean()
    down = delta[(adv < 0) & mask].mean()
    assert up > down, (float(up), float(down))
    assert step["metrics"]["actor/pg_clipfrac"] > 0  # 2 mini-batches x 2 epochs: clipping bites


LAYOUTS = {
    "dp2": (2, []),
    "tp2": (2, ["--tp", "2"]),  # with Megatron's sequence parallelism (on when TP > 1)
    "tp2_no_seq_split": (2, ["--tp", "2", "--sequence-parallel", "false"]),
    "pp2": (2, ["--pp", "2"]),
    "sp2": (2, ["--sp", "2"]),
    "tp2_sp2": (4, ["--tp", "2", "--sp", "2"]),  # Ulysses and Megatron's SP together
}
LAYOUT_VARIANTS = "gae,grpo_kl_loss,gspo"


@pytest.fixture(scope="module")
def layout_steps(tiny_qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("trainer_step_layouts")
    runs = {
        name: (n, [*args, "--variants", LAYOUT_VARIANTS]) for name, (n, args) in LAYOUTS.items()
    }
    return run_worker_layouts("trainer_step.py", runs, tiny_qwen2_dir, out)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("name", LAYOUT_VARIANTS.split(","))
def test_every_layout_takes_the_one_rank_steps(steps, layout_steps, layout, name):
    """Two full steps at DP2 / TP2 (with and without Megatron's sequence parallelism) / PP2 /
    Ulysses SP2 / TP2 x SP2: every metric (critic's included, grad norms too) and the updated
    log-probs equal the 1-rank run's."""
    one, other = steps[name], layout_steps[layout][name]
    assert other["sequence_parallel"] == (layout in ("tp2", "tp2_sp2"))
    assert sorted(other["metrics"]) == sorted(one["metrics"])
    for key, value in one["metrics"].items():
        assert other["metrics"][key] == pytest.approx(value, rel=2e-4, abs=1e-6), key
    torch.testing.assert_close(other["logprobs_after"], one["logprobs_after"], rtol=0, atol=2e-5)
    torch.testing.assert_close(other["advantages"], one["advantages"], rtol=0, atol=2e-5)


def test_bypass_mode_takes_the_engines_logprobs_as_the_old_ones(steps):
    """algorithm.rollout_correction.bypass_mode=true: the old log-probs the update and the
    advantages use are the engine's, exactly; no old-log-prob forward runs and no mismatch
    is measured. The actor's own log-probs (what ignoring bypass mode would take) differ."""
    step, plain = steps["grpo_bypass"], steps["grpo"]
    assert torch.equal(step["old_logprobs"], step["rollout_logprobs"])
    assert "old_log_prob" not in step["stages"] and "old_log_prob" in plain["stages"]
    assert not [key for key in step["metrics"] if key.startswith("rollout_corr/")]
    assert (plain["old_logprobs"] - plain["rollout_logprobs"]).abs().max() > 0.1
    torch.testing.assert_close(
        step["advantages"], expected_advantages("grpo_bypass", step), rtol=1e-3, atol=1e-4
    )


def test_critic_warmup_trains_only_the_critic_first(steps):
    """trainer.critic_warmup=1: step 1 leaves the actor as it was (still the reference at
    step 2) while the critic trains exactly as under plain GAE; step 2 updates the actor."""
    warm, gae = steps["gae_critic_warmup"], steps["gae"]
    assert torch.equal(warm["old_logprobs"], warm["ref_logprobs"])
    assert not torch.equal(gae["old_logprobs"], gae["ref_logprobs"])
    assert torch.equal(warm["values"], gae["values"])
    assert not torch.allclose(warm["logprobs_after"], warm["old_logprobs"])
    assert "actor/pg_loss" in warm["metrics"]

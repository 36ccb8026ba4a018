"""The trainer's stages on a mixture-of-experts policy (Qwen3-MoE, 6 experts, top-2, a dense
layer among 3 MoE layers), laid out by the config's `megatron.expert_*` keys:

- At EP2 (x DP2 for the dense part), EP2 x TP2 with expert-TP 1 (4 ranks: the experts'
  gradients are reduced over an expert-data-parallel group of 2), EP2 x PP2, EP2 x DP2,
  EP2 x Ulysses SP2 and EP2 x TP2 x PP2 the old-log-prob and reference stages, one actor
  update's pg_loss and grad norm (over dense and expert parameters) and the log-probs
  after it equal one rank's; so do the update's router metrics and transformers' routing.
- With megatron.moe_aux_loss_coeff / moe_z_loss_coeff on, one sample per micro-batch, the
  update's grad norm is that of an independent reference: transformers' model, the
  policy-gradient loss of test_ppo_stages plus Megatron's load-balancing loss and z-loss
  written out here from transformers' router logits, and autograd; every layout gives it
  (padding tokens are left out of the router's statistics), and EP2 the same update.
- Routing replay R2 replays the old-log-prob pass's routes, R3 the rollout engine's
  (here transformers' routes, per sample) in the old-log-prob, reference and update passes,
  alike at every layout.
- GLM-4.5 (sigmoid router with expert bias and groups, ungated shared experts, rotary on
  half of each head) and DeepSeek-V3 (the same routing, multi-latent attention) policies:
  their plain update at EP2 x TP2 and EP2 x PP2 equals one rank's.

The 8-rank and Ulysses layouts run in the slow tier (`LAYOUT_SETS`).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.distributed.test_moe_parity import MODELS, save_moe_model
from tests.helpers import run_worker_layouts

AUX, Z = 0.1, 0.01  # the worker's default --aux / --z
LAYOUTS = {
    "1rank": (1, []),
    "ep2": (2, ["--ep", "2"]),
    "ep2tp2etp1": (4, ["--ep", "2", "--tp", "2", "--etp", "1"]),
    "ep2pp2": (4, ["--ep", "2", "--pp", "2"]),
    "ep2dp2": (4, ["--ep", "2"]),  # dense DP4; the experts EP2 x expert-DP2
    "ep2sp2": (4, ["--ep", "2", "--sp", "2"]),  # Ulysses: dense SP2 x DP2
    # the second stage's MoE layers get their TP rank's slice of the padding mask
    "ep2tp2pp2": (8, ["--ep", "2", "--tp", "2", "--etp", "1", "--pp", "2"]),
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_stages_model")
    return save_moe_model(root / "qwen3_moe", MODELS["qwen3_moe"], seed=0)


# The layouts each module run compares with one rank: the 8-rank and the Ulysses ones (12 of
# the 27 ranks, ~40% of the module's time) in the slow tier
LAYOUT_SETS = {
    "ep": ("1rank", "ep2", "ep2tp2etp1", "ep2pp2", "ep2dp2"),
    "wide": ("1rank", "ep2sp2", "ep2tp2pp2"),
}
WIDE = pytest.mark.slow(reason="8 ranks and Ulysses SP2 x EP2 on 2 cores, each compared again")


@pytest.fixture(scope="module", params=["ep", pytest.param("wide", marks=WIDE)])
def results(moe_dir, tmp_path_factory, request):
    """The worker's results by layout, for the layouts of `LAYOUT_SETS[param]`."""
    out = tmp_path_factory.mktemp(f"moe_stages_{request.param}")
    layouts = {name: LAYOUTS[name] for name in LAYOUT_SETS[request.param]}
    return run_worker_layouts("moe_stages.py", layouts, moe_dir, out)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


DEEPSEEK_STYLE = ("glm4_moe", "deepseek_v3")
PLAIN_LAYOUTS = {name: LAYOUTS[name] for name in ("1rank", "ep2tp2etp1", "ep2pp2")}


@pytest.fixture(scope="module", params=DEEPSEEK_STYLE)
def deepseek_style(tmp_path_factory, request):
    """(model dir, results by layout) of the plain update of one DeepSeek-style family."""
    family = request.param
    root = tmp_path_factory.mktemp(f"{family}_stages")
    model = save_moe_model(root / family, MODELS[family], seed=0)
    plain = {name: (n, [*extra, "--plain-only"]) for name, (n, extra) in PLAIN_LAYOUTS.items()}
    return model, run_worker_layouts("moe_stages.py", plain, model, root)


@pytest.mark.parametrize("layout", [name for name in PLAIN_LAYOUTS if name != "1rank"])
def test_deepseek_style_update_matches_one_rank(deepseek_style, layout):
    """Packed rows (the trainer's micro-batches: several samples per row) through GLM-4.5's
    sigmoid router and DeepSeek-V3's multi-latent attention, at EP2 x TP2 and EP2 x PP2."""
    check_update_matches_one_rank(deepseek_style[1], layout)


def test_deepseek_style_gradient_is_transformers(deepseek_style):
    """One rank's update gradient (its norm) is that of transformers' model under the same
    policy-gradient loss, written out with autograd: the expert bias, the groups, the
    scaling and the latent attention's backward are Megatron's as transformers has them."""
    model, results = deepseek_style
    one = results["1rank"]
    expected = hf_grad_norm_with_router_losses(model, one["batch"], one["advantages"], 0, 0)
    got = one["plain"]["metrics"]["actor/grad_norm"]
    print(f"{model.name} grad norm {got!r} (transformers: {expected!r})")
    assert got == pytest.approx(expected, rel=1e-5)


def test_expert_parallel_update_matches_one_rank(results):
    for layout in results:
        if layout != "1rank":
            check_update_matches_one_rank(results, layout)


def test_the_updated_experts_and_their_optimizer_state_round_trip_at_every_layout(results):
    """Saved after the update and loaded into a fresh actor: every weight and every shard of
    the distributed optimizer's state equal. Two EP ranks' local expert i are different
    experts, named by their global index in the optimizer's shards."""
    for layout, result in results.items():
        assert result["plain"]["checkpoint_round_trip"], layout


def check_update_matches_one_rank(results: dict, layout: str) -> None:
    one, other = results["1rank"]["plain"], results[layout]["plain"]
    for key in ("logprobs_before", "ref_logprobs", "logprobs_after"):
        print(f"{layout} {key}: max |diff| {max_diff(other[key], one[key]):.2e}")
    torch.testing.assert_close(other["logprobs_before"], one["logprobs_before"], atol=1e-5, rtol=0)
    torch.testing.assert_close(other["ref_logprobs"], one["ref_logprobs"], atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        print(f"{layout} {key}: {other['metrics'][key]!r} vs {one['metrics'][key]!r}")
        assert other["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
    torch.testing.assert_close(other["logprobs_after"], one["logprobs_after"], atol=1e-4, rtol=0)
    assert max_diff(one["logprobs_after"], one["logprobs_before"]) > 1e-2  # the step moved it


def megatron_router_losses(router_logits: tuple[torch.Tensor, ...], topk: int) -> torch.Tensor:
    """Megatron's load-balancing loss (without its coefficient) and z-loss terms of one
    micro-batch, summed over the MoE layers: E x sum_i f_i P_i with f_i the share of the
    top-k assignments that go to expert i and P_i its mean softmax probability; the z-loss
    the mean of logsumexp(logits)^2. Returns (aux, z)."""
    aux, z = torch.zeros(()), torch.zeros(())
    for logits in router_logits:
        tokens, experts = logits.shape
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
        f = chosen.sum(0) / (tokens * topk)
        aux = aux + experts * (f * probs.mean(0)).sum()
        z = z + torch.logsumexp(logits, dim=-1).square().mean()
    return torch.stack([aux, z])


def hf_grad_norm_with_router_losses(
    model_dir, batch: dict, advantages: torch.Tensor, aux: float = AUX, z: float = Z
) -> float:
    """The norm of d/dtheta of PPO's token-mean loss at ratio 1 plus, per sample (one per
    micro-batch), aux x aux loss + z x z-loss averaged over the samples (Megatron scales its
    router losses by 1 / micro-batches; both 0: the policy-gradient loss alone)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    samples = list(zip(batch["prompt_ids"], batch["response_ids"]))
    num_tokens = sum(len(r) for _, r in samples)
    loss = torch.zeros(())
    for i, (prompt, response) in enumerate(samples):
        router_losses = aux > 0 or z > 0
        out = model(torch.tensor([prompt + response]), output_router_logits=router_losses)
        positions = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
        logp = torch.log_softmax(out.logits[0].float(), dim=-1)[positions, torch.tensor(response)]
        ratio = torch.exp(logp - logp.detach())
        loss = loss - (advantages[i, : len(response)] * ratio).sum() / num_tokens
        if router_losses:
            topk = model.config.num_experts_per_tok
            aux_loss, z_loss = megatron_router_losses(out.router_logits, topk)
            loss = loss + (aux * aux_loss + z * z_loss) / len(samples)
    loss.backward()
    grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
    return float(torch.cat(grads).norm())


# Layouts that split each row over ranks (Megatron's sequence parallelism at TP2, Ulysses):
# Megatron takes the z-loss (and the aux loss's probabilities) as a mean over each rank's
# slice of the row and averages those, so with padding the slices weigh their real tokens
# unequally and the loss moves by ~1e-4 of the grad norm. Adam's first step (~lr x sign)
# turns that into ~1e-2 in the log-probs, so those are compared where rows are whole.
SPLIT_ROWS = {"ep2tp2etp1": 5e-4, "ep2sp2": 5e-4, "ep2tp2pp2": 5e-4}


def test_offloading_frees_every_storage_of_the_actor_experts_included(results):
    """Megatron keeps expert-parallel parameters in DDP buffers of their own
    (`expert_parallel_buffers`): offloading must take those too (it did not), or ~13 GiB
    of fp32 expert gradients stayed on each GPU of the 30B-A3B config. Each rank's bytes
    are summed from the module and optimizer themselves: before, offloaded, back."""
    for layout, run in results.items():
        for before, offloaded, back in run["plain"]["held_bytes"]:
            assert before > 0 and offloaded == 0 and back == before, layout


def test_an_inf_in_one_experts_gradient_stops_every_ranks_update(results):
    """The guard reads DDP's gradient buffers whole, the expert-parallel ones included
    (`TrainableMegatronModel.gradients_finite`): one rank's inf in a routed expert's
    gradient makes every rank skip the step."""
    for layout, run in results.items():
        ranks = len(run["plain"]["held_bytes"])
        assert run["plain"]["gradient_guard"] == [[True, False]] * ranks, layout


def test_router_losses_give_the_reference_gradient_at_every_layout(results, moe_dir):
    one = results["1rank"]
    advantages = one["advantages"]
    expected = hf_grad_norm_with_router_losses(moe_dir, one["batch"], advantages)
    without = one["plain"]["metrics"]["actor/grad_norm"]
    assert abs(expected - without) > 1e-2 * expected  # the router losses are not negligible
    for layout, run in results.items():
        got = run["router_loss"]["metrics"]["actor/grad_norm"]
        print(f"{layout} grad norm with router losses: {got!r} (transformers: {expected!r})")
        assert got == pytest.approx(expected, rel=SPLIT_ROWS.get(layout, 1e-4)), layout
        diff = max_diff(run["router_loss"]["logprobs_after"], one["router_loss"]["logprobs_after"])
        print(f"{layout} log-probs after the update with router losses: max |diff| {diff:.2e}")
        if layout not in SPLIT_ROWS:
            assert diff < 1e-4, layout


def hf_router_metrics(model_dir, batch: dict) -> dict[str, float]:
    """The routing of the update batch's real tokens by transformers' routers, written out
    here: per MoE layer the top-k assignments' max / min share per expert, Megatron's
    load-balancing loss over the batch (experts x sum_i f_i P_i) and the mean
    logsumexp(logits)^2; the loss and z-loss averaged over layers."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sparse = [
        i for i in range(model.config.num_hidden_layers) if i not in model.config.mlp_only_layers
    ]
    topk = model.config.num_experts_per_tok
    logits_by_layer: list[list[torch.Tensor]] = [[] for _ in sparse]
    with torch.no_grad():
        for prompt, response in zip(batch["prompt_ids"], batch["response_ids"]):
            out = model(torch.tensor([prompt + response]), output_router_logits=True)
            for i, logits in enumerate(out.router_logits):
                logits_by_layer[i].append(logits.float())
    metrics, aux, z = {}, [], []
    for layer, parts in zip(sparse, logits_by_layer):
        logits = torch.cat(parts)
        probs = torch.softmax(logits, dim=-1)
        chosen = torch.zeros_like(probs).scatter(1, probs.topk(topk, dim=-1).indices, 1.0)
        share = chosen.sum(0) / chosen.sum()
        metrics[f"layer_{layer}/max_expert_share"] = float(share.max())
        metrics[f"layer_{layer}/min_expert_share"] = float(share.min())
        aux.append(float(logits.shape[1] * (share * probs.mean(0)).sum()))
        z.append(float(torch.logsumexp(logits, dim=-1).square().mean()))
    return metrics | {"aux_loss": sum(aux) / len(aux), "z_loss": sum(z) / len(z)}


def test_router_metrics_equal_transformers_routing_at_every_layout(results, moe_dir):
    """The update's `actor/moe/*` metrics: the expert load of every MoE layer, the
    load-balancing loss and z-loss, and no token dropped, as transformers routes the batch."""
    expected = hf_router_metrics(moe_dir, results["1rank"]["batch"])
    assert expected["layer_0/max_expert_share"] > expected["layer_0/min_expert_share"]
    for layout, run in results.items():
        got = run["plain"]["metrics"]
        for name, value in expected.items():
            print(f"{layout} moe/{name}: {got[f'actor/moe/{name}']!r} (transformers: {value!r})")
            assert got[f"actor/moe/{name}"] == pytest.approx(value, rel=1e-5), (layout, name)
        assert "actor/moe/layer_1/max_expert_share" not in got  # the dense layer
        assert got["actor/moe/tokens_dropped_fraction"] == pytest.approx(0.0, abs=1e-12)
        shares = [v for k, v in expected.items() if k.endswith("/max_expert_share")]
        assert got["actor/moe/max_expert_share"] == pytest.approx(max(shares), rel=1e-5)


def test_token_dropping_drops_and_changes_the_update_alike_at_every_layout(results):
    """megatron.moe_expert_capacity_factor=0.5: about half the top-k assignments are
    dropped (Megatron keeps each expert's highest-probability tokens up to its capacity),
    so the update differs from the one without dropping; layouts whose ranks route whole
    rows (one sample per micro-batch) drop the same tokens, so give the same update."""
    one = results["1rank"]["dropping"]
    dropped = one["metrics"]["actor/moe/tokens_dropped_fraction"]
    print(f"1rank dropped fraction at capacity 0.5: {dropped:.3f}")
    assert 0.3 < dropped < 0.7
    kept_all = results["1rank"]["router_loss"]["logprobs_after"]
    assert max_diff(one["logprobs_after"], kept_all) > 1e-2
    for layout, run in results.items():
        if layout in SPLIT_ROWS:  # capacity is per rank's slice of the row there
            continue
        got = run["dropping"]["metrics"]["actor/moe/tokens_dropped_fraction"]
        assert got == pytest.approx(dropped, rel=1e-9), layout
        assert max_diff(run["dropping"]["logprobs_after"], one["logprobs_after"]) < 1e-4, layout


def test_routing_replay_r2_replays_the_old_routes_alike_at_every_layout(results):
    """router_replay.mode=R2, two PPO epochs: the old-log-prob pass on the update's plan
    gives the plain old log-probs (the routes are the model's own there); after the update
    some routes move when routing anew, and replaying the recorded ones gives other
    log-probs; every layout's R2 update equals one rank's."""
    one = results["1rank"]["r2"]
    before = results["1rank"]["plain"]["logprobs_before"]
    torch.testing.assert_close(one["old_logprobs"], before, atol=1e-5, rtol=0)
    print(f"1rank R2: {one['moved']} token-layer routes moved by the update")
    assert one["moved"] > 0
    assert max_diff(one["logprobs_replayed"], one["logprobs_after"]) > 1e-3
    anew = one["metrics_routing_anew"]["actor/pg_loss"]
    print(
        f"1rank pg_loss over the two epochs: R2 {one['metrics']['actor/pg_loss']!r}, anew {anew!r}"
    )
    assert abs(one["metrics"]["actor/pg_loss"] - anew) > 1e-6  # the second epoch replayed
    for layout, run in results.items():
        r2 = run["r2"]
        # (rows split over ranks are padded, and padding tokens have routes too)
        assert r2["moved"] == one["moved"] if layout not in SPLIT_ROWS else r2["moved"] > 0
        for key in ("actor/pg_loss", "actor/grad_norm"):
            print(f"{layout} R2 {key}: {r2['metrics'][key]!r} vs {one['metrics'][key]!r}")
            assert r2["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key
        for key in ("logprobs_after", "logprobs_replayed"):
            diff = max_diff(r2[key], one[key])
            print(f"{layout} R2 {key}: max |diff| {diff:.2e}")
            assert diff < 1e-4, (layout, key)


def test_rollout_routing_replay_r3_takes_the_given_routes_alike_at_every_layout(results):
    """router_replay.mode=R3 with routes transformers computed per sample: the model's own
    routes give the plain log-probs; sending every token to its 2nd and 3rd choices changes
    them, and the reference and the update take those routes too. Outside the replay (the
    weight-sync probe) the actor routes anew. Every layout equals one rank."""
    one, plain = results["1rank"]["r3"], results["1rank"]["plain"]
    moved_by = max_diff(one["old_moved"], plain["logprobs_before"])
    print(f"1rank R3: 2nd/3rd-choice routes move the log-probs by {moved_by:.2e}")
    assert moved_by > 1e-2
    torch.testing.assert_close(one["ref_moved"], one["old_moved"], atol=1e-6, rtol=0)
    for layout, run in results.items():
        r3 = run["r3"]
        for key, expected in (
            ("old_own", plain["logprobs_before"]),
            ("not_replayed", plain["logprobs_before"]),
            ("old_moved", one["old_moved"]),
            ("ref_moved", one["old_moved"]),
            ("logprobs_after", one["logprobs_after"]),
        ):
            diff = max_diff(r3[key], expected)
            print(f"{layout} R3 {key}: max |diff| {diff:.2e}")
            assert diff < (1e-4 if key == "logprobs_after" else 1e-5), (layout, key)
        for key in ("actor/pg_loss", "actor/grad_norm"):
            print(f"{layout} R3 {key}: {r3['metrics'][key]!r} vs {one['metrics'][key]!r}")
            assert r3["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5), key

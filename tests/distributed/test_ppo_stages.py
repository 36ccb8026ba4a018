"""The trainer's Megatron stages against independent references, on a batch in which some
samples are multi-turn (a tool message between two turns: trained on the policy's tokens only).

- Old log-probs from packed micro-batches (block-diagonal masks, several per rank) equal
  per-sample HF transformers log-probs (fp32, 1e-5).
- The gradient of one actor update's loss equals HF transformers + the policy-gradient loss
  written out here + autograd, and Adam's first step moves each weight against it.
- That update (PPO loss through Megatron's schedule, Adam, grad clip) gives the same
  pg_loss, grad norm and post-update log-probs at DP2, TP2, PP2 and Ulysses SP2 as on one
  rank, and with SP2 the same updated weights; so does a second update of 2 mini-batches x
  2 epochs in which clipping is active (pg_clipfrac compared too).
- bf16 (Megatron mixed precision) keeps fp32 master weights and Adam state and gives the fp32
  update up to bf16 rounding.
- At every layout the actor saved after the update (Megatron distributed checkpoint: weights,
  master weights, Adam moments) loads back equal into a freshly built actor.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.helpers import run_worker_layouts

LAYOUTS = {
    "1rank": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2"]),
    "sp2": (2, ["--sp", "2"]),  # Ulysses
    "bf16": (1, ["--dtype", "bfloat16"]),
}


@pytest.fixture(scope="module")
def results(tiny_qwen2_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ppo_stages")
    return run_worker_layouts("ppo_stages.py", LAYOUTS, tiny_qwen2_dir, out)


def policy_tokens(batch: dict, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions predicting them, ids) of sample i's policy tokens: its response tokens
    where its response mask is 1, each predicted by the position before it."""
    prompt, response = batch["prompt_ids"][i], batch["response_ids"][i]
    kept = [t for t, m in enumerate(batch["response_masks"][i]) if m]
    return torch.tensor([len(prompt) - 1 + t for t in kept]), torch.tensor(
        [response[t] for t in kept]
    )


def hf_response_logprobs(model_dir, batch: dict) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(sum(m) for m in batch["response_masks"])
    out = torch.zeros(len(batch["prompt_ids"]), width)
    with torch.no_grad():
        for i, (prompt, response) in enumerate(zip(batch["prompt_ids"], batch["response_ids"])):
            tokens = torch.tensor([prompt + response])
            logp = torch.log_softmax(model(tokens).logits[0].float(), dim=-1)
            positions, ids = policy_tokens(batch, i)
            out[i, : len(ids)] = logp[positions, ids]
    return out


def test_packed_logprobs_match_hf(results, tiny_qwen2_dir):
    one = results["1rank"]
    assert sum(0 in m for m in one["batch"]["response_masks"]) >= 2  # multi-turn samples
    reference = hf_response_logprobs(tiny_qwen2_dir, one["batch"])
    torch.testing.assert_close(one["logprobs_before"], reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "sp2"])
def test_update_matches_one_rank(results, layout):
    one, other = results["1rank"], results[layout]
    torch.testing.assert_close(other["logprobs_before"], one["logprobs_before"], atol=1e-5, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
        assert other["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(other["logprobs_after"], one["logprobs_after"], atol=1e-4, rtol=0)
    # the update changed the policy (the comparison above is not of two untouched models)
    assert (one["logprobs_after"] - one["logprobs_before"]).abs().max() > 1e-3


def test_ulysses_update_gives_the_same_weights(results, tiny_qwen2_dir):
    """Same weights after the Adam step (lr 1e-2), up to fp32 summation order.

    Adam's first step is ~lr x sign(g): where a gradient is ~0, the order in which SP ranks
    sum their parts can move an element by a few 1e-5. The update itself is ~1e-2, so the
    tolerance (1e-4) is 1% of it and a wrong gradient (e.g. counted twice) fails.
    """
    one, sp2 = results["1rank"]["weights"], results["sp2"]["weights"]
    assert one.keys() == sp2.keys()
    for name, value in one.items():
        torch.testing.assert_close(
            sp2[name], value, atol=1e-4, rtol=0, msg=lambda m, n=name: f"{n}: {m}"
        )
    first = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32)
    before = first.model.embed_tokens.weight
    after = one["embedding.word_embeddings.weight"][: before.shape[0]]
    assert float((after - before).abs().max()) > 5e-3  # the step moved the weights


def assert_bf16_update_matches_fp32(bf16: dict, fp32: dict) -> None:
    """bf16 weights with fp32 master weights; the fp32 update up to bf16 rounding."""
    assert bf16["param_dtypes"] == {"torch.bfloat16"}
    assert bf16["master_dtypes"] == {"torch.float32"}
    # bf16 keeps ~3 significant digits: log-probs of ~-6 to within ~1e-2
    torch.testing.assert_close(bf16["logprobs_before"], fp32["logprobs_before"], atol=2e-2, rtol=0)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
        assert bf16["metrics"][key] == pytest.approx(fp32["metrics"][key], rel=1e-2), key
    moved = (fp32["logprobs_after"] - fp32["logprobs_before"]).abs().max()
    assert (bf16["logprobs_after"] - fp32["logprobs_after"]).abs().max() < 0.1 * moved


def test_bf16_update_keeps_fp32_master_weights(results):
    one = results["1rank"]
    assert one["param_dtypes"] == one["master_dtypes"] == {"torch.float32"}
    assert_bf16_update_matches_fp32(results["bf16"], one)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_actor_checkpoint_round_trip(results, layout):
    assert results[layout]["checkpoint_round_trip"]
    assert results[layout]["background_round_trip"]  # the snapshot, not the changed tensors


LR, WEIGHT_DECAY = 0.01, 0.01  # the worker's actor.optim.lr and the default weight decay
# Megatron parameter -> the HF parameter with the same layout (tied embeddings: one tensor)
SAME_LAYOUT = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.layers.0.mlp.linear_fc2.weight": "model.layers.0.mlp.down_proj.weight",
    "decoder.layers.1.self_attention.linear_proj.weight": "model.layers.1.self_attn.o_proj.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}


def hf_policy_gradient(model_dir, batch: dict, advantages: torch.Tensor) -> dict:
    """d/dtheta of -sum_t A_t * pi_t / sg[pi_t] / N_tok: PPO's token-mean loss where the
    ratio is 1 (the first update), computed with HF transformers and autograd."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_tokens = sum(sum(m) for m in batch["response_masks"])
    loss = torch.zeros(())
    for i, (prompt, response) in enumerate(zip(batch["prompt_ids"], batch["response_ids"])):
        logits = model(torch.tensor([prompt + response])).logits[0].float()
        positions, ids = policy_tokens(batch, i)
        logp = torch.log_softmax(logits, dim=-1)[positions, ids]
        ratio = torch.exp(logp - logp.detach())
        loss = loss - (advantages[i, : len(ids)] * ratio).sum() / num_tokens
    loss.backward()
    params = dict(model.named_parameters())
    return {name: params[hf].grad for name, hf in SAME_LAYOUT.items()}, params


def test_update_gradient_matches_hf_autograd_and_adam_moves_against_it(results, tiny_qwen2_dir):
    one = results["1rank"]
    reference, hf_params = hf_policy_gradient(tiny_qwen2_dir, one["batch"], one["advantages"])
    for name, expected in reference.items():
        got = one["gradient"][name][: expected.shape[0]]  # vocabulary padding rows
        scale = float(expected.abs().max())
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4 * scale, msg=name)
        # Adam's first step is -lr * g / |g| (after decoupled weight decay): the sign of
        # every clearly non-zero gradient element decides the direction of its weight.
        before = hf_params[SAME_LAYOUT[name]].detach()
        moved = one["weights"][name][: expected.shape[0]] - before * (1 - LR * WEIGHT_DECAY)
        clear = expected.abs() > 1e-3 * scale
        if name.endswith("layernorm.weight"):  # no weight decay on norms
            moved = one["weights"][name] - before
        assert torch.equal(torch.sign(moved[clear]), -torch.sign(expected[clear])), name


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2", "sp2"])
def test_clipped_epochs_match_one_rank(results, layout):
    one, other = results["1rank"], results[layout]
    assert one["clipped_metrics"]["actor/pg_clipfrac"] > 0.05  # clipping is active
    assert sorted(other["clipped_metrics"]) == sorted(one["clipped_metrics"])
    for key, value in one["clipped_metrics"].items():
        assert other["clipped_metrics"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(other["logprobs_final"], one["logprobs_final"], atol=1e-4, rtol=0)


PROMPT_RESPONSE = ("prompt_ids", "response_ids")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_fixed_padded_micro_batches_give_the_packed_logprobs_and_gradient(results, layout):
    """verl's other mode (`use_dynamic_bsz=false`, `use_sequence_packing=false`): 3 samples
    per micro-batch in order, each padded to the longest; the padding is computed but changes
    no log-prob, and the loss's gradient is the packed one (only the summation order moves;
    compared on one rank, where the gradient is the whole mini-batch's, not a rank's share)."""
    run = results[layout]
    if layout in ("1rank", "bf16", "pp2"):  # rank 0 takes all 8 samples, rows not rounded
        lengths = [len(p) + len(r) for p, r in zip(*(run["batch"][k] for k in PROMPT_RESPONSE))]
        groups = [[0, 1, 2], [3, 4, 5], [6, 7]]
        padded = [len(g) * max(lengths[i] for i in g) for g in groups]
        assert run["fixed_layout"] == list(zip(groups, padded))
    tolerance = 2e-2 if layout == "bf16" else 1e-5
    torch.testing.assert_close(
        run["fixed_padded_logprobs"], run["logprobs_before"], atol=tolerance, rtol=0
    )
    if layout in ("1rank", "bf16"):  # one rank: its gradient is the whole mini-batch's
        atol, rtol = (1e-3, 1e-2) if layout == "bf16" else (1e-6, 1e-4)
        for name, value in run["gradient"].items():
            torch.testing.assert_close(
                run["fixed_padded_gradient"][name], value, atol=atol, rtol=rtol
            )

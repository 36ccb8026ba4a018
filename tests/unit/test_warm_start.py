"""The warm start: its targets and load-balancing loss by hand, and short runs that teach the
answer format (and, to a mixture-of-experts model, to use its experts evenly)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from rlhf.quickstart.arithmetic import make_problems
from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model
from rlhf.quickstart.tokenizer import build_tiny_tokenizer
from rlhf.quickstart.warm_start import (
    WarmStartConfig,
    answer_distribution,
    build_examples,
    load_balancing_loss,
    mix_weight,
    path_targets,
    prompt_ids,
    warm_start,
)
from rlhf.reward import compute_score


@dataclass(frozen=True)
class AccuracyResult:
    """Sampled answers scored with the rule reward."""

    accuracy: float  # fraction of responses with reward 1 (`#### <correct number>`)
    format_rate: float  # fraction of responses containing `####`
    num_responses: int


@torch.no_grad()
def sampled_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    *,
    temperature: float = 1.0,
    num_samples: int = 1,
    seed: int = 0,
    max_new_tokens: int = 16,
) -> AccuracyResult:
    """Generate `num_samples` responses per row (greedy if temperature is 0) and score them
    with the rule reward of each row's data_source."""
    torch.manual_seed(seed)
    by_length: dict[int, list[tuple[list[int], dict]]] = {}
    for row in rows:  # same-length prompts batch without padding
        ids = prompt_ids(tokenizer, row)
        by_length.setdefault(len(ids), []).append((ids, row))
    sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    options = sampling if temperature > 0 else {"do_sample": False, "num_beams": 1}
    scores, formats = [], []
    for length, group in sorted(by_length.items()):
        out_nt = model.generate(
            input_ids=torch.tensor([ids for ids, _ in group]),
            attention_mask=torch.ones(len(group), length, dtype=torch.long),
            max_new_tokens=max_new_tokens,
            num_return_sequences=num_samples,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **options,
        )
        texts = tokenizer.batch_decode(out_nt[:, length:], skip_special_tokens=True)
        for i, text in enumerate(texts):
            row = group[i // num_samples][1]
            truth = row["reward_model"]["ground_truth"]
            scores.append(compute_score(row["data_source"], text, truth, row.get("extra_info")))
            formats.append("####" in text)
    return AccuracyResult(sum(scores) / len(scores), sum(formats) / len(scores), len(scores))


@torch.no_grad()
def expert_shares(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: list[dict]):
    """[layers, experts]: the share of the top-k picks each expert gets at the prompt tokens
    of `rows`, read from each layer's router (transformers' Qwen3-MoE)."""
    layers = model.model.layers
    counts = torch.zeros(len(layers), model.config.num_experts)

    def count(layer: int):
        def hook(_module, _inputs, out) -> None:  # out: logits, top-k weights, top-k experts
            counts[layer] += torch.bincount(out[2].reshape(-1), minlength=counts.shape[1])

        return hook

    hooks = [layer.mlp.gate.register_forward_hook(count(i)) for i, layer in enumerate(layers)]
    try:
        for row in rows:
            model(torch.tensor([prompt_ids(tokenizer, row)]))
    finally:
        for hook in hooks:
            hook.remove()
    return counts / counts.sum(dim=1, keepdim=True)


WRONG = 0.65 / 18  # probability of each wrong answer when p_correct = 0.35


@pytest.fixture(scope="module")
def responses() -> list[list[int]]:
    tokenizer = build_tiny_tokenizer()
    return [
        [*tokenizer(f"#### {a}", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        for a in range(19)
    ]


def test_answer_distribution_puts_p_on_the_truth():
    probs = answer_distribution(7, 0.35)
    assert len(probs) == 19 and math.isclose(sum(probs), 1.0)
    assert probs[7] == 0.35 and all(math.isclose(p, WRONG) for i, p in enumerate(probs) if i != 7)


def test_path_targets_of_a_one_digit_answer(responses):
    tokenizer = build_tiny_tokenizer()
    digit = {d: tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    targets = path_targets(responses, answer_distribution(3, 0.35), 3, len(tokenizer))
    assert torch.allclose(targets.sum(dim=-1), torch.ones(len(responses[3])))
    for step in (0, 1, 2, 4):  # '##', '##', ' ', eos: every answer agrees on them
        assert targets[step, responses[3][step]] == pytest.approx(1.0)
    first = targets[3]
    assert first[digit[3]] == pytest.approx(0.35)
    assert first[digit[1]] == pytest.approx(10 * WRONG)  # 1 and 10..18 all start with '1'
    assert first[digit[5]] == pytest.approx(WRONG)


def test_path_targets_of_a_two_digit_answer_multiply_to_p(responses):
    tokenizer = build_tiny_tokenizer()
    targets = path_targets(responses, answer_distribution(12, 0.35), 12, len(tokenizer))
    path = responses[12]
    assert targets[3, path[3]] == pytest.approx(0.35 + 9 * WRONG)  # '1' of 1, 10..18
    assert targets[4, path[4]] == pytest.approx(0.35 / (0.35 + 9 * WRONG))  # '2' after '1'
    sequence_prob = math.prod(targets[step, tok].item() for step, tok in enumerate(path))
    assert sequence_prob == pytest.approx(0.35)


def test_examples_mark_only_response_tokens():
    tokenizer = build_tiny_tokenizer()
    cfg = WarmStartConfig(num_problems=8)
    examples = build_examples(tokenizer, cfg, len(tokenizer))
    row = make_problems(8, cfg.data_seed)[0]
    response_ids = tokenizer(f"#### {row['reward_model']['ground_truth']}<|im_end|>")["input_ids"]
    num_resp = int(examples.mask_nr[0].sum())
    assert examples.labels_nr[0, :num_resp].tolist() == response_ids
    predicted = examples.input_ids_nt[0, examples.position_nr[0, :num_resp] + 1]
    assert predicted.tolist() == response_ids


def test_mix_weight_moves_from_clean_to_mixed():
    cfg = WarmStartConfig(num_steps=100, clean_fraction=0.4, anneal_fraction=0.2)
    assert [mix_weight(s, cfg) for s in (0, 39, 40, 50, 60, 99)] == [0, 0, 0, 0.5, 1, 1]


def test_load_balancing_loss_is_one_for_even_use_and_counts_no_padding():
    pair_a, pair_b = [10.0, 10.0, 0.0, 0.0], [0.0, 0.0, 10.0, 10.0]  # top-2 of 4 experts
    even_xe = torch.tensor([pair_a, pair_b, pair_a])  # the last token is padding
    skewed_xe = torch.tensor([pair_a, pair_a, pair_b])
    tokens = torch.tensor([[True, True, False]])
    assert load_balancing_loss((even_xe,), tokens, top_k=2).item() == pytest.approx(1.0)
    # experts 0 and 1 take every pick, with probability ~1/2 each: 4 x (1/2 x 1/2) x 2
    assert load_balancing_loss((skewed_xe,), tokens, 2).item() == pytest.approx(2.0, rel=1e-3)
    both = load_balancing_loss((even_xe, skewed_xe), tokens, 2).item()
    assert both == pytest.approx(1.5, rel=1e-3)  # the mean over the layers


@pytest.mark.parametrize(
    "bad",
    [
        {"p_correct": 1.5},
        {"clean_fraction": 0.9, "anneal_fraction": 0.2},
        {"lr": 0.0},
        {"load_balancing_coef": -0.1},
    ],
)
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match="warm_start"):
        WarmStartConfig(**bad)


def test_short_warm_start_teaches_the_answer_format(tmp_path):
    model_dir = save_tiny_model(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = make_problems(320, seed=0)[256:272]
    untrained = AutoModelForCausalLM.from_pretrained(model_dir)
    assert sampled_accuracy(untrained, tokenizer, rows, num_samples=4).format_rate < 0.1
    cfg = WarmStartConfig(num_problems=512, num_steps=150, batch_size=32, warmup_steps=5)
    result = warm_start(model_dir, cfg)
    assert result.num_steps == 150
    assert result.final_loss < 1.0  # a random model starts near ln(vocab) = 5.9
    assert result.final_load_balancing_loss is None  # no experts
    model = AutoModelForCausalLM.from_pretrained(model_dir)  # the weights were saved
    sampled = sampled_accuracy(model, tokenizer, rows, num_samples=4, seed=0)
    assert sampled.num_responses == 64
    assert sampled.format_rate >= 0.9


def test_short_moe_warm_start_teaches_the_format_and_spreads_the_tokens(tmp_path):
    model_dir = save_tiny_model(tmp_path / "moe", TinyModelSpec.for_family("qwen3_moe"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = make_problems(320, seed=0)[256:272]
    cfg = WarmStartConfig(num_problems=512, num_steps=150, batch_size=32, warmup_steps=5)
    result = warm_start(model_dir, cfg)
    assert result.final_loss < 1.0
    # measured 1.007 (without the balancing loss: 1.75, two experts of one layer unused)
    assert result.final_load_balancing_loss is not None
    assert result.final_load_balancing_loss < 1.1
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert sampled_accuracy(model, tokenizer, rows, num_samples=4, seed=0).format_rate >= 0.9
    shares = expert_shares(model, tokenizer, rows)  # measured 0.07-0.17 (uniform: 0.125)
    print(shares)
    assert shares.min() > 0.04 and shares.max() < 0.25, shares

"""The tool-use quickstart's assets: its problems and data files, its tokenizer, the tiny-model
CLI's --tools, the warm start's examples and loss, and the measurement of tool use."""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rlhf.cli.make_tiny_model import has_tools_tokenizer
from rlhf.cli.make_tiny_model import main as make_tiny_model
from rlhf.cli.preprocess import main as preprocess
from rlhf.data.parquet import read_prompt_rows
from rlhf.quickstart.calculator_task import (
    CALCULATOR_SCHEMA,
    TOOL_CONFIG_FILE,
    answer_text,
    call_text,
    draw_problems,
    make_multiplication_problems,
    possible_answers,
)
from rlhf.quickstart.tiny_model import save_tiny_model
from rlhf.quickstart.tokenizer import build_tiny_tokenizer
from rlhf.quickstart.tool_use_eval import measure_tool_use, sample_turn, tool_use_stats
from rlhf.quickstart.tool_warm_start import (
    PathBuilder,
    ToolWarmStartConfig,
    build_tool_examples,
    policy_token_loss,
    tool_warm_start,
    tools_prompt_ids,
)
from rlhf.quickstart.tools_tokenizer import build_tools_tokenizer
from rlhf.quickstart.warm_start import answer_distribution
from rlhf.reward import compute_score
from rlhf.rollout.client import Generation
from rlhf.rollout.multi_turn import MultiTurnRollout, MultiTurnSettings, ToolMessages
from rlhf.tools.base import load_tools
from rlhf.tools.calculator import Calculator

# sha256 of the quickstart tokenizer's tokenizer.json as main built it before --tools existed:
# the quickstart's learning tests are tuned to this vocabulary.
QUICKSTART_TOKENIZER_SHA256 = "9beee7c8ef3d86dd670b853bf0df78cfd68e4b37849245a20d3871a8c20a5f3e"


@pytest.fixture(scope="module")
def tools_tokenizer():
    return build_tools_tokenizer()


def small_config(num_problems: int = 16, **training) -> ToolWarmStartConfig:
    cfg = ToolWarmStartConfig()
    return replace(cfg, training=replace(cfg.training, num_problems=num_problems, **training))


def test_problems_are_seeded_products_the_rule_reward_scores():
    rows = make_multiplication_problems(64, seed=3)
    assert rows == make_multiplication_problems(64, seed=3)
    assert rows != make_multiplication_problems(64, seed=4)
    for row in rows:
        question = row["prompt"][0]["content"]
        a, b = map(int, re.findall(r"\d+", question))
        truth = row["reward_model"]["ground_truth"]
        assert truth == str(a * b) and 2 <= a <= 9 and 2 <= b <= 9
        assert question.endswith("Give the final number after ####.")
        assert row["extra_info"]["need_tools_kwargs"] is False
        assert "tools_kwargs" not in row["extra_info"]
        assert compute_score(row["data_source"], answer_text(a * b), truth, None) == 1.0
        assert compute_score(row["data_source"], answer_text(a * b + 1), truth, None) == 0.0


def test_preprocess_quickstart_tools_writes_checked_rows_and_the_tool_config(tmp_path):
    assert preprocess(["quickstart-tools", "--local_dir", str(tmp_path), "--num_val", "8"]) == 0
    assert (
        preprocess(["check", str(tmp_path / "train.parquet"), str(tmp_path / "val.parquet")]) == 0
    )
    train = read_prompt_rows(str(tmp_path / "train.parquet"))
    val = read_prompt_rows(str(tmp_path / "val.parquet"))
    assert (len(train), len(val)) == (256, 8)
    assert [r.prompt for r in val] == [
        r["prompt"] for r in make_multiplication_problems(264, 0)[256:]
    ]
    (tool,) = load_tools(tmp_path / TOOL_CONFIG_FILE).values()
    assert isinstance(tool, Calculator) and tool.schema == CALCULATOR_SCHEMA


def test_the_quickstart_tokenizer_is_unchanged():
    tokenizer_json = build_tiny_tokenizer().backend_tokenizer.to_str()
    assert hashlib.sha256(tokenizer_json.encode()).hexdigest() == QUICKSTART_TOKENIZER_SHA256


def test_tools_tokenizer_writes_a_call_in_few_tokens_and_keeps_it_when_decoding(tools_tokenizer):
    text = call_text("7 * 8")
    assert (
        text
        == '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'
    )
    ids = tools_tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) <= 22  # 102 bytes; 20 or 21 tokens, whether the tool list has " *" or not
    assert ids[0] == tools_tokenizer.convert_tokens_to_ids("<tool_call>")
    assert tools_tokenizer.decode(ids, skip_special_tokens=True) == text
    base = build_tiny_tokenizer()
    assert len(base.encode(text, add_special_tokens=False)) > 40


def test_tiny_model_cli_tools_builds_the_tools_tokenizer_and_rebuilds_on_a_switch(tmp_path, capsys):
    out = tmp_path / "model"
    assert make_tiny_model([str(out), "--tools"]) == 0
    assert has_tools_tokenizer(out)
    assert AutoModelForCausalLM.from_pretrained(out).config.vocab_size == len(
        AutoTokenizer.from_pretrained(out)
    )
    assert make_tiny_model([str(out), "--tools"]) == 0
    assert "already present" in capsys.readouterr().out
    assert make_tiny_model([str(out)]) == 0
    assert "rebuilding" in capsys.readouterr().out and not has_tools_tokenizer(out)
    with pytest.raises(SystemExit):
        make_tiny_model([str(out), "--tools", "--family", "qwen3_moe"])


def test_first_turn_targets_split_p_tool_and_the_direct_answers(tools_tokenizer):
    problem = draw_problems(1, seed=0)[0]
    builder = PathBuilder(tools_tokenizer, p_tool=0.3, p_correct=0.15)
    prompt = tools_prompt_ids(tools_tokenizer, problem.messages())
    tool, direct = builder.tool_path(problem, prompt), builder.direct_path(problem, prompt)
    call_first = tools_tokenizer.convert_tokens_to_ids("<tool_call>")
    for path in (tool, direct):
        assert path.targets[0] == pytest.approx({call_first: 0.3, direct.labels[0]: 0.7})
    # along each path, the product of its own tokens' targets is the path's probability
    along = [t[label] for t, label in zip(direct.targets, direct.labels)]
    assert math.prod(along) == pytest.approx(0.7 * 0.15)
    call_len = len(tools_tokenizer.encode(call_text(problem.expression))) + 1
    along_call = [t[label] for t, label in zip(tool.targets[:call_len], tool.labels)]
    assert math.prod(along_call) == pytest.approx(0.3)
    assert all(t == {label: 1.0} for t, label in zip(tool.targets[1:], tool.labels[1:]))
    wrong = answer_distribution(problem.answer, 0.15, possible_answers())
    assert sum(wrong) == pytest.approx(1.0) and sorted(set(wrong))[0] == pytest.approx(
        0.85 / (len(possible_answers()) - 1)
    )


def test_tool_path_is_what_the_rollout_builds_and_tool_tokens_are_no_targets(tools_tokenizer):
    """A rollout whose turns are the tool path's two turns appends exactly the path's tokens,
    and its policy tokens are exactly the path's targets."""
    examples = build_tool_examples(tools_tokenizer, small_config(4))
    problem = draw_problems(4, small_config().training.data_seed)[0]
    prompt = tools_prompt_ids(tools_tokenizer, problem.messages())
    assert bool(examples.is_tool_n[0]) and not bool(examples.is_tool_n[1])
    count = int(examples.mask_nr[0].sum())
    positions = examples.position_nr[0, :count]
    labels = examples.labels_nr[0, :count].tolist()
    row = examples.input_ids_nt[0]
    assert row[positions + 1].tolist() == labels  # each target is the next token
    eos = tools_tokenizer.eos_token_id
    split = labels.index(eos) + 1
    turns = [labels[:split], labels[split:]]

    async def generate(ids, params):
        turn = turns.pop(0)
        return Generation(turn, [0.0] * len(turn), "stop")

    settings = MultiTurnSettings(max_response_length=200)
    rollout = MultiTurnRollout(
        {"calculator": Calculator(CALCULATOR_SCHEMA, {})}, tools_tokenizer, settings
    )
    conv = asyncio.run(rollout.converse(generate, prompt, {}, {}))
    response = row[len(prompt) : len(prompt) + len(conv.response_ids)].tolist()
    assert row[: len(prompt)].tolist() == prompt and response == conv.response_ids
    assert conv.tool_calls[0].result == str(problem.answer)
    tool_ids = ToolMessages(tools_tokenizer).ids([str(problem.answer)])
    assert response[split : split + len(tool_ids)] == tool_ids
    targeted = sorted(int(p) + 1 - len(prompt) for p in positions)
    assert targeted == [i for i, policy in enumerate(conv.response_mask) if policy]


def test_loss_with_the_shared_prefix_run_once_equals_the_full_forward(tools_tokenizer, tmp_path):
    model_dir = save_tiny_model(tmp_path / "model", tokenizer=tools_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    examples = build_tool_examples(tools_tokenizer, small_config(8))
    prompt = tools_prompt_ids(tools_tokenizer, draw_problems(1, 12345)[0].messages())
    assert 0 < examples.prefix_len < len(prompt)  # the turns before the user's question
    idx = torch.tensor([0, 3, 1, 6])
    shared, _ = policy_token_loss(model, examples, idx, mix=0.5)
    full, _ = policy_token_loss(model, replace(examples, prefix_len=0), idx, mix=0.5)
    assert shared.item() == pytest.approx(full.item(), rel=1e-5)
    grads_shared = torch.autograd.grad(shared, list(model.parameters()))
    grads_full = torch.autograd.grad(full, list(model.parameters()))
    for a, b in zip(grads_shared, grads_full):
        assert torch.allclose(a, b, atol=1e-6)
    # by hand, without the LM-head shortcut: the clean loss is the mean -log p of the labels
    clean, _ = policy_token_loss(model, examples, idx, mix=0.0)
    logp_btv = torch.log_softmax(model(examples.input_ids_nt[idx]).logits, dim=-1)
    mask = examples.mask_nr[idx]
    logp_br = torch.gather(
        torch.gather(
            logp_btv, 1, examples.position_nr[idx, :, None].expand(-1, -1, logp_btv.shape[-1])
        ),
        2,
        examples.labels_nr[idx, :, None],
    ).squeeze(-1)
    assert clean.item() == pytest.approx(-(logp_br[mask]).mean().item(), rel=1e-5)


def test_sampled_turns_carry_the_models_log_probs_and_stop_at_the_end_of_turn(
    tools_tokenizer, tmp_path
):
    model_dir = save_tiny_model(tmp_path / "model", tokenizer=tools_tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    prompt = tools_prompt_ids(tools_tokenizer, draw_problems(1, 0)[0].messages())

    def turn(eos: int, temperature: float = 0.5) -> Generation:
        generator = torch.Generator().manual_seed(7)
        return sample_turn(model, prompt, 6, temperature, eos, generator)

    long = turn(eos=-1)
    assert long.finish_reason == "length" and len(long.output_ids) == len(long.logprobs) == 6
    with torch.no_grad():
        logits_tv = model(torch.tensor([prompt + long.output_ids])).logits[0]
    logp_tv = torch.log_softmax(logits_tv[len(prompt) - 1 : -1] / 0.5, dim=-1)
    expected = logp_tv[torch.arange(6), torch.tensor(long.output_ids)]
    assert torch.allclose(torch.tensor(long.logprobs), expected, atol=1e-5)
    stop_at = long.output_ids[2]
    short = turn(eos=stop_at)
    first = long.output_ids.index(stop_at)
    assert short.finish_reason == "stop" and short.output_ids == long.output_ids[: first + 1]


def test_tool_use_stats_by_hand():
    stats = tool_use_stats([True, True, False, False, False], [1.0, 0.0, 0.0, 1.0, 0.0])
    assert (stats.call_rate, stats.accuracy_with_call) == (0.4, 0.5)
    assert stats.accuracy_without_call == pytest.approx(1 / 3) and stats.mean_reward == 0.4
    assert tool_use_stats([False], [1.0]).accuracy_with_call is None


def test_a_short_warm_start_learns_when_to_call_and_the_rollouts_measure_it(
    tools_tokenizer, tmp_path
):
    """60 steps (a few seconds) teach the first-token decision: about p_tool on the call."""
    model_dir = save_tiny_model(tmp_path / "model", tokenizer=tools_tokenizer)
    cfg = small_config(256, num_steps=60, warmup_steps=5)
    result = tool_warm_start(model_dir, cfg)
    assert result.num_steps == 60 and result.final_loss < 1.0  # from ln(vocab) ~ 6.2
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    rows = make_multiplication_problems(8, seed=0)
    call, direct = (tools_tokenizer.convert_tokens_to_ids(t) for t in ("<tool_call>", "####"))
    with torch.no_grad():
        for row in rows:
            prompt = tools_prompt_ids(tools_tokenizer, row["prompt"])
            probs_v = model(torch.tensor([prompt])).logits[0, -1].softmax(dim=-1)
            assert 0.1 < probs_v[call] < 0.5 and probs_v[call] + probs_v[direct] > 0.85
    stats = measure_tool_use(model, tools_tokenizer, rows, num_samples=2)
    assert stats.num_conversations == 16 and 0 < stats.call_rate < 1

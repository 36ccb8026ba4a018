"""`make quickstart-tools` learns: multi-turn GRPO in which a tiny Qwen2, warm-started to
call a calculator about 30% of the time, learns to call it (configs/quickstart_tools_cpu.yaml).

A real `rlhf-train` run with its own SGLang CPU server: every sample is a conversation, each
assistant turn one /generate on the ids so far, calculator results appended as tool messages.
Besides the learning, the run's rollouts files are checked against independent renderings:
the prompts are what transformers' chat template makes of the question with the tool list,
every tool message is the template's tool turn written out here around the recorded result,
and the engine's log-probs are 0 exactly there. The run uses one sample per micro-batch, so
the trainer's old log-probs of the policy tokens can be held to the probe's tolerance (1e-4)
against SGLang's: in long packed rows the CPU path's RoPE phases run along the row and drift
by ~1e-3 (docs/architecture.md, "Packed rows").

The warm-started model is built once and kept in pytest's cache (~45 s).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from rlhf.cli.make_tiny_model import main as make_tiny_model
from rlhf.data.parquet import read_prompt_rows
from rlhf.quickstart.data import write_tools_quickstart_data
from rlhf.tools.parser import parse_tool_calls
from tests.e2e.test_learning import code_hash
from tests.e2e.test_learning import train as train_quickstart
from tests.helpers import REPO

pytestmark = pytest.mark.slow(reason="learning shows only over tens of GRPO steps")
CONFIG = REPO / "configs" / "quickstart_tools_cpu.yaml"
STEPS = 12
MIN_RISE = 0.2
TOOLS_CODE = ("calculator_task.py", "tool_warm_start.py", "tools_tokenizer.py")


@pytest.fixture(scope="module")
def tools_model(request, tmp_path_factory) -> Path:
    """The warm-started tools model, as `make quickstart-tools-assets` builds it."""
    digest = hashlib.sha256(code_hash().encode())
    for name in TOOLS_CODE:
        digest.update((REPO / "rlhf" / "quickstart" / name).read_bytes())
    cache = getattr(request.config, "cache", None)
    key = f"quickstart-tools-{digest.hexdigest()[:16]}"
    root = cache.mkdir(key) if cache else tmp_path_factory.mktemp("t")
    assert make_tiny_model([str(root / "model"), "--tools", "--warm-start"]) == 0
    return root / "model"


def test_grpo_with_a_calculator_learns_to_call_it(tools_model, tmp_path):
    train, val, tool_config = write_tools_quickstart_data(tmp_path / "data")
    rows = train_quickstart(
        CONFIG,
        (tools_model, (train, val)),
        None,
        tmp_path / "run",
        STEPS,
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",  # one sample a row
    )
    val_rows = {r["step"]: r for r in rows if "val/test_score/all" in r}
    score = {s: r["val/test_score/all"] for s, r in val_rows.items()}
    use = {s: r["val/multi_turn/tool_use_rate"] for s, r in val_rows.items()}
    print(f"validation reward {score}, tool use {use}")
    assert score[STEPS] - score[0] >= MIN_RISE, score
    assert use[STEPS] - use[0] >= MIN_RISE, use
    trained = [r for r in rows if r["step"] > 0]
    assert all(r["tool_calls/count"] > 0 and r["multi_turn/turns"] > 1 for r in trained)
    assert all(r["rollout_corr/max_abs_diff"] < 1e-4 for r in trained)
    assert all(r["rollout/logprob_diff_max"] < 1e-4 for r in trained)  # the probe
    tokenizer = AutoTokenizer.from_pretrained(tools_model)
    schema = yaml.safe_load(tool_config.read_text())["tools"][0]["tool_schema"]
    prompts = [r.prompt for r in read_prompt_rows([str(train)])]
    for step in (1, STEPS):
        path = tmp_path / "run" / "rollouts" / f"step_{step}.jsonl"
        records = [json.loads(line) for line in path.read_text().splitlines()]
        compared = sum(check_conversation(r, prompts, tokenizer, schema) for r in records)
        assert compared >= 10, compared  # tool messages checked id for id


def runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each maximal run of equal values in `mask`."""
    out: list[tuple[int, int, int]] = []
    for t, value in enumerate(mask):
        if out and out[-1][0] == value:
            out[-1] = (value, out[-1][1], t + 1)
        else:
            out.append((value, t, t + 1))
    return out


def check_conversation(record: dict, prompts, tokenizer, schema) -> int:
    """Checks one rollout record; returns how many tool messages were compared id for id."""
    text = tokenizer.apply_chat_template(
        prompts[record["prompt_index"]], tools=[schema], add_generation_prompt=True, tokenize=False
    )
    assert record["prompt_ids"] == tokenizer.encode(text, add_special_tokens=False)
    ids, mask = record["response_ids"], record["response_mask"]
    parts = runs(mask)
    turns = [(s, e) for policy, s, e in parts if policy]
    assert len(turns) == record["turns"] and parts[-1][0] == 1  # ends on the policy's turn
    assert all(record["response_logprobs"][t] == 0.0 for t in range(len(ids)) if not mask[t])
    compared = 0
    for k, (policy, start, end) in enumerate(parts):
        if policy:
            if end < len(ids):  # a turn followed by tool messages ended its turn
                assert ids[end - 1] == tokenizer.eos_token_id
            continue
        turn = sum(1 for p, _, e in parts[:k] if p)  # the assistant turn that called
        said = tokenizer.decode(ids[parts[k - 1][1] : parts[k - 1][2]], skip_special_tokens=False)
        calls = [c for c in record["tool_calls"] if c["turn"] == turn]
        parsed = parse_tool_calls(said, "hermes")
        assert [(c.name, c.arguments) for c in parsed[: len(calls)]] == [
            (c["name"], c["arguments"]) for c in calls
        ]
        if len(parsed) != len(calls):  # calls over max_parallel_calls get an error message
            continue
        written = "".join(f"\n<|im_start|>tool\n{c['result']}<|im_end|>" for c in calls)
        expected = tokenizer.encode(written + "\n<|im_start|>assistant\n", add_special_tokens=False)
        assert ids[start:end] == expected
        compared += 1
    return compared

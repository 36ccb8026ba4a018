"""`rlhf-eval` refuses bad inputs with one line before starting anything (exit 2), and an
unreachable server fails with one line naming it (exit 1). Its runs on a real server are in
tests/e2e/test_learning.py."""

from __future__ import annotations

import pytest

from rlhf.cli.eval import main
from rlhf.data.parquet import write_rows
from rlhf.quickstart.arithmetic import make_problems
from rlhf.utils import free_port


def error_line(capsys) -> str:
    (line,) = [x for x in capsys.readouterr().err.splitlines() if x.startswith("rlhf-eval:")]
    return line


@pytest.fixture
def val_file(tmp_path):
    return write_rows(make_problems(4, seed=0), tmp_path / "val.parquet")


def test_models_that_are_not_policies(tmp_path, val_file, capsys):
    assert main([str(tmp_path / "missing"), "--data", str(val_file)]) == 2
    assert "model not found" in error_line(capsys)
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--data", str(val_file)]) == 2
    assert "neither an HF model directory" in error_line(capsys)
    critic = tmp_path / "global_step_3" / "critic"
    critic.mkdir(parents=True)
    (critic / "rlhf_checkpoint.json").write_text("{}")
    assert main([str(critic), "--data", str(val_file)]) == 2
    assert "is a critic" in error_line(capsys)


def test_config_and_data_errors(tiny_qwen2_dir, tmp_path, val_file, capsys):
    assert main([str(tiny_qwen2_dir), "reward.urll=x", "--data", str(val_file)]) == 2
    assert "reward.url" in error_line(capsys)  # the nearest key
    assert main([str(tiny_qwen2_dir)]) == 2
    assert "--data" in error_line(capsys)
    rows = make_problems(4, seed=0)
    rows[2]["reward_model"] = {**rows[2]["reward_model"], "style": "model"}
    judged = write_rows(rows, tmp_path / "judged.parquet")
    assert main([str(tiny_qwen2_dir), "--data", str(judged)]) == 2
    line = error_line(capsys)
    assert "judged.parquet" in line and "row 2" in line and "reward.url" in line
    # verl's reward_model.enable: every row is the reward model's, the rule rows too
    every_row = ["reward.model_scores_every_row=true", f"reward.model_path={tmp_path}"]
    assert main([str(tiny_qwen2_dir), *every_row, "--data", str(val_file)]) == 2
    line = error_line(capsys)
    assert "val.parquet: 4 rows have reward_model.style=model (the first is row 0)" in line


def test_unreachable_server(tiny_qwen2_dir, tmp_path, val_file, capsys):
    url = f"http://127.0.0.1:{free_port()}"
    args = [
        str(tiny_qwen2_dir),
        "actor_rollout_ref.rollout.request_retries=0",
        "--data",
        str(val_file),
        "--server-url",
        url,
        "--output",
        str(tmp_path / "out.json"),
    ]
    assert main(args) == 1
    assert url in error_line(capsys)
    assert not (tmp_path / "out.json").exists()


def test_multi_turn_evaluation_lists_the_runs_tools_in_every_prompt(tiny_qwen2_dir, tmp_path):
    """With `rollout.multi_turn` on, rlhf-eval's prompts are the training prompts: rendered
    by the chat template with the tool config's schemas (transformers' rendering, here)."""
    from transformers import AutoTokenizer

    from rlhf.config import load_config
    from rlhf.quickstart.calculator_task import CALCULATOR_SCHEMA, write_tool_config
    from rlhf.rollout.evaluation import eval_prompts
    from rlhf.rollout.multi_turn_config import load_configured_tools

    rows = make_problems(3, seed=0)
    data = write_rows(rows, tmp_path / "val.parquet")
    tool_config = write_tool_config(tmp_path)
    mt = "actor_rollout_ref.rollout.multi_turn"
    cfg = load_config(
        None,
        [f"{mt}.enable=true", f"{mt}.tool_config_path={tool_config}", "data.max_prompt_length=512"],
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_dir)
    tools = load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    prompts = eval_prompts(cfg.data, cfg.reward, [str(data)], tokenizer, tools).prompts
    for row, prompt in zip(rows, prompts, strict=True):
        text = tokenizer.apply_chat_template(
            row["prompt"], tools=[CALCULATOR_SCHEMA], add_generation_prompt=True, tokenize=False
        )
        assert prompt.input_ids == tokenizer.encode(text, add_special_tokens=False)
        assert "calculator" in text

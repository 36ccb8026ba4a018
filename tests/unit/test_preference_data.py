"""Preference pairs (`rlhf.data.preference`) and the Bradley-Terry loss
(`rlhf.algo.preference`), against hand computations and hand-written rows."""

from __future__ import annotations

import math

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rlhf.algo.preference import bradley_terry_loss
from rlhf.data.parquet import DataError
from rlhf.data.preference import PreferencePair, pair_texts, read_preference_pairs

Q = [{"role": "user", "content": "2+2?"}]


def write(tmp_path, name: str, rows: list[dict]) -> str:
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_loss_and_metrics_by_hand():
    chosen, rejected = torch.tensor([2.0, 0.5, 1.0]), torch.tensor([1.0, 1.5, 1.0])
    loss, metrics = bradley_terry_loss(chosen, rejected)
    expected = [-math.log(1 / (1 + math.exp(-g))) for g in (1.0, -1.0, 0.0)]
    assert float(loss) == pytest.approx(sum(expected) / 3)
    assert metrics["rm/accuracy"] == pytest.approx(1 / 3)  # the tie counts as wrong
    assert metrics["rm/gap_mean"] == pytest.approx(0.0)
    with_margin, _ = bradley_terry_loss(chosen, rejected, torch.tensor([1.0, 0.0, 0.0]))
    expected[0] = math.log(2)  # gap 1 - margin 1 = 0
    assert float(with_margin) == pytest.approx(sum(expected) / 3)


def test_loss_gradient_pushes_chosen_up_and_rejected_down():
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    loss, _ = bradley_terry_loss(chosen, rejected)
    loss.backward()
    assert chosen.grad is not None and rejected.grad is not None
    assert float(chosen.grad) == pytest.approx(-0.5) and float(rejected.grad) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="two \\[P\\] score vectors"):
        bradley_terry_loss(torch.zeros(2), torch.zeros(3))


def test_a_micro_batch_divides_by_the_batch_pair_count():
    """Two micro-batches of one batch of 3 pairs add up to the batch's loss and metrics."""
    chosen, rejected = torch.tensor([2.0, 0.5, 1.0]), torch.tensor([1.0, 1.5, 0.0])
    margin = torch.tensor([0.5, 0.0, 2.0])
    whole, whole_metrics = bradley_terry_loss(chosen, rejected, margin)
    first, first_metrics = bradley_terry_loss(chosen[:1], rejected[:1], margin[:1], num_pairs=3)
    rest, rest_metrics = bradley_terry_loss(chosen[1:], rejected[1:], margin[1:], num_pairs=3)
    assert float(first + rest) == pytest.approx(float(whole))
    for key, value in whole_metrics.items():
        assert float(first_metrics[key] + rest_metrics[key]) == pytest.approx(float(value))
    expected = [math.log1p(math.exp(-g)) for g in (0.5, -1.0, -1.0)]
    assert float(whole) == pytest.approx(sum(expected) / 3)


def test_both_layouts_read(tmp_path):
    explicit = write(
        tmp_path,
        "trl.parquet",
        [
            {"prompt": "2+2?", "chosen": "4", "rejected": "5", "margin": 1.5},
            {"prompt": "3+3?", "chosen": "6", "rejected": "7", "margin": None},
        ],
    )
    implicit = write(
        tmp_path,
        "hh.parquet",
        [
            {
                "chosen": [*Q, {"role": "assistant", "content": "4"}],
                "rejected": [*Q, {"role": "assistant", "content": "5"}],
            }
        ],
    )
    pairs = read_preference_pairs([explicit, implicit])
    assert pairs[0] == PreferencePair("2+2?", "4", "5", 1.5, explicit, 0)
    assert pairs[1].margin == 0.0 and pairs[1].prompt == "3+3?"
    assert pairs[2].prompt is None and pairs[2].chosen[-1]["content"] == "4"


@pytest.mark.parametrize(
    ("row", "column", "message"),
    [
        ({"prompt": "q", "chosen": None, "rejected": "b"}, "chosen", "is null"),
        ({"prompt": "q", "chosen": "a", "rejected": "  "}, "rejected", "is empty"),
        ({"prompt": "q", "chosen": "a", "rejected": "a"}, "rejected", "equals chosen"),
        ({"prompt": "q", "chosen": "a", "rejected": "b", "margin": -1.0}, "margin", ">= 0"),
        (
            {"prompt": [{"role": "robot", "content": "q"}], "chosen": "a", "rejected": "b"},
            "prompt",
            "role 'robot'",
        ),
        (  # a vision preference pair (TRL's layout): this trainer is text-only
            {"prompt": "q", "chosen": "a", "rejected": "b", "images": [{"bytes": b"\x89PNG"}]},
            "images",
            "carries 1 image; preference pairs are text-only",
        ),
    ],
)
def test_a_bad_pair_is_named_by_file_row_and_column(tmp_path, row, column, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    if "margin" in row:
        good["margin"] = 0.0
    if "images" in row:  # the column, null in the good row
        good["images"] = None
    if isinstance(row["prompt"], list):
        good["prompt"] = [{"role": "user", "content": "q"}]
    path = write(tmp_path, "pairs.parquet", [good, row])
    with pytest.raises(DataError) as e:
        read_preference_pairs([path])
    assert f"{path}: row 1, column '{column}': " in str(e.value) and message in str(e.value)
    assert len(e.value.problems) == 1


def reply(content: str, role: str = "assistant") -> list[dict[str, str]]:
    return [{"role": role, "content": content}]


@pytest.mark.parametrize(
    ("chosen", "rejected", "column", "message"),
    [
        (reply("4", "user"), reply("5"), "chosen", "ends with a 'user' message, not the"),
        (reply("4"), [*reply("5"), *reply("ok?", "user")], "rejected", "ends with a 'user'"),
        (reply("4"), reply("   "), "rejected", "ends with an empty assistant reply"),
        ([*Q, *reply("")], [*Q, *reply("5")], "chosen", "ends with an empty assistant reply"),
    ],
)
def test_a_side_that_is_not_an_assistant_reply_is_refused(
    tmp_path, chosen, rejected, column, message
):
    """Message sides must end with a non-empty assistant reply (the reward model scores a
    side at its reply's last token); the error names preference data, file, row, column."""
    good = {"chosen": [*Q, *reply("4")], "rejected": [*Q, *reply("5")]}
    path = write(tmp_path, "pairs.parquet", [good, {"chosen": chosen, "rejected": rejected}])
    with pytest.raises(DataError) as e:
        read_preference_pairs([path])
    text = str(e.value)
    assert text.startswith("invalid preference data:") and "prompt data" not in text
    assert f"{path}: row 1, column '{column}': {message}" in text
    assert len(e.value.problems) == 1


def test_a_file_without_the_response_columns_is_named(tmp_path):
    path = write(tmp_path, "pairs.parquet", [{"prompt": "q", "answer": "a"}])
    with pytest.raises(DataError, match=r"missing columns \['chosen', 'rejected'\]"):
        read_preference_pairs([path])


class Tokenizer:
    """A stand-in with a chat template that writes `<role>content</role>` per message."""

    eos_token = "</s>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        assert tokenize is False
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def test_pair_texts_follow_the_layout():
    tok = Tokenizer()
    explicit = PreferencePair(Q, "4", [{"role": "assistant", "content": "5"}])
    # as the policy's sample is scored: generation prompt, reply, EOS (not the template's
    # closing tag and newline)
    assert pair_texts(explicit, tok, True) == (
        "<user>2+2?</user>\n<assistant>4</s>",
        "<user>2+2?</user>\n<assistant>5</s>",
    )
    assert pair_texts(explicit, tok, False) == ("2+2?4</s>", "2+2?5</s>")
    hh_text = PreferencePair(None, "Human: hi Assistant: yo", "Human: hi Assistant: no")
    assert pair_texts(hh_text, tok, True) == (
        "Human: hi Assistant: yo</s>",
        "Human: hi Assistant: no</s>",
    )

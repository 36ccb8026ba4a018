"""How often a tools model calls the calculator and how often it is right, without SGLang.

The multi-turn rollout (`rlhf.rollout.multi_turn.MultiTurnRollout.converse`) runs as in
training, its `generate` backed by transformers: each turn is sampled token by token from the
model's distribution at the given temperature (no top-k or top-p), with its KV cache, until
the end-of-turn token or the token budget. The conversations are scored with the rule reward
of each row's data source on the whole response text (tool messages included, as the rule
reads only the last `#### N`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlhf.quickstart.calculator_task import CALCULATOR_SCHEMA, TOOL_NAME
from rlhf.quickstart.tool_warm_start import tools_prompt_ids
from rlhf.reward import compute_score
from rlhf.rollout.client import Generation
from rlhf.rollout.multi_turn import Conversation, Generate, MultiTurnRollout, MultiTurnSettings
from rlhf.tools.calculator import Calculator

EVAL_SETTINGS = MultiTurnSettings(max_response_length=64, max_assistant_turns=3)


@dataclass(frozen=True)
class ToolUseStats:
    """Rewards of sampled conversations, split by whether the policy called a tool."""

    call_rate: float  # fraction of conversations with at least one tool call
    accuracy_with_call: float | None  # mean reward of those (None: there were none)
    accuracy_without_call: float | None  # mean reward of the others (None: none)
    mean_reward: float
    num_conversations: int


@torch.no_grad()
def sample_turn(
    model: PreTrainedModel,
    input_ids: list[int],
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int,
    generator: torch.Generator,
) -> Generation:
    """One turn sampled from `model` after `input_ids`, ending at `eos_token_id` (finish
    reason "stop") or after `max_new_tokens` ("length"); log-probs are the sampling
    distribution's."""
    out = model(input_ids=torch.tensor([input_ids]), use_cache=True)
    output_ids: list[int] = []
    logprobs: list[float] = []
    for _ in range(max_new_tokens):
        logp_v = torch.log_softmax(out.logits[0, -1].float() / temperature, dim=-1)
        token = int(torch.multinomial(logp_v.exp(), 1, generator=generator))
        output_ids.append(token)
        logprobs.append(float(logp_v[token]))
        if token == eos_token_id:
            return Generation(output_ids, logprobs, "stop")
        out = model(
            input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True
        )
    return Generation(output_ids, logprobs, "length")


def transformers_generate(
    model: PreTrainedModel, eos_token_id: int, generator: torch.Generator
) -> Generate:
    """A `generate` callback for `MultiTurnRollout.converse` that samples with `model`
    (`temperature` from the sampling parameters, default 1)."""

    async def generate(input_ids: list[int], params: dict[str, Any]) -> Generation:
        temperature = float(params.get("temperature", 1.0))
        return sample_turn(
            model, input_ids, params["max_new_tokens"], temperature, eos_token_id, generator
        )

    return generate


def conversation_reward(tokenizer: PreTrainedTokenizerBase, conv: Conversation, row: dict) -> float:
    """The rule reward of the row's data source on the conversation's response text."""
    text = cast(str, tokenizer.decode(conv.response_ids, skip_special_tokens=True))
    truth = row["reward_model"]["ground_truth"]
    return compute_score(row["data_source"], text, truth, row.get("extra_info"))


def measure_tool_use(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    rows: list[dict],
    num_samples: int = 4,
    temperature: float = 1.0,
    seed: int = 0,
    settings: MultiTurnSettings = EVAL_SETTINGS,
) -> ToolUseStats:
    """Sample `num_samples` conversations per row with the calculator and score them."""
    rollout = MultiTurnRollout({TOOL_NAME: Calculator(CALCULATOR_SCHEMA, {})}, tokenizer, settings)
    generate = transformers_generate(
        model, tokenizer.eos_token_id, torch.Generator().manual_seed(seed)
    )
    sampling = {"temperature": temperature}
    called, rewards = [], []
    model.eval()
    for row in rows:
        prompt = tools_prompt_ids(tokenizer, row["prompt"])
        for _ in range(num_samples):
            conv = asyncio.run(rollout.converse(generate, prompt, sampling, {}))
            called.append(bool(conv.tool_calls))
            rewards.append(conversation_reward(tokenizer, conv, row))
    return tool_use_stats(called, rewards)


def tool_use_stats(called: list[bool], rewards: list[float]) -> ToolUseStats:
    """The statistics of conversations that did (`called`) or did not call a tool."""
    with_call = [r for c, r in zip(called, rewards) if c]
    without = [r for c, r in zip(called, rewards) if not c]
    return ToolUseStats(
        call_rate=len(with_call) / len(rewards),
        accuracy_with_call=sum(with_call) / len(with_call) if with_call else None,
        accuracy_without_call=sum(without) / len(without) if without else None,
        mean_reward=sum(rewards) / len(rewards),
        num_conversations=len(rewards),
    )

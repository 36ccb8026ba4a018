"""Evaluation of a policy on SGLang: Parquet prompts -> N responses each -> scores -> metrics.

What `rlhf-eval` runs (`rlhf.cli.eval`), and the metrics are those of validation during
training (`rlhf.reward.validation`): mean@N, best@N and maj@N per data source. The prompts,
their length policy and the rewards follow the config's `data.*` and `reward.*` keys, the
sampling its `actor_rollout_ref.rollout.val_kwargs`, the servers its `rollout` section (a
server is started on the model, or `rollout.server_urls` are used as they are).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from rlhf.config.schema import DataConfig, RewardConfig, RLHFConfig
from rlhf.data.parquet import read_prompt_rows
from rlhf.data.prompts import PromptDataset, PromptError, build_prompt_dataset, load_tokenizer
from rlhf.reward import ground_truth_checker
from rlhf.reward.scorer import RewardScorer
from rlhf.reward.validation import val_samples, validation_metrics
from rlhf.rollout.batch import RolloutRecord
from rlhf.rollout.engine import SGLangEngine
from rlhf.rollout.multi_turn import ToolStats
from rlhf.rollout.multi_turn_config import load_configured_tools, multi_turn_rollout, tool_schemas
from rlhf.rollout.policy_servers import generate_and_score, kv_cache_tokens, val_sampling_params
from rlhf.tools.base import Tool


@dataclass(frozen=True)
class EvalResult:
    """Metrics (flat, validation's names), the prompts per data source, and every sample."""

    metrics: dict[str, float]
    prompts_per_source: dict[str, int]
    records: list[RolloutRecord]


def eval_prompts(
    data: DataConfig,
    reward: RewardConfig,
    data_files: list[str],
    tokenizer,
    tools: dict[str, Tool],
    unscored_model_rows: bool = False,
) -> PromptDataset:
    """The prompts of `data_files` under the config's `data.*` length policy; rows whose
    reward is a model need `reward.url` (no reward model runs here) unless
    `unscored_model_rows` (their samples are then left unscored)."""
    rows = read_prompt_rows(
        data_files,
        prompt_key=data.prompt_key,
        bad_rows=data.bad_rows,
        key="--data",
        check_ground_truth=ground_truth_checker(reward),
    )
    if reward.model_scores_every_row:
        rows = [r.scored_by_model() for r in rows]
    model_rows = [r for r in rows if r.style == "model"]
    if model_rows and not reward.url and not unscored_model_rows:
        first = model_rows[0]
        raise PromptError(
            f"{first.file}: {len(model_rows)} rows have reward_model.style=model (the first is "
            f"row {first.row}); rlhf-eval scores them only through a reward endpoint: set "
            "reward.url=http://HOST:PORT/score"
        )
    return build_prompt_dataset(
        rows,
        tokenizer,
        max_prompt_length=data.max_prompt_length,
        apply_chat_template=data.apply_chat_template,
        filter_overlong_prompts=data.filter_overlong_prompts,
        truncation=data.truncation,
        prompt_key=data.prompt_key,
        tools=tool_schemas(tools),
    )


def evaluate(
    cfg: RLHFConfig,
    model_path: Path,
    data_files: list[str],
    *,
    device: str,
    log_dir: Path,
    batch_size: int,
    show_progress: bool = True,
) -> EvalResult:
    """Generate `val_kwargs.n` responses per prompt of `data_files` with the HF model at
    `model_path` (its tokenizer encodes the prompts), `batch_size` prompts at a time, and
    score them (a progress bar on stderr once the server is up)."""
    tokenizer = load_tokenizer(model_path)
    tools = load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    prompts = eval_prompts(cfg.data, cfg.reward, data_files, tokenizer, tools).prompts
    params = val_sampling_params(cfg.actor_rollout_ref.rollout, cfg.data.max_response_length)
    scorer = RewardScorer.from_config(cfg.reward)
    multi_turn = multi_turn_rollout(
        cfg.actor_rollout_ref.rollout.multi_turn, cfg.data.max_response_length, tokenizer, tools
    )  # conversations with the tools
    cpu_tokens = (
        kv_cache_tokens(cfg.data, cfg.actor_rollout_ref.rollout, batch_size)
        if device == "cpu"
        else None
    )
    engine = None
    try:
        engine = SGLangEngine(
            cfg.actor_rollout_ref.rollout,
            model_path,
            log_dir=log_dir,
            device=device,
            seed=cfg.data.seed,
            max_total_tokens=cpu_tokens,
        )
        records: list[RolloutRecord] = []
        sources: list[str] = []
        tool_stats = ToolStats()
        bar = tqdm(total=len(prompts), desc="rlhf-eval", unit="prompt", disable=not show_progress)
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            indices = list(range(start, start + len(chunk)))
            uids = [f"eval-{i}" for i in indices]
            result = generate_and_score(
                engine, tokenizer, scorer, chunk, uids, indices, params, None, multi_turn
            )
            records += result.records
            tool_stats = tool_stats + (result.tool_stats or ToolStats())
            sources += result.batch.data_sources
            bar.update(len(chunk))
        bar.close()
    finally:
        scorer.close()
        if engine is not None:
            engine.shutdown()
    samples = val_samples(
        sources,
        [r.uid for r in records],
        [r.score for r in records],
        [r.response_text for r in records],
        cfg.reward,
    )
    counts = dict(Counter(p.row.data_source for p in prompts))
    metrics = validation_metrics(samples)
    if multi_turn is not None:
        metrics |= {f"val/{k}": v for k, v in tool_stats.metrics().items()}
    return EvalResult(metrics, counts, records)

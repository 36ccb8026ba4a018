"""The rollout stage of a PPO step: prompts -> SGLang server(s) -> responses with log-probs.

Until the PPO update lands, `rlhf-train` runs this stage once: it is the first real piece
of the loop (config -> distributed bootstrap -> tokenised prompts -> generation on a
launched SGLang server -> records in the run directory).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from transformers import AutoTokenizer

from rlhf.config.schema import RLHFConfig
from rlhf.data.arithmetic import make_problems
from rlhf.distributed.bootstrap import free_port
from rlhf.rollout.client import Generation, generate
from rlhf.rollout.sglang_server import SGLangServer, build_server_args

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RolloutRecord:
    """One sample: prompt index, prompt and response token ids, response log-probs."""

    prompt_index: int
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: str
    response_text: str


def sampling_params(cfg: RLHFConfig) -> dict:
    """SGLang sampling parameters from `actor_rollout_ref.rollout` and `data`."""
    rollout = cfg.actor_rollout_ref.rollout
    return {
        "n": rollout.n,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "top_k": rollout.top_k,
        "max_new_tokens": cfg.data.max_response_length,
    }


def kv_cache_tokens(cfg: RLHFConfig) -> int:
    """Tokens of KV cache one step's batch needs (CPU servers are sized to this)."""
    per_sample = cfg.data.max_prompt_length + cfg.data.max_response_length
    return max(2048, cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n * per_sample)


def tokenize_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    return [
        tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for row in rows
    ]


def rollout_once(cfg: RLHFConfig, run_dir: Path, device: str) -> list[RolloutRecord]:
    """Launch a server for the policy, generate one step's batch, stop the server."""
    model_path = cfg.actor_rollout_ref.model.path
    if not Path(model_path, "config.json").is_file():
        raise FileNotFoundError(
            f"actor_rollout_ref.model.path={model_path}: no config.json there (an HF model "
            "directory is expected; 'make quickstart' builds a tiny one)"
        )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = tokenize_prompts(tokenizer, make_problems(cfg.data.train_batch_size, cfg.data.seed))
    launch = build_server_args(
        cfg.actor_rollout_ref.rollout,
        model_path,
        port=free_port(),
        device=device,
        max_total_tokens=kv_cache_tokens(cfg) if device == "cpu" else None,
        seed=cfg.data.seed,
    )
    with SGLangServer(launch, run_dir / "logs" / "sglang_server_0.log").start() as server:
        server.wait_healthy(cfg.actor_rollout_ref.rollout.server_startup_timeout_s)
        start = time.perf_counter()
        generations = generate(server.url, prompts, sampling_params(cfg))
        elapsed = time.perf_counter() - start
    n = cfg.actor_rollout_ref.rollout.n
    records = [_record(i // n, prompts[i // n], g, tokenizer) for i, g in enumerate(generations)]
    num_tokens = sum(len(r.response_ids) for r in records)
    log.info(
        "rollout: %d samples, %d response tokens in %.2f s (%.1f tokens/s)",
        len(records),
        num_tokens,
        elapsed,
        num_tokens / elapsed,
    )
    return records


def _record(index: int, prompt: list[int], gen: Generation, tokenizer) -> RolloutRecord:
    return RolloutRecord(
        prompt_index=index,
        prompt_ids=prompt,
        response_ids=gen.output_ids,
        response_logprobs=gen.logprobs,
        finish_reason=gen.finish_reason,
        response_text=tokenizer.decode(gen.output_ids, skip_special_tokens=True),
    )


def write_records(records: list[RolloutRecord], path: Path) -> None:
    path.write_text("".join(json.dumps(asdict(r)) + "\n" for r in records))

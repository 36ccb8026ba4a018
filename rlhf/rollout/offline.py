"""Stored rollouts from any policy without training: what `rlhf-rollout` runs.

Prompts (Parquet, the `data.*` length policy) go to SGLang `batch_size` at a time, each with
the training sampling (`actor_rollout_ref.rollout`: n, temperature, top-p, top-k;
`data.max_response_length`); every batch's samples are scored (rule rows; model rows through
`reward.url`, else left unscored for the training run's reward model) and written as one
stored-rollout file, `part_NNNNN.parquet` (`rlhf.data.rollout_files`, atomically), that
`data.rollout_files` trains from. The output directory's `rollout.json` records what the
files were generated with; a run started again on the same directory skips the batches
whose files exist (resumable), and one with other settings (or other prompt contents) is
refused naming them. Group uids are `rollout-<digest>-<prompt index>`, the digest of
`rollout.json` (model, settings, seed, the prompts' contents): outputs of different prompt
files never share a uid, and a resumed run names its groups as the first run did.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from rlhf.config.schema import RLHFConfig
from rlhf.data.prompts import EncodedPrompt, load_tokenizer
from rlhf.data.rollout_files import write_rollout_file
from rlhf.errors import UserError
from rlhf.reward.scorer import RewardScorer
from rlhf.rollout.engine import SGLangEngine
from rlhf.rollout.evaluation import eval_prompts
from rlhf.rollout.multi_turn_config import load_configured_tools, multi_turn_rollout
from rlhf.rollout.policy_servers import generate_and_score, kv_cache_tokens, sampling_params

MANIFEST = "rollout.json"
POLICY_VERSION = 0  # the given weights: version 0, as a training run's initial policy


class RolloutDirError(ValueError, UserError):
    """An output directory holding rollouts generated with other settings."""


@dataclass(frozen=True)
class RolloutPlan:
    """What a directory of stored rollouts was generated with (`rollout.json`)."""

    model: str
    data_files: list[str]
    prompts: int
    batch_size: int
    n: int
    temperature: float
    top_p: float
    top_k: int
    max_prompt_length: int
    max_response_length: int
    seed: int | None = None
    prompts_digest: str = ""  # of the prompts' tokens and reward rows (`prompts_digest`)

    def part(self, out_dir: Path, batch: int) -> Path:
        return out_dir / f"part_{batch:05d}.parquet"

    @property
    def batches(self) -> int:
        return -(-self.prompts // self.batch_size)

    def uid(self, index: int) -> str:
        """The uid of prompt `index`'s group: the prompt's position and a digest of this
        plan, prompts included, so that the outputs of two prompt sets (or models, or
        settings) never share a uid, and a resumed run names its groups as the first did."""
        text = json.dumps(asdict(self), sort_keys=True)
        return f"rollout-{hashlib.sha256(text.encode()).hexdigest()[:16]}-{index}"

    def indices(self, batch: int) -> list[int]:
        """The prompts of batch `batch`."""
        return list(
            range(batch * self.batch_size, min((batch + 1) * self.batch_size, self.prompts))
        )


def prompts_digest(prompts: list[EncodedPrompt]) -> str:
    """A digest of the prompts as generated from: their token ids and what scores them."""
    digest = hashlib.sha256()
    for prompt in prompts:
        row = prompt.row
        fields = [prompt.input_ids, row.data_source, row.reward_model, row.extra_info]
        digest.update(json.dumps(fields, sort_keys=True, default=str).encode() + b"\n")
    return digest.hexdigest()


def check_manifest(plan: RolloutPlan, out_dir: Path) -> None:
    """Write `rollout.json`, or check that the one there describes the same generation."""
    path = out_dir / MANIFEST
    wanted = asdict(plan)
    if path.is_file():
        found = json.loads(path.read_text())
        changed = [
            f"{key}: {found.get(key)!r} -> {value!r}"
            for key, value in wanted.items()
            if found.get(key) != value
        ]
        if changed:
            raise RolloutDirError(
                f"{out_dir} holds rollouts generated with other settings ({'; '.join(changed)}); "
                "use another output directory, or the same settings to resume"
            )
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(wanted, indent=2) + "\n")


def write_rollouts(
    cfg: RLHFConfig,
    model_path: Path,
    model_name: str,
    data_files: list[str],
    out_dir: Path,
    *,
    device: str,
    batch_size: int,
    show_progress: bool = True,
) -> RolloutPlan:
    """Generate, score and store every batch of prompts not stored yet in `out_dir`."""
    tokenizer = load_tokenizer(model_path)
    tools = load_configured_tools(cfg.actor_rollout_ref.rollout.multi_turn)
    prompts = eval_prompts(
        cfg.data, cfg.reward, data_files, tokenizer, tools, unscored_model_rows=True
    ).prompts
    params = sampling_params(cfg.actor_rollout_ref, cfg.data.max_response_length)
    plan = RolloutPlan(
        model_name,
        data_files,
        len(prompts),
        batch_size,
        params.n,
        params.temperature,
        params.top_p,
        params.top_k,
        cfg.data.max_prompt_length,
        cfg.data.max_response_length,
        params.seed,
        prompts_digest(prompts),
    )
    check_manifest(plan, out_dir)
    todo = [b for b in range(plan.batches) if not plan.part(out_dir, b).is_file()]
    bar = tqdm(total=len(prompts), desc="rlhf-rollout", unit="prompt", disable=not show_progress)
    bar.update(len(prompts) - sum(len(plan.indices(b)) for b in todo))  # stored before
    if not todo:
        bar.close()
        return plan
    scorer = RewardScorer.from_config(cfg.reward)
    engine = None
    try:
        engine = SGLangEngine(
            cfg.actor_rollout_ref.rollout,
            model_path,
            log_dir=out_dir / "logs",
            device=device,
            seed=cfg.data.seed,
            max_total_tokens=kv_cache_tokens(cfg.data, cfg.actor_rollout_ref.rollout, batch_size)
            if device == "cpu"
            else None,
        )
        multi_turn = multi_turn_rollout(
            cfg.actor_rollout_ref.rollout.multi_turn, cfg.data.max_response_length, tokenizer, tools
        )
        for b in todo:
            indices = plan.indices(b)
            chunk = [prompts[i] for i in indices]
            uids = [plan.uid(i) for i in indices]
            result = generate_and_score(
                engine, tokenizer, scorer, chunk, uids, indices, params, POLICY_VERSION, multi_turn
            )
            write_rollout_file([r.stored() for r in result.records], plan.part(out_dir, b))
            bar.update(len(chunk))
    finally:
        bar.close()
        scorer.close()
        if engine is not None:
            engine.shutdown()
    return plan

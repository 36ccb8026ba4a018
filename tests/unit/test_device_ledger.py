"""What each phase of a step holds on the device (rlhf.memory.ledger), asserted on the CPU.

The models are built as the trainer builds them, with every `*_offload` key on (the GPU
configs' setting; on the CPU the same moves run, host to host), and a synthetic batch goes
through `learn_from_batch` as in a step. Each stage is a phase of the device ledger; the
assertions are the residency rules of a GPU step: a forward-only pass (old log-probs,
reference, values) holds one model's parameters and nothing else; an update holds its own
model's state and no other model's; a mixture-of-experts model's expert buffers leave the
device with the rest (they did not: Megatron keeps them in buffers of their own).
"""

from __future__ import annotations

import pytest
import torch

from rlhf.memory import ledger as device
from tests.distributed.workers.trainer_step import COMMON, synthetic_batch
from tests.helpers import SEED_DEFAULTS

OFFLOAD = [
    f"{role}.megatron.{kind}_offload=true"
    for role in ("actor_rollout_ref.actor", "critic")
    for kind in ("param", "grad", "optimizer")
] + ["actor_rollout_ref.ref.param_offload=true"]
STATE = ("params", "grads", "optimizer")


@pytest.fixture(scope="module")
def ctx(cpu_rank):
    return cpu_rank


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from rlhf.quickstart.tiny_model import TinyModelSpec, save_tiny_model

    spec = TinyModelSpec.for_family("qwen3_moe")
    return save_tiny_model(tmp_path_factory.mktemp("tiny_moe"), spec)


def one_step(ctx, model_dir, *overrides: str, offload: bool = True):
    """Build the models (a "build" phase) and run one batch through the step's stages
    (`offload`: every model state offloaded between its phases); returns the models and
    the ledger."""
    from rlhf.algo import build_kl_controller
    from rlhf.config import load_config, validate_config
    from rlhf.engine.build import build_engine
    from rlhf.logging import Timer
    from rlhf.trainer.preflight import load_policy_arch
    from rlhf.trainer.step import Learning, learn_from_batch

    model = f"actor_rollout_ref.model.path={model_dir}"
    args = [*SEED_DEFAULTS, model, *COMMON, *(OFFLOAD if offload else ()), *overrides]
    cfg = load_config(None, args)
    arch = load_policy_arch(cfg)
    validate_config(cfg, ctx.world_size, arch)
    book = device.reset()
    with book.phase("build"):
        models = build_engine(cfg, arch, ctx, total_steps=1)
    kl_ctrl = build_kl_controller(cfg.algorithm.kl_ctrl)
    learn_from_batch(
        models,
        synthetic_batch(arch.vocab_size),
        Learning.of(cfg.algorithm, cfg.actor_rollout_ref.actor, cfg.trainer),
        kl_ctrl,
        Timer(),
    )
    return models, book


def holds(record, owner: str) -> set[str]:
    return {kind for o, kind in record.held if o == owner}


def test_each_phase_of_a_ppo_step_holds_what_it_needs_and_nothing_else(ctx, tiny_qwen2_dir):
    models, book = one_step(ctx, tiny_qwen2_dir, "algorithm.adv_estimator=gae")
    # and in its mode: the step ended with the actor's update; the reference only ran
    assert all(m.training for m in models.actor.module.modules())
    assert not any(m.training for m in models.ref.module.modules())
    models.logprobs(synthetic_batch(64), "actor")
    assert not any(m.training for m in models.actor.module.modules())
    (old,) = book.records("old_log_prob")
    assert {o for o, _ in old.held} == {"actor"} and holds(old, "actor") == {"params"}
    (ref,) = book.records("ref")
    assert {o for o, _ in ref.held} == {"ref"}
    (values,) = book.records("values")
    assert {o for o, _ in values.held} == {"critic"} and holds(values, "critic") == {"params"}
    (critic,) = book.records("update_critic")
    assert {o for o, _ in critic.held} == {"critic"} and holds(critic, "critic") == set(STATE)
    (actor,) = book.records("update_actor")
    assert {o for o, _ in actor.held} == {"actor"} and holds(actor, "actor") == set(STATE)
    assert book.resident == {}  # between phases nothing of the trainer stays
    # the build held one model at a time: each was off before the next one came
    (build,) = book.records("build")
    assert {o for o, _ in build.held} == {"actor", "critic", "ref"}
    assert max_models_at_once(book.events) == 1


@pytest.mark.parametrize("offload", [True, False])
def test_the_allocator_cache_is_emptied_only_when_a_state_left_the_device(
    ctx, tiny_qwen2_dir, monkeypatch, offload
):
    """Emptying the CUDA allocator's cache hands its free blocks back to the driver; after
    a pass that offloaded nothing, the next pass would only allocate them again."""
    from rlhf.engine import offload as offloading

    emptied = []
    monkeypatch.setattr(offloading, "empty_device_cache", lambda: emptied.append(1))
    _, book = one_step(ctx, tiny_qwen2_dir, "algorithm.adv_estimator=gae", offload=offload)
    left = sum(event.action == "off" for event in book.events)
    assert (left > 0) is offload
    assert 0 < len(emptied) <= left if offload else emptied == []


def test_the_ledger_counts_adams_state_once_the_first_step_made_it(ctx, tiny_qwen2_dir):
    """Without offloading, the actor's state stays resident; its optimizer state appears at
    the first optimizer step, and the ledger (whose sizes are kept once non-zero) says how
    large it is against the tensors themselves."""
    from rlhf.engine.offload import StorageOffloader, model_tensors

    models, book = one_step(ctx, tiny_qwen2_dir, offload=False)
    adam = StorageOffloader.of(model_tensors(models.actor, "optimizer")).nbytes
    assert adam > 0 and book.resident[("actor", "optimizer")] == adam


def max_models_at_once(events) -> int:
    """The most owners resident at the same moment, replaying the ledger's moves."""
    resident: set[tuple[str, str]] = set()
    most = 0
    for event in events:
        if event.action == "on":
            resident.add((event.owner, event.kind))
        elif event.action == "off":
            resident.discard((event.owner, event.kind))
        most = max(most, len({owner for owner, _ in resident}))
    return most


def test_a_grpo_step_has_no_critic_phase(ctx, tiny_qwen2_dir):
    _, book = one_step(ctx, tiny_qwen2_dir, "algorithm.adv_estimator=grpo")
    assert book.records("values") == [] and book.records("update_critic") == []
    (old,) = book.records("old_log_prob")
    assert old.held == {("actor", "params")}
    (actor,) = book.records("update_actor")
    assert {o for o, _ in actor.held} == {"actor"}


def test_a_moe_models_experts_leave_the_device_with_the_rest(ctx, tiny_moe_dir):
    """Every storage of the actor (expert weights, their gradient buffers, Adam's state of
    both) is empty between phases: the ledger's word is checked against the tensors."""
    models, book = one_step(ctx, tiny_moe_dir, "algorithm.adv_estimator=grpo")
    actor = models.actor
    params = list(actor.module.parameters())
    assert any("experts" in name for name, _ in actor.module.named_parameters())
    assert all(p.untyped_storage().nbytes() == 0 for p in params)
    assert all(p.main_grad.untyped_storage().nbytes() == 0 for p in params)
    optimizer = (
        actor.optimizer.chained_optimizers
        if hasattr(actor.optimizer, "chained_optimizers")
        else [actor.optimizer]
    )
    state = [
        v
        for part in optimizer
        for s in part.optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v) and v.numel() > 1
    ]
    assert state and all(v.untyped_storage().nbytes() == 0 for v in state)
    (update,) = book.records("update_actor")
    assert holds(update, "actor") == set(STATE) and not book.holds("actor")


def test_the_policy_is_loaded_without_a_random_initialisation_first(
    ctx, tiny_qwen2_dir, monkeypatch
):
    """Every parameter comes from the checkpoint, so Megatron's random init (minutes for a
    7B shard, one thread a rank under torchrun) is skipped; the loaded weights are the
    checkpoint's (transformers' own)."""
    from transformers import AutoModelForCausalLM

    from rlhf.engine.build import build_policy
    from rlhf.models.families import load_arch

    drawn = []
    for name in ("normal_", "uniform_", "kaiming_uniform_", "xavier_normal_"):
        original = getattr(torch.nn.init, name)
        monkeypatch.setattr(
            torch.nn.init, name, lambda *a, _o=original, **k: drawn.append(1) or _o(*a, **k)
        )
    arch = load_arch(tiny_qwen2_dir)
    (chunk,) = build_policy(arch, str(tiny_qwen2_dir), ctx, torch.float32)
    assert drawn == []
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir).model
    embedding = chunk.embedding.word_embeddings.weight
    assert torch.equal(embedding[: arch.vocab_size], hf.embed_tokens.weight)

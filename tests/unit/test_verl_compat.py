"""A verl user's command lines (rlhf.config.verl_keys, rlhf.config.loader): verl's own Megatron
example scripts (tests/unit/verl_examples, unchanged copies) fed through the loader, every
override accepted with its meaning or refused in one line naming it; Hydra's `+key=value`;
`${oc.env:VAR,default}`; verl's names of this system's keys; did-you-mean by key path."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from rlhf.config import load_config, validate_config
from rlhf.config.budgets import MicroBatching, token_budgets
from rlhf.config.loader import ConfigError, all_keys, nearest_key
from rlhf.config.validate import trained_megatron

EXAMPLES = Path(__file__).with_name("verl_examples")
SCRIPTS = sorted(p.name for p in EXAMPLES.glob("*.sh"))
VLLM = "actor_rollout_ref.rollout.name=vllm"
# what each script sets that this system refuses (everything else is accepted)
REFUSED = {
    "run_deepseek_full_hh_rlhf.sh": {
        VLLM,
        "reward_model.use_reward_loop=True",
        "reward_model.rollout.name=vllm",
        "reward_model.rollout.gpu_memory_utilization=0.8",
        "reward_model.rollout.tensor_model_parallel_size=4",
        "reward_model.rollout.prompt_length=256",
        "reward_model.rollout.response_length=128",
        "reward_model.num_workers=8",
    },
    "run_deepseek_math_gsm8k_megatron.sh": {VLLM},
    "run_qwen2-7b_math_gsm8k_megatron.sh": {VLLM},
    "run_qwen2-7b_math_megatron.sh": {VLLM},
    "run_qwen2-7b_seq_balance_math_megatron.sh": {VLLM},
    "run_qwen2-7b_sgl_megatron.sh": set(),
    "run_qwen2_5-7b_math_megatron_diff_tp.sh": {VLLM},
}
OURS = set(all_keys())


def script_overrides(name: str, home: Path) -> list[str]:
    """The `key=value` arguments the script passes to `python3` (bash runs it, with
    `python3` a function that prints them)."""
    shim = 'python3() { printf "%s\\0" "$@"; }; source "$0"'
    out = subprocess.run(
        ["bash", "-c", shim, str(EXAMPLES / name)],
        capture_output=True,
        check=True,
        env={"HOME": str(home), "PATH": "/usr/bin:/bin"},
    ).stdout.decode()
    return [a for a in out.split("\0") if "=" in a and not a.startswith("-")]


def refusals(overrides: list[str]) -> tuple[dict[str, str], list[str]]:
    """Load `overrides`, dropping each refused one: {override: message}, the accepted."""
    accepted, refused = list(overrides), {}
    while True:
        try:
            load_config(None, accepted)
            return refused, accepted
        except ConfigError as e:
            message = str(e)
            named = [o for o in accepted if message.startswith(o.split("=")[0].lstrip("+"))]
            assert named, f"a refusal that names none of the overrides: {message}"
            refused[named[0]] = message
            accepted.remove(named[0])


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_override_of_verls_example_is_accepted_or_refused_with_a_reason(name, tmp_path):
    overrides = script_overrides(name, tmp_path)
    assert len(overrides) > 30 and "algorithm.adv_estimator=" in " ".join(overrides)
    refused, accepted = refusals(overrides)
    assert set(refused) == REFUSED[name]
    for message in refused.values():
        assert "unknown config key" not in message and "did you mean" not in message
    cfg = load_config(None, accepted)
    for item in accepted:  # this system's own keys keep their values
        key, _, text = item.partition("=")
        if key in OURS:
            value = cfg
            for part in key.split("."):
                value = getattr(value, part)
            given = text if isinstance(value, str) else yaml.safe_load(text)
            assert value == given or float(value) == float(given), (key, value, given)
    if "reward_model.enable=True" in accepted:  # verl's reward model scores every sample
        path = next(o for o in accepted if o.startswith("reward_model.model.path="))
        assert cfg.reward.model_path == path.partition("=")[2]
        assert cfg.reward.model_scores_every_row


def test_verls_names_mean_the_same_here():
    cfg = load_config(
        None,
        [
            "actor_rollout_ref.actor.strategy=megatron",
            "critic.strategy=megatron",
            "+actor_rollout_ref.ref.megatron.param_offload=True",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.optim.clip_grad=0.5",
            "critic.optim.warmup_style=cosine",
            "actor_rollout_ref.model.enable_gradient_checkpointing=True",
            "custom_reward_function.path=/rewards/math.py",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.actor.use_dynamic_bsz=False",
            "actor_rollout_ref.model.use_remove_padding=False",
            "actor_rollout_ref.rollout.mode=async",
            # verl's global micro-batches over the data-parallel size: 8 / (2 TP) = 4 ranks
            "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size=16",
            "actor_rollout_ref.ref.log_prob_micro_batch_size=8",
            "critic.ppo_micro_batch_size=16",  # the critic's own layout: 8 ranks
            "critic.ulysses_sequence_parallel_size=2",  # ... over Ulysses 2: 4 ranks
        ],
    )
    assert not cfg.actor_rollout_ref.actor.use_dynamic_bsz
    assert not cfg.data.use_sequence_packing
    aro = cfg.actor_rollout_ref
    assert aro.ref.param_offload is True and aro.actor.grad_clip == 0.5
    assert cfg.critic.optim.lr_decay_style == "cosine"
    megatron = aro.actor.megatron
    assert (megatron.recompute_granularity, megatron.recompute_method) == ("full", "uniform")
    assert megatron.recompute_num_layers == 1 and cfg.critic.megatron.recompute_granularity is None
    assert cfg.reward.custom_fn == "/rewards/math.py:compute_score"
    assert aro.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert aro.actor.ppo_micro_batch_size_per_gpu == 4
    assert aro.ref.log_prob_micro_batch_size_per_gpu == 2
    assert cfg.critic.ppo_micro_batch_size_per_gpu == 4


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["actor_rollout_ref.actor.strategy=fsdp2"], "trains with Megatron-Core only"),
        ([VLLM], "generates with SGLang servers only: set rollout.name=sglang"),
        (["critic.megatron.context_parallel_size=2"], "set critic.ulysses_sequence_parallel_size"),
        (["actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2"], "sharded like the actor"),
        (["actor_rollout_ref.actor.use_torch_compile=True"], "torch.compile is not used"),
        (
            ["actor_rollout_ref.actor.ppo_micro_batch_size=6", "trainer.n_gpus_per_node=4"],
            "data-parallel size, 4 here (4 processes / TP x PP x Ulysses 1)",
        ),
        (["reward_model.enable=True"], "needs reward_model.model.path"),
        (["reward_model.model.path=/rm"], "reward_model.enable=false leaves unused"),
        (
            [
                "reward_model.enable=True",
                "reward_model.model.path=/rm",
                "reward.custom_fn=f.py:g",
                "actor_rollout_ref.model.path=/policy",
            ],
            "would score no row",
        ),
        (
            [
                "reward_model.enable=True",
                "reward_model.model.path=/rm",
                "reward_model.micro_batch_size_per_gpu=2",
            ],
            "the reference's micro-batches here (actor_rollout_ref.ref.log_prob_micro_batch",
        ),
        (["reward_model.enable=True", "reward_model.rollout.name=vllm"], "on the trainer ranks"),
        (
            [
                "actor_rollout_ref.ref.megatron.param_offload=true",
                "actor_rollout_ref.ref.param_offload=false",
            ],
            "are both set, to true and false: set one",
        ),
        (
            ["custom_reward_function.reward_kwargs=1"],
            "custom_reward_function.reward_kwargs: verl's",
        ),
        (["~data.seed"], "removing a key (~key) is not supported"),
    ],
)
def test_verl_settings_without_a_meaning_here_are_refused_in_one_line(overrides, said):
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(None, overrides))
    assert said in str(err.value) and "\n" not in str(err.value)


def test_environment_interpolation(monkeypatch, tmp_path):
    monkeypatch.setenv("RLHF_TEST_NODES", "4")
    monkeypatch.setenv("RLHF_TEST_DATA", str(tmp_path))
    config = tmp_path / "job.yaml"
    config.write_text(
        "trainer:\n  nnodes: ${oc.env:RLHF_TEST_NODES,1}\n"
        "  n_gpus_per_node: ${oc.env:RLHF_TEST_UNSET,8}\n"
        "data:\n  val_files: ${oc.env:RLHF_TEST_DATA}/val.parquet\n"
    )
    cfg = load_config(config, ["+data.seed=${oc.env:RLHF_TEST_NODES}"])
    assert (cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, cfg.data.seed) == (4, 8, 4)
    assert cfg.data.val_files == f"{tmp_path}/val.parquet"
    with pytest.raises(ConfigError, match=r"^trainer.nnodes: environment variable RLHF_TEST_UN"):
        load_config(None, ["trainer.nnodes=${oc.env:RLHF_TEST_UNSET}"])


@pytest.mark.parametrize(
    ("typed", "meant"),
    [
        (
            "actor_rollout_ref.actor.sequence_parallel",
            "actor_rollout_ref.actor.megatron.sequence_parallel",
        ),
        ("critic.megatron.sequence_parallel_size", "critic.megatron.sequence_parallel"),
        ("actor_rollout_ref.rollout.temprature", "actor_rollout_ref.rollout.temperature"),
        ("algorithm.kl_ctrl.kl_coeff", "algorithm.kl_ctrl.kl_coef"),
        ("critic.ppo_micro_batch_size_per_gpux", "critic.ppo_micro_batch_size_per_gpu"),
        ("actor_rollout_ref.actor.megatron.data_parallel_size", None),  # not pipeline
        ("actor_rollout_ref.actor.use_dynamic_batch", None),  # not use_kl_loss
        ("data.return_full_prompt", None),
    ],
)
def test_did_you_mean_follows_the_key_path(typed, meant):
    assert nearest_key(typed) == meant


def test_the_old_log_prob_budget_follows_verls_rollout_keys():
    base = ["data.max_prompt_length=100", "data.max_response_length=28"]
    base.append("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    budgets = budgets_of(load_config(None, base))
    assert budgets.actor == budgets.old_log_prob == MicroBatching(2 * 128)  # the update's
    micro = "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8"
    budgets = budgets_of(load_config(None, [*base, micro]))
    assert (budgets.actor.tokens, budgets.old_log_prob.tokens) == (256, 8 * 128)
    tokens = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu=3000"
    assert budgets_of(load_config(None, [*base, micro, tokens])).old_log_prob.tokens == 3000
    fixed_actor = [*base, "actor_rollout_ref.actor.use_dynamic_bsz=false"]
    fixed = budgets_of(load_config(None, fixed_actor))
    assert fixed.actor == fixed.old_log_prob == MicroBatching(256, samples=2)
    assert fixed.ref == fixed.old_log_prob  # unset: the old-log-prob forward's micro-batches
    ref = "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4"
    assert budgets_of(load_config(None, [*fixed_actor, ref])).ref == MicroBatching(512, samples=4)
    ref_dynamic = "actor_rollout_ref.ref.log_prob_use_dynamic_bsz=true"
    assert budgets_of(load_config(None, [*fixed_actor, ref_dynamic])).ref == MicroBatching(256)
    assert fixed.critic == MicroBatching(256, samples=2)  # unset: the actor's switch (verl's)
    own = budgets_of(load_config(None, [*fixed_actor, "critic.use_dynamic_bsz=true"]))
    assert own.critic == MicroBatching(256)  # set: its own


def test_a_token_budget_for_fixed_micro_batches_is_refused():
    cfg = load_config(
        "configs/quickstart_cpu.yaml",
        ["critic.use_dynamic_bsz=false", "critic.ppo_max_token_len_per_gpu=300"],
    )
    with pytest.raises(ConfigError, match=r"^critic.ppo_max_token_len_per_gpu=300 is a token"):
        validate_config(cfg)


def test_override_transformer_config_reaches_megatron_and_is_checked(tiny_qwen2_dir):
    from rlhf.config.validate import trained_megatron
    from rlhf.models.families import load_arch, transformer_config
    from rlhf.trainer.preflight import check_megatron_overrides

    prefix = "actor_rollout_ref.actor.megatron.override_transformer_config"
    cfg = load_config(
        None,
        [
            f"+{prefix}.recompute_granularity=selective",  # this system's own key
            f"+{prefix}.attention_dropout=0.25",
            f"++{prefix}.apply_rope_fusion=false",
        ],
    )
    megatron = cfg.actor_rollout_ref.actor.megatron
    assert megatron.recompute_granularity == "selective"
    assert megatron.override_transformer_config == {
        "attention_dropout": 0.25,
        "apply_rope_fusion": False,
    }
    check_megatron_overrides(trained_megatron(cfg.actor_rollout_ref, cfg.critic, cfg.algorithm))
    config = transformer_config(load_arch(tiny_qwen2_dir), overrides={"attention_dropout": 0.25})
    assert config.attention_dropout == 0.25 and config.hidden_dropout == 0.0
    for field, said in (
        ("num_layers=2", "num_layers: set by the model's config.json here"),
        ("tensor_model_parallel_size=2", "set by megatron.tensor_model_parallel_size"),
        ("apply_rope_fusin=true", "not a field of Megatron-Core's TransformerConfig; did you mean"),
    ):
        with pytest.raises(ConfigError, match=said):
            check_megatron_overrides(trained_of(load_config(None, [f"+{prefix}.{field}"])))


def test_verl_moe_keys_mean_this_systems_expert_keys():
    """verl sets the router's losses through override_transformer_config and the
    reference's expert sizes beside the actor's: they mean this system's keys."""
    prefix = "actor_rollout_ref.actor.megatron"
    cfg = load_config(
        None,
        [
            f"{prefix}.expert_model_parallel_size=2",
            "actor_rollout_ref.ref.megatron.expert_model_parallel_size=2",
            f"+{prefix}.override_transformer_config.moe_aux_loss_coeff=0.001",
            f"+{prefix}.override_transformer_config.moe_z_loss_coeff=0.0001",
            f"+{prefix}.override_transformer_config.moe_token_drop_policy=position",
        ],
    )
    megatron = cfg.actor_rollout_ref.actor.megatron
    assert (megatron.expert_model_parallel_size, megatron.moe_aux_loss_coeff) == (2, 0.001)
    assert (megatron.moe_z_loss_coeff, megatron.moe_token_drop_policy) == (0.0001, "position")
    assert megatron.override_transformer_config == {}
    with pytest.raises(ConfigError, match="expert_model_parallel_size"):
        load_config(None, ["actor_rollout_ref.ref.megatron.expert_model_parallel_size=2"])


def budgets_of(cfg):
    """Each pass's micro-batching of a loaded config."""
    return token_budgets(cfg.actor_rollout_ref, cfg.critic, cfg.data)


def trained_of(cfg):
    """The trained models' Megatron sections of a loaded config."""
    return trained_megatron(cfg.actor_rollout_ref, cfg.critic, cfg.algorithm)

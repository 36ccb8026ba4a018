"""Cross-field config rules: every key involved is named in the message."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from rlhf.config import ConfigError, load_config, validate_config

QUICKSTART = "configs/quickstart_cpu.yaml"


def check(overrides, world_size=None):
    return validate_config(load_config(QUICKSTART, overrides), world_size)


def test_quickstart_is_valid_and_layouts_derive_dp():
    layout = check(
        [
            "trainer.n_gpus_per_node=4",
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
            "critic.megatron.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "critic.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    assert (layout.tp_size, layout.pp_size, layout.sp_size, layout.dp_size) == (2, 1, 1, 2)


def test_parallel_sizes_must_divide_world_size():
    with pytest.raises(ConfigError) as err:
        check(
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
            ]
        )
    message = str(err.value)
    for key in (
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size (2)",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size (2)",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size (1)",
        "trainer.nnodes",
        "trainer.n_gpus_per_node",
    ):
        assert key in message
    assert "world size 2" in message


def test_critic_layout_checked_too():
    with pytest.raises(ConfigError, match=r"critic.ulysses_sequence_parallel_size \(3\)"):
        check(["critic.ulysses_sequence_parallel_size=3"])


def test_step_batch_must_split_into_mini_batches():
    with pytest.raises(ConfigError) as err:
        check(
            [
                "data.train_batch_size=6",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            ]
        )
    message = str(err.value)
    assert message.startswith(
        "data.train_batch_size (6) x actor_rollout_ref.rollout.n (2) = 12 samples"
    )
    assert "actor_rollout_ref.actor.ppo_mini_batch_size (4)" in message


def test_mini_batch_must_split_over_dp_and_micro_batches():
    with pytest.raises(ConfigError) as err:
        check(
            [
                "trainer.n_gpus_per_node=2",
                "actor_rollout_ref.rollout.n=2",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                "critic.ppo_mini_batch_size=4",
                "critic.ppo_micro_batch_size_per_gpu=3",
            ]
        )
    message = str(err.value)
    assert "critic.ppo_mini_batch_size (4) x actor_rollout_ref.rollout.n (2) = 8 samples" in message
    assert "data-parallel size 2" in message
    assert "critic.ppo_micro_batch_size_per_gpu (3)" in message


def test_launched_world_size_must_match_plan():
    with pytest.raises(ConfigError) as err:
        check([], world_size=2)
    message = str(err.value)
    assert "trainer.nnodes (1) x trainer.n_gpus_per_node (1) = 1" in message
    assert "2 processes launched" in message


def test_profiler_steps_and_model_path():
    with pytest.raises(ConfigError, match=r"global_profiler.steps\[1\]: steps count from 1, got 0"):
        check(["global_profiler.steps=[1,0]"])
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.path: required"):
        check(["actor_rollout_ref.model.path="])


def test_server_urls_must_be_urls():
    with pytest.raises(ConfigError, match=r"server_urls: \['rollout-0:30000'\] are not URLs"):
        check(["actor_rollout_ref.rollout.server_urls=[rollout-0:30000,http://ok:1]"])


def test_servers_on_other_hosts_need_a_weight_sync_address_they_can_reach():
    """(issue 51, item 7) Servers on another host rendezvous with training rank 0 at
    weight_sync_master_address for the distributed transport: the default 127.0.0.1 or any
    loopback address is refused at startup in one line naming the key and those servers."""
    key = "actor_rollout_ref.rollout.weight_sync_master_address"
    remote = [
        "actor_rollout_ref.rollout.server_urls=[http://rollout-0:30000,http://127.0.0.1:30001]",
        "actor_rollout_ref.rollout.weight_sync_transport=distributed",
    ]
    for address in ([], [f"{key}=localhost"], [f"{key}=127.0.1.1"], [f"{key}=::1"]):
        with pytest.raises(ConfigError) as err:
            check([*remote, *address])
        message = str(err.value)
        assert "\n" not in message and message.startswith(f"{key} is ")
        assert "http://rollout-0:30000" in message and "30001" not in message
        assert ("(the default when unset)" in message) == (address == [])
    for address in ("train-0", "10.0.0.7"):
        check([*remote, f"{key}={address}"])
    local = "actor_rollout_ref.rollout.server_urls=[http://localhost:30000,http://127.0.0.2:1]"
    check([local, remote[1]])
    check([remote[0], "actor_rollout_ref.rollout.weight_sync_transport=disk"])


def test_bypass_mode_excludes_importance_weights():
    keys = ["algorithm.rollout_correction.bypass_mode=true"]
    check(keys)
    with pytest.raises(ConfigError, match=r"bypass_mode .* rollout_is=token would weight by 1"):
        check([*keys, "algorithm.rollout_correction.rollout_is=token"])


COLOCATED_2_NODES = ["trainer.nnodes=2", "trainer.n_gpus_per_node=2"]


def test_colocated_servers_on_several_nodes_take_any_layout():
    """verl's large-model scripts colocate at PP > 1 across nodes; a node without whole
    replicas syncs its servers with every rank taking part (rlhf.weight_sync.gather)."""
    pp2 = [
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "critic.megatron.pipeline_model_parallel_size=2",
    ]
    assert check([*COLOCATED_2_NODES, *pp2]).pp_size == 2
    check([*COLOCATED_2_NODES, *pp2, "actor_rollout_ref.rollout.server_urls=[http://r:1]"])
    tp2 = [
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=2",
    ]
    assert check([*COLOCATED_2_NODES, *tp2]).dp_size == 2


def test_ulysses_needs_query_heads_divisible_per_tp_rank():
    heads = SimpleNamespace(num_layers=2, num_attention_heads=6, num_query_groups=2)
    sp2 = [
        "trainer.n_gpus_per_node=2",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
        "critic.ulysses_sequence_parallel_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
        "critic.ppo_micro_batch_size_per_gpu=1",
    ]
    assert validate_config(load_config(QUICKSTART, sp2), None, heads).sp_size == 2
    tp2 = [
        "trainer.n_gpus_per_node=4",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "critic.megatron.tensor_model_parallel_size=2",
    ]
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(QUICKSTART, sp2[1:] + tp2), None, heads)
    message = str(err.value)
    assert (
        "ulysses_sequence_parallel_size=2" in message and "tensor_model_parallel_size=2" in message
    )
    assert "3 query heads per TP rank cannot be split over 2 Ulysses ranks" in message
    latent = SimpleNamespace(num_layers=2, num_attention_heads=4, num_query_groups=4, mla=True)
    with pytest.raises(ConfigError, match="not supported for multi-latent attention"):
        validate_config(load_config(QUICKSTART, sp2), None, latent)


@pytest.mark.parametrize(
    ("shape", "expected"),
    [
        (
            (2, 4, 1),
            r"tensor_model_parallel_size=2: the model's num_key_value_heads \(1\) "
            r"must be divisible by the tensor parallel size \(2\)",
        ),
        (
            (2, 3, 3),
            r"tensor_model_parallel_size=2: the model's num_attention_heads \(3\) "
            r"must be divisible",
        ),
        (
            (3, 4, 2),
            r"pipeline_model_parallel_size=2: the model's num_hidden_layers \(3\) "
            r"must be divisible by the pipeline parallel size \(2\)",
        ),
    ],
)
def test_model_must_split_over_tp_and_pp(shape, expected):
    """Megatron would refuse these after the servers started; the config check names them."""
    layers, heads, kv_heads = shape
    model = SimpleNamespace(num_layers=layers, num_attention_heads=heads, num_query_groups=kv_heads)
    sizes = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    key = "tensor" if "tensor" in expected else "pipeline"
    for role in ("actor_rollout_ref.actor", "critic"):
        sizes += [f"{role}.megatron.{key}_model_parallel_size=2"]
    with pytest.raises(ConfigError, match=expected):
        validate_config(load_config(QUICKSTART, sizes), None, model)


def test_virtual_pipeline_needs_stages_and_layers_for_every_chunk():
    sizes = ["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1"]
    roles = ("actor_rollout_ref.actor", "critic")
    vp2 = [f"{role}.megatron.virtual_pipeline_model_parallel_size=2" for role in roles]
    pp2 = [f"{role}.megatron.pipeline_model_parallel_size=2" for role in roles]
    with pytest.raises(ConfigError, match=r"virtual_pipeline_model_parallel_size=2 needs .*> 1"):
        validate_config(load_config(QUICKSTART, sizes + vp2))
    six_layers = SimpleNamespace(num_layers=6, num_attention_heads=4, num_query_groups=2)
    with pytest.raises(
        ConfigError,
        match=r"virtual_pipeline_model_parallel_size=2: the model's num_hidden_layers \(6\) "
        r"must be divisible by the pipeline parallel size \(2\) x the virtual pipeline size",
    ):
        validate_config(load_config(QUICKSTART, sizes + vp2 + pp2), None, six_layers)
    eight_layers = SimpleNamespace(num_layers=8, num_attention_heads=4, num_query_groups=2)
    assert (
        validate_config(load_config(QUICKSTART, sizes + vp2 + pp2), None, eight_layers).vp_size == 2
    )
    inherited = sizes + pp2[:1] + vp2[:1]  # the critic takes the actor's PP and VP
    assert validate_config(load_config(QUICKSTART, inherited), None, eight_layers).vp_size == 2
    critic_vp1 = [*sizes, *pp2, vp2[0], "critic.megatron.virtual_pipeline_model_parallel_size=1"]
    with pytest.raises(ConfigError, match="share one Megatron parallel layout"):
        validate_config(load_config(QUICKSTART, critic_vp1), None, eight_layers)


def test_critic_free_estimators_skip_the_critic_rules_and_name_ignored_critic_keys():
    from rlhf.config.validate import config_notes, uses_critic, uses_reference

    # A critic layout that would be wrong for GAE is not checked when no critic is built.
    grpo = ["algorithm.adv_estimator=grpo", "critic.ulysses_sequence_parallel_size=3"]
    cfg = load_config(QUICKSTART, grpo)
    assert validate_config(cfg).sp_size == 1
    assert not uses_critic(cfg.algorithm) and uses_reference(
        cfg.algorithm, cfg.actor_rollout_ref.actor
    )
    (note,) = config_notes(cfg)
    assert "critic.ulysses_sequence_parallel_size" in note and "adv_estimator=grpo" in note
    # The quickstart's own critic settings are named too; a GAE run ignores nothing.
    assert "critic.optim.lr" in note
    assert config_notes(load_config(QUICKSTART)) == []


def test_no_reference_without_a_kl_and_kl_settings_named_when_unused():
    from rlhf.config.validate import config_notes, uses_reference

    no_kl = ["algorithm.use_kl_in_reward=false"]
    cfg = load_config(QUICKSTART, [*no_kl, "algorithm.kl_ctrl.kl_coef=0.01"])
    assert not uses_reference(cfg.algorithm, cfg.actor_rollout_ref.actor)
    assert any("algorithm.kl_ctrl.kl_coef" in note for note in config_notes(cfg))
    kl_loss = load_config(QUICKSTART, [*no_kl, "actor_rollout_ref.actor.use_kl_loss=true"])
    assert uses_reference(kl_loss.algorithm, kl_loss.actor_rollout_ref.actor)


def test_kl_early_stop_needs_a_reference():
    with pytest.raises(ConfigError, match=r"kl_patience=3 watches the KL to the reference"):
        check(["algorithm.use_kl_in_reward=false", "trainer.early_stop.kl_patience=3"])
    check(
        [
            "algorithm.use_kl_in_reward=false",
            "actor_rollout_ref.actor.use_kl_loss=true",
            "trainer.early_stop.kl_patience=3",
        ]
    )


def test_expert_parallel_sizes_must_divide_world_size():
    """Megatron lays the experts out as expert-TP x EP x expert-DP x PP over the ranks."""
    prefix = "actor_rollout_ref.actor.megatron"
    layout = check(
        [
            "trainer.n_gpus_per_node=4",
            f"{prefix}.expert_model_parallel_size=4",
            f"{prefix}.expert_tensor_parallel_size=1",
            f"{prefix}.tensor_model_parallel_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
            "critic.megatron.tensor_model_parallel_size=2",
            "critic.megatron.expert_model_parallel_size=4",
            "critic.megatron.expert_tensor_parallel_size=1",
            "critic.ppo_micro_batch_size_per_gpu=2",
        ]
    )
    assert (layout.ep_size, layout.etp_size, layout.dp_size) == (4, 1, 2)
    assert "experts EP 4" in layout.describe()
    with pytest.raises(ConfigError) as err:
        check(
            [
                "trainer.n_gpus_per_node=4",
                f"{prefix}.expert_model_parallel_size=2",
                f"{prefix}.expert_tensor_parallel_size=2",
                f"{prefix}.pipeline_model_parallel_size=2",
            ]
        )
    assert "= 8 does not divide the world size 4" in str(err.value)


def test_router_settings_and_expert_sizes_need_a_model_with_experts(tiny_qwen2_dir):
    from rlhf.trainer.preflight import load_policy_arch

    prefix = "actor_rollout_ref.actor.megatron"
    model = f"actor_rollout_ref.model.path={tiny_qwen2_dir}"
    for key, said in (
        (f"{prefix}.moe_aux_loss_coeff=0.01", "router settings for qwen2, a model without experts"),
        (f"{prefix}.expert_model_parallel_size=2", "qwen2 has no experts"),
    ):  # the message names the actor's own megatron section
        with pytest.raises(ConfigError, match=rf"^{re.escape(prefix)}\.(moe|expert).*{said}"):
            load_policy_arch(load_config(None, [model, "trainer.n_gpus_per_node=2", key]))


def test_a_vision_language_model_trains_as_the_policy_only(tmp_path):
    """A Qwen2.5-VL policy loads under GRPO; as the critic (PPO's default: the policy's
    directory), with multi-turn rollouts or with Ulysses SP it is refused in one line."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from rlhf.config.validate import ParallelLayout, check_heads
    from rlhf.trainer.preflight import load_policy_arch
    from tests.distributed.test_vlm_parity import CONFIG

    Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**CONFIG)).save_pretrained(tmp_path)
    model = f"actor_rollout_ref.model.path={tmp_path}"
    grpo = "algorithm.adv_estimator=grpo"
    arch = load_policy_arch(load_config(None, [model, grpo]))
    assert arch.vision is not None and arch.vision.family == "qwen2_5_vl"
    with pytest.raises(ConfigError, match=r"critic.model.path=.*qwen2_5_vl is a vision-language"):
        load_policy_arch(load_config(None, [model, f"critic.model.path={tmp_path}"]))
    turns = "actor_rollout_ref.rollout.multi_turn.enable=true"
    with pytest.raises(ConfigError, match="multi-turn rollouts of a vision-language policy"):
        load_policy_arch(load_config(None, [model, grpo, turns]))
    with pytest.raises(ConfigError, match="not supported for a vision-language model"):
        check_heads(ParallelLayout(world_size=2, sp_size=2), arch)


def test_routing_replay_is_refused_where_it_cannot_work(tiny_qwen2_dir, tmp_path):
    from rlhf.trainer.preflight import load_policy_arch
    from tests.distributed.test_moe_parity import MODELS, save_moe_model

    all_sparse = {**MODELS["qwen3_moe"], "mlp_only_layers": []}  # SGLang serves it
    moe_dir = save_moe_model(tmp_path / "moe", all_sparse, seed=0)
    mode = "actor_rollout_ref.actor.router_replay.mode"
    for model, keys, said in (
        (tiny_qwen2_dir, [f"{mode}=R3"], "qwen2 has no experts to route"),
        (tiny_qwen2_dir, [f"{mode}=R2"], "qwen2 has no experts to route"),
        (
            moe_dir,
            [f"{mode}=R3", "actor_rollout_ref.actor.megatron.recompute_granularity=full"],
            "recompute routes again in the backward",
        ),
        (
            moe_dir,
            [f"{mode}=R2", "actor_rollout_ref.actor.megatron.recompute_granularity=full"],
            "recompute routes again in the backward",
        ),
        (
            moe_dir,
            [f"{mode}=R2", "algorithm.rollout_correction.bypass_mode=true"],
            "skips the old-log-prob pass",
        ),
    ):
        cfg = load_config(None, [f"actor_rollout_ref.model.path={model}", *keys])
        with pytest.raises(ConfigError, match=said):
            load_policy_arch(cfg)
    load_policy_arch(load_config(None, [f"actor_rollout_ref.model.path={moe_dir}", f"{mode}=R2"]))
    # R3 with bypass_mode: the engine's log-probs are on the routes the updates replay
    bypass = "algorithm.rollout_correction.bypass_mode=true"
    r3 = load_config(None, [f"actor_rollout_ref.model.path={moe_dir}", f"{mode}=R3", bypass])
    load_policy_arch(r3)


def test_rollout_routing_replay_asks_the_launched_servers_for_routes():
    """R3: the launched servers get --enable-return-routed-experts (SGLang's), every training
    request asks for the routes; a user's explicit `false` is refused."""
    from rlhf.config.engine_args import launched_rollout, server_argv
    from rlhf.rollout.policy_servers import sampling_params

    mode = "actor_rollout_ref.actor.router_replay.mode"
    kwargs = "actor_rollout_ref.rollout.engine_kwargs.sglang"
    plain = load_config(None, [])
    assert launched_rollout(plain.actor_rollout_ref) == plain.actor_rollout_ref.rollout
    assert not sampling_params(
        plain.actor_rollout_ref, plain.data.max_response_length
    ).routed_experts
    r3 = load_config(None, [f"{mode}=R3", f"{kwargs}.chunked_prefill_size=64"])
    argv = server_argv(launched_rollout(r3.actor_rollout_ref).engine_kwargs.sglang)
    assert argv == ["--chunked-prefill-size", "64", "--enable-return-routed-experts"]
    assert r3.actor_rollout_ref.rollout.engine_kwargs.sglang == {"chunked_prefill_size": 64}
    assert sampling_params(r3.actor_rollout_ref, r3.data.max_response_length).routed_experts
    off = load_config(None, [f"{mode}=R3", f"{kwargs}.enable_return_routed_experts=false"])
    with pytest.raises(ConfigError, match="mode=R3 sets it to True"):
        launched_rollout(off.actor_rollout_ref)


def test_lora_keys_name_layers_a_dense_model_has(tiny_qwen2_dir, tmp_path):
    """verl's LoRA keys load; target_modules that split a fused Megatron layer, or names of
    no linear layer, and LoRA on a model it is not built for, are refused in one line; a
    MoE's experts take adapters with merged sync, not with grouped GEMM."""
    from rlhf.trainer.preflight import load_policy_arch
    from tests.distributed.test_moe_parity import MODELS, save_moe_model

    model = f"actor_rollout_ref.model.path={tiny_qwen2_dir}"
    lora = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16"]
    load_policy_arch(load_config(None, [model, *lora, "algorithm.adv_estimator=grpo"]))
    for targets, said in (
        ("[q_proj,v_proj]", r"\['q_proj', 'v_proj'\] without \['k_proj'\]"),
        ("[q_proj,k_proj,v_proj,lm_head]", r"\['lm_head'\] are not linear layers adapted"),
    ):
        key = f"actor_rollout_ref.model.target_modules={targets}"
        with pytest.raises(
            ConfigError, match=rf"^actor_rollout_ref\.model\.target_modules: {said}"
        ):
            load_policy_arch(load_config(None, [model, *lora, key]))
    all_sparse = {**MODELS["qwen3_moe"], "mlp_only_layers": []}  # SGLang serves it
    moe_dir = save_moe_model(tmp_path / "moe", all_sparse, seed=0)
    moe = f"actor_rollout_ref.model.path={moe_dir}"
    grpo = "algorithm.adv_estimator=grpo"
    with pytest.raises(ConfigError, match=r"only with its Triton kernels: set .*lora_merge=true"):
        load_policy_arch(load_config(None, [moe, *lora, grpo]))
    merged = "actor_rollout_ref.model.lora_merge=true"
    load_policy_arch(load_config(None, [moe, *lora, grpo, merged]))  # the experts adapted
    grouped = "actor_rollout_ref.actor.megatron.override_transformer_config.moe_grouped_gemm=true"
    said = r"grouped GEMM holds as one module: set actor_rollout_ref\.actor\.megatron\.override"
    with pytest.raises(ConfigError, match=said):
        load_policy_arch(load_config(None, [moe, *lora, grpo, merged, grouped]))
    attention = "actor_rollout_ref.model.target_modules=[q_proj,k_proj,v_proj,o_proj]"
    load_policy_arch(load_config(None, [moe, *lora, attention, grpo]))


def test_verls_megatron_lora_section_loads_as_the_flat_keys():
    """verl's Megatron scripts' `model.lora.*` keys are this system's LoRA keys; its
    settings without a counterpart are accepted at the one value built and refused in one
    line otherwise; the critic's section is its LoRA keys too."""
    lora = "actor_rollout_ref.model.lora"
    cfg = load_config(
        None,
        [
            f"{lora}.rank=16",
            f"{lora}.alpha=32",
            f"{lora}.dropout=0.05",
            f"{lora}.merge=True",
            f"{lora}.target_modules=[linear_qkv,linear_proj]",
            f"{lora}.lora_A_init_method=kaiming",
            f"{lora}.type=lora",
            f"{lora}.exclude_modules=[]",
        ],
    )
    model = cfg.actor_rollout_ref.model
    assert (model.lora_rank, model.lora_alpha, model.lora_dropout, model.lora_merge) == (
        16,
        32.0,
        0.05,
        True,
    )
    assert model.target_modules == ["linear_qkv", "linear_proj"]
    fsdp = [  # verl's FSDP scripts' LoRA keys: the same adapters
        "actor_rollout_ref.model.lora_rank=16",
        "actor_rollout_ref.model.lora_alpha=32",
        "actor_rollout_ref.model.target_modules=all-linear",
        "actor_rollout_ref.model.use_shm=True",
        "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True",
    ]
    megatron = ["actor_rollout_ref.model.lora.rank=16", "actor_rollout_ref.model.lora.alpha=32"]
    assert load_config(None, fsdp) == load_config(None, megatron)
    critic = load_config(None, ["critic.model.lora.rank=8", "critic.model.lora.alpha=16"])
    assert (critic.critic.model.lora_rank, critic.critic.model.lora_alpha) == (8, 16.0)
    for bad, said in (
        (f"{lora}.lora_A_init_method=xavier", "xavier is not built"),
        (f"{lora}.type=canonical_lora", "canonical_lora, dora and vlm_lora are not built"),
        (f"{lora}.rank=8 actor_rollout_ref.model.lora_rank=4", "both set, to 8 and 4"),
        ("critic.model.lora_merge=true", "the critic's weights go to no server"),
    ):
        with pytest.raises(ConfigError, match=said):
            validate_config(load_config(QUICKSTART, bad.split()))


def test_a_key_of_a_section_keeps_the_sections_other_defaults():
    """`critic.model.lora_rank=8` alone: the critic's model keeps its own default path (the
    actor's), not ModelConfig's empty one (the section is built on its default)."""
    cfg = load_config(QUICKSTART, ["critic.model.lora_rank=8"])
    assert cfg.critic.model.path == cfg.actor_rollout_ref.model.path != ""
    assert cfg.critic.model.lora_rank == 8

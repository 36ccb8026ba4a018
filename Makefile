# The two commands of the README: `make quickstart` and `make test`. Everything runs in .venv,
# built from requirements/cpu.in with the exact versions of requirements/cpu.lock.

PYTHON_BASE ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.setup-done
PYTEST_ARGS ?=

.PHONY: setup quickstart quickstart-assets quickstart-grpo quickstart-dapo quickstart-moe quickstart-moe-assets quickstart-tools quickstart-tools-assets quickstart-async quickstart-rm quickstart-vlm quickstart-vlm-assets quickstart-lora test test-slow test-unit test-distributed test-e2e test-gpu lint format bench lock gpu-deps clean docker-test

setup: $(STAMP)

$(STAMP): requirements/cpu.in requirements/cpu.lock setup.py
	@command -v bwrap >/dev/null || bash tools/install_bubblewrap.sh
	test -x $(PY) || $(PYTHON_BASE) -m venv $(VENV)
	$(PIP) install -q -c requirements/cpu.lock -r requirements/cpu.in
	$(PIP) install -q --no-deps -c requirements/cpu.lock sglang
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(VENV)/bin/rlhf-check-env requirements/cpu.lock
	touch $(STAMP)

quickstart: quickstart-assets
	$(VENV)/bin/rlhf-train --config configs/quickstart_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart

# The same model and data, trained with GRPO (no critic, KL as a loss).
quickstart-grpo: quickstart-assets
	$(VENV)/bin/rlhf-train --config configs/quickstart_grpo_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart_grpo

# ... and with DAPO (no KL, clip-higher, dynamic sampling, overlong shaping).
quickstart-dapo: quickstart-assets
	$(VENV)/bin/rlhf-train --config configs/quickstart_dapo_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart_dapo

quickstart-assets: setup
	$(VENV)/bin/rlhf-make-tiny-model runs/quickstart/model --warm-start
	$(VENV)/bin/rlhf-preprocess quickstart --local_dir runs/quickstart/data

# GRPO on a tiny mixture-of-experts model (Qwen3-MoE, 8 experts, top-2) warm-started like the
# dense one, on the same data; SGLang serves it and gets its experts after every step.
quickstart-moe: quickstart-moe-assets
	$(VENV)/bin/rlhf-train --config configs/quickstart_moe_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart_moe

quickstart-moe-assets: setup
	$(VENV)/bin/rlhf-make-tiny-model runs/quickstart_moe/model --family qwen3_moe --warm-start
	$(VENV)/bin/rlhf-preprocess quickstart --local_dir runs/quickstart/data

# Multi-turn GRPO with a calculator tool: a tiny model warm-started to call it sometimes
# learns to call it (multiplication problems; the tool messages are not trained on).
quickstart-tools: quickstart-tools-assets
	$(VENV)/bin/rlhf-train --config configs/quickstart_tools_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart_tools

# GRPO with generation overlapping training on a disaggregated CPU server (core 0) and the
# trainer on core 1: trainer.rollout_mode=async (launch/quickstart_async.sh)
quickstart-async: quickstart-assets
	PYTHON=$(PY) bash launch/quickstart_async.sh
	$(VENV)/bin/rlhf-plot runs/quickstart_async

# A reward model trained on locally generated preference pairs (rlhf-train-rm), then PPO
# rewarded by it alone; validation keeps the rule, so it measures real correctness.
quickstart-rm: quickstart-assets
	$(VENV)/bin/rlhf-preprocess quickstart-rm --local_dir runs/quickstart_rm/data
	$(VENV)/bin/rlhf-train-rm --config configs/quickstart_rm_cpu.yaml
	$(VENV)/bin/rlhf-train --config configs/quickstart_rm_ppo_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart_rm/ppo

# GRPO with rank-8 LoRA adapters on the quickstart model (the reference: adapters off)
quickstart-lora: quickstart-assets
	$(VENV)/bin/rlhf-train --config configs/quickstart_lora_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart_lora

# the vision-language quickstart: a tiny Qwen2.5-VL learns to count squares in pictures
quickstart-vlm: quickstart-vlm-assets
	$(VENV)/bin/rlhf-train --config configs/quickstart_vlm_cpu.yaml
	$(VENV)/bin/rlhf-plot runs/quickstart_vlm

quickstart-vlm-assets: setup
	$(VENV)/bin/rlhf-make-tiny-model runs/quickstart_vlm/model --family qwen2_5_vl --warm-start
	$(VENV)/bin/rlhf-preprocess quickstart-vlm --local_dir runs/quickstart_vlm/data

quickstart-tools-assets: setup
	$(VENV)/bin/rlhf-make-tiny-model runs/quickstart_tools/model --tools --warm-start
	$(VENV)/bin/rlhf-preprocess quickstart-tools --local_dir runs/quickstart_tools/data

# Everything but the slow whole runs (about 6 minutes on 2 cores); test-slow runs those
# (about 20 minutes). Budget: CONTRIBUTING.md, "Test budget".
test: setup
	$(PY) -m pytest tests -m "not slow" $(PYTEST_ARGS)

test-slow: setup
	$(PY) -m pytest tests -m slow $(PYTEST_ARGS)

test-unit test-distributed test-e2e test-gpu: setup
	$(PY) -m pytest tests -m $(subst test-,,$@) $(PYTEST_ARGS)

# By hand, not in CI (about 20 minutes the first time; root, podman, buildah, runc, debootstrap):
# the CPU image of docker/Dockerfile on a debootstrapped Debian base, and the quickstart in it.
docker-test:
	tools/docker_test.sh

# plain_ppo.py and trl_ppo.py are ppo_vs_plain.py's yardsticks: it runs them with its model
bench: setup
	for script in benchmarks/*.py; do case $$script in */plain_ppo.py|*/trl_ppo.py) continue;; esac; $(PY) $$script || exit 1; done

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# By hand (needs PyPI; about 5 minutes, downloads ~2 GB to a temporary directory): pip resolves
# `pip install .[gpu]` against the lock without installing, which is how a lock or gpu.txt change
# is checked against what SGLang, Transformer Engine and flashinfer declare they depend on.
gpu-deps: setup
	PIP_NO_CACHE_DIR=1 $(PIP) install --dry-run --ignore-installed --quiet -c requirements/cpu.lock ".[gpu]"

# Re-pin after changing requirements/cpu.in: the lock is the freeze of a working .venv.
lock: setup
	{ sed -n '1,3p' requirements/cpu.lock; $(PIP) freeze --all --exclude-editable | grep -v -E '^(pip|rlhf)==' | sort -f; } > requirements/cpu.lock.new
	mv requirements/cpu.lock.new requirements/cpu.lock

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache

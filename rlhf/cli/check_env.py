"""Check that the installed packages are exactly the versions pinned in a lock file.

    rlhf-check-env requirements/cpu.lock

Exits 1 listing every missing package and every version that differs from its pin (a
second torch pulled in by some dependency shows up here).
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

from rlhf.errors import ends_in_one_line


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """Name -> pinned version of every `name==version` line (`name[extra]==version` too)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonical(name.split("[", 1)[0].strip())] = version.strip()
    return pins


def installed_versions() -> dict[str, str]:
    """Name -> version of what `import` would find: the first distribution on sys.path.

    Later duplicates are vendored copies (setuptools puts its `_vendor` folder, with its
    own packaging, on sys.path once imported) and must not shadow the installed one.
    """
    versions: dict[str, str] = {}
    for dist in metadata.distributions():
        versions.setdefault(canonical(dist.metadata["Name"]), dist.version)
    return versions


def mismatches(pins: dict[str, str], installed: dict[str, str]) -> list[str]:
    problems = []
    for name, version in sorted(pins.items()):
        have = installed.get(name)
        if have is None:
            problems.append(f"{name}: pinned {version}, not installed")
        elif have != version:
            problems.append(f"{name}: pinned {version}, installed {have}")
    return problems


def lock_problems(path: Path) -> list[str]:
    """Every pin of the lock (or requirements) file at `path` that this environment breaks."""
    return mismatches(read_pins(path), installed_versions())


@ends_in_one_line("check_env")  # a missing lock file: one line, exit 2
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: check_env.py LOCK_FILE", file=sys.stderr)
        return 2
    problems = lock_problems(Path(argv[0]))
    for problem in problems:
        print(f"check_env: {problem}", file=sys.stderr)
    if problems:
        print(
            "check_env: environment does not match the lock; run 'make clean setup'",
            file=sys.stderr,
        )
        return 1
    print(f"check_env: all {len(read_pins(Path(argv[0])))} pinned packages match {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""docs/config-reference.md, generated from the schema: every key of `rlhf-train`'s config
with its type, default and the schema's one-line description, section by section.

    python -m rlhf.config.reference > docs/config-reference.md

tests/unit/test_config_reference.py keeps the file equal to what this prints.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from rlhf.config.loader import type_name
from rlhf.config.schema import RLHFConfig

HEADER = """# Config reference

Every key of `rlhf-train`'s config: its type, default and meaning, generated from
`rlhf/config/schema.py` (`python -m rlhf.config.reference > docs/config-reference.md`; a test
keeps this page equal to it). verl's names for these keys and verl's keys that mean something
here under another name: [from-verl.md](from-verl.md).
"""


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value: Any = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return ""
    text = "null" if value is None else repr(value)
    return f"`{text}`".replace("|", "\\|")


def _rows(cls: type, prefix: str, out: list[str]) -> None:
    hints = typing.get_type_hints(cls)
    nested = []
    for field in dataclasses.fields(cls):
        tp, key = hints[field.name], f"{prefix}{field.name}"
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            nested.append((tp, key))
            continue
        kind = type_name(tp).replace("|", "or")
        about = " ".join(str(field.metadata.get("doc", "")).split()).replace("|", "\\|")
        out.append(f"| `{key}` | {kind} | {_default(field)} | {about} |")
    for tp, key in nested:
        out.append(f"\n## `{key}`\n\n{(tp.__doc__ or '').strip().splitlines()[0]}\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        _rows(tp, key + ".", out)


def reference() -> str:
    """The page's text."""
    out = [HEADER]
    for field in dataclasses.fields(RLHFConfig):
        tp = typing.get_type_hints(RLHFConfig)[field.name]
        out.append(f"## `{field.name}`\n\n{(tp.__doc__ or '').strip().splitlines()[0]}\n")
        out.append("| key | type | default | meaning |\n|---|---|---|---|")
        _rows(tp, field.name + ".", out)
        out.append("")
    text = "\n".join(out)
    empty = "| key | type | default | meaning |\n|---|---|---|---|\n\n"  # a section of sections
    return text.replace(empty, "").rstrip() + "\n"


if __name__ == "__main__":
    print(reference(), end="")

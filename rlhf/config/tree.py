"""Dotted-key access to the nested dict of a config file and its overrides, before it is
type-checked (`rlhf.config.verl_keys`, `rlhf.config.verl_sections`)."""

from __future__ import annotations

from typing import Any

MISSING = object()


def get(tree: dict, key: str) -> Any:
    """The value at dotted `key`, or `MISSING`."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def pop(tree: dict, key: str) -> None:
    """Remove dotted `key` (which exists), and each section that removal leaves empty."""
    parent, _, leaf = key.rpartition(".")
    node = get(tree, parent) if parent else tree
    node.pop(leaf)
    if parent and not node:
        pop(tree, parent)


def put(tree: dict, key: str, value: Any) -> None:
    """Set dotted `key`, creating the sections on its way."""
    node = tree
    for part in key.split(".")[:-1]:
        node = node.setdefault(part, {})
    node[key.rsplit(".", 1)[-1]] = value

"""YAML file + dotted `key=value` overrides -> a typed, checked `RLHFConfig`.

Every error is a `ConfigError` (a `ValueError`) whose message names the full dotted key;
the command-line entry points print it as one line and exit non-zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlhf.config.schema import RLHFConfig


class ConfigError(ValueError):
    """A config the run cannot use; the message names the offending key(s)."""


@dataclasses.dataclass(frozen=True)
class _OverrideText:
    """A value given on the command line, parsed only once its target type is known."""

    text: str


def all_keys(cls: type = RLHFConfig, prefix: str = "") -> list[str]:
    """Every leaf key of the tree as a dotted path."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            keys.extend(all_keys(hints[f.name], path + "."))
        else:
            keys.append(path)
    return keys


def mapping_keys(cls: type = RLHFConfig, prefix: str = "") -> list[str]:
    """Keys whose value is a free mapping: `key.name=value` overrides set one entry."""
    hints = typing.get_type_hints(cls)
    found = []
    for f in dataclasses.fields(cls):
        tp, path = hints[f.name], f"{prefix}{f.name}"
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            found += mapping_keys(tp, path + ".")
        elif typing.get_origin(tp) is dict:
            found.append(path)
    return found


def nearest_key(key: str) -> str | None:
    """The valid key closest to a misspelt or misplaced `key`, if any is close."""
    keys = all_keys()
    suffix = [k for k in keys if k.endswith("." + key)]
    if suffix:
        return suffix[0]
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    if match:
        return match[0]
    leaf = key.rsplit(".", 1)[-1]
    leaves = {k.rsplit(".", 1)[-1]: k for k in keys}
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[match[0]] if match else None


def _unknown_key(path: str) -> ConfigError:
    near = nearest_key(path)
    hint = f"; did you mean '{near}'?" if near else ""
    return ConfigError(f"unknown config key '{path}'{hint}")


def parse_override(item: str) -> tuple[str, _OverrideText]:
    """Split `a.b.c=value` into the key and its unparsed value."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. data.seed=3)")
    return key, _OverrideText(value.strip())


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(parts[: i + 1])}' is a value, cannot set '{key}'")
        node = child
    node[parts[-1]] = value


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{_type_name(typing.get_args(tp)[0])}]"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def _parse_text(text: str, tp: Any) -> Any:
    """Command-line text -> Python value: raw text for str keys, YAML scalars/lists otherwise."""
    if tp is str:
        return text
    if text == "" and tp is not Any:
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _finite_float(value: Any, path: str) -> float:
    """A float key's value; ints and YAML-1.1 strings such as "1e-3" convert.

    NaN and inf are refused: no key takes them (a limit is switched off with null or 0, as
    its doc says), and Megatron would stop on a bare assertion long after startup."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            value = float(value)  # YAML 1.1 reads "1e-3" as a string
    if isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, float):
        raise ConfigError(f"{path}: expected float, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{path}: must be a finite number, got {value!r}")
    return value


def _coerce(value: Any, tp: Any, path: str) -> Any:
    """Check `value` against the annotation `tp`, converting only lossless cases."""
    if isinstance(value, _OverrideText):
        value = _parse_text(value.text, tp)
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None and len(args) < len(typing.get_args(tp)):
            return None
        if len(args) == 1:
            return _coerce(value, args[0], path)  # keeps the inner error (e.g. a list item)
        for arg in args:
            try:
                return _coerce(value, arg, path)
            except ConfigError:
                continue
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        return value
    if origin is dict:  # a free mapping (e.g. engine_kwargs.sglang), checked by its user
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, Any, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        return _finite_float(value, path)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}")
    return value


def _check_range(value: Any, meta: typing.Mapping, path: str) -> None:
    if value is None:
        return
    bounds = [("gt", ">", lambda v, b: v > b), ("ge", ">=", lambda v, b: v >= b)]
    bounds += [("lt", "<", lambda v, b: v < b), ("le", "<=", lambda v, b: v <= b)]
    for name, sign, ok in bounds:
        if name in meta and not ok(value, meta[name]):
            raise ConfigError(f"{path}: must be {sign} {meta[name]}, got {value!r}")


def build(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the config"
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(f"{prefix}{key}")
    kwargs = {}
    for name, value in data.items():
        path, tp = f"{prefix}{name}", hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = build(tp, value, path + ".")
        else:
            kwargs[name] = _coerce(value, tp, path)
            _check_range(kwargs[name], fields[name].metadata, path)
    return cls(**kwargs)


_REF = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _lookup(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _resolve_references(cfg: RLHFConfig) -> None:
    """Replace `${a.b}` in string values by the referenced key's value (one level)."""
    keys = set(all_keys())
    for key in keys:
        value = _lookup(cfg, key)
        if not isinstance(value, str) or "${" not in value:
            continue

        def substitute(m: re.Match, key: str = key) -> str:
            ref = m.group(1)
            if ref not in keys:
                raise ConfigError(f"{key}: references unknown key '${{{ref}}}'")
            return str(_lookup(cfg, ref))

        parent, _, leaf = key.rpartition(".")
        setattr(_lookup(cfg, parent), leaf, _REF.sub(substitute, value))


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RLHFConfig:
    """Read YAML `path` (optional), apply `key=value` overrides, type-check and validate ranges."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            tree = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    keys = set(all_keys())
    mappings = mapping_keys()
    for item in overrides or []:
        key, value = parse_override(item)
        if key not in keys and not any(key.startswith(m + ".") for m in mappings):
            raise _unknown_key(key)
        _set_dotted(tree, key, value)
    cfg = build(RLHFConfig, tree)
    _resolve_references(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts (for YAML/JSON output)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML, in schema order."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)

"""YAML file + dotted `key=value` overrides -> a typed, checked `RLHFConfig`.

Every error is a `ConfigError` (a `ValueError`) whose message names the full dotted key;
the command-line entry points print it as one line and exit non-zero.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import math
import os
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from rlhf.config.choices import TrainDtype
from rlhf.config.inherit import inherit
from rlhf.config.schema import RLHFConfig
from rlhf.config.verl_keys import VERL_KEYS, VERL_SECTIONS, VerlKeyError, translate
from rlhf.config.yaml_file import load_text, read_yaml
from rlhf.errors import UserError


class ConfigError(ValueError, UserError):
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


def default_of(key: str) -> Any:
    """The schema's default of a dotted leaf key."""
    node: Any = RLHFConfig()
    for part in key.split("."):
        node = getattr(node, part)
    return node


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


def _similar(a: str, b: str, cutoff: float) -> bool:
    return difflib.SequenceMatcher(None, a, b).ratio() >= cutoff


def _leaf_matches(unknown: str, leaf: str) -> bool:
    """A misspelling of `leaf`, or every word of `unknown` (nearly) a word of `leaf`: word
    by word, so `expert_model_parallel_size` is not taken for `pipeline_model_parallel_size`."""
    if _similar(unknown, leaf, 0.85):
        return True
    words = leaf.split("_")
    return all(any(_similar(w, v, 0.8) for v in words) for w in unknown.split("_"))


def _shared_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _plausible(parts: list[str], candidate: list[str]) -> bool:
    """Whether `candidate` (a key's path) can be what `parts` meant: its leaf matches word by
    word, and a key of another section only when the match says more than one generic word
    (`critic.profiler.enable` is not `algorithm.filter_groups.enable`, `global_profiler.tool`
    not `...multi_turn.tool_timeout_s`; `actor.checkpoint.async_save` is `trainer.async_save`):
    the whole leaf of two words or more, or the section holding it too."""
    leaf, other = parts[-1], candidate[-1]
    if not _leaf_matches(leaf, other):
        return False
    if len(parts) == 1 or _shared_prefix(parts[:-1], candidate[:-1]) > 0:
        return True
    if "_" in leaf and _similar(leaf, other, 0.85):
        return True
    return len(candidate) > 1 and _leaf_matches(parts[-2], candidate[-2])


def nearest_key(key: str, schema: type = RLHFConfig) -> str | None:
    """The valid key of `schema` a misspelt or misplaced `key` most likely means, if any: a
    key it is the end of, else the keys whose leaf matches word by word (`_plausible`),
    ranked by the path they share."""
    keys = all_keys(schema)
    suffix = [k for k in keys if k.endswith("." + key)]
    if suffix:
        return suffix[0]
    parts = key.split(".")
    candidates = [k for k in keys if _plausible(parts, k.split("."))]
    if not candidates:
        return None

    def rank(candidate: str) -> tuple[int, float]:
        path = candidate.split(".")
        shared = _shared_prefix(parts[:-1], path[:-1])
        return shared, difflib.SequenceMatcher(None, key, candidate).ratio()

    return max(candidates, key=rank)


def _unknown_key(path: str, schema: type = RLHFConfig) -> ConfigError:
    near = nearest_key(path, schema)
    hint = (
        f"; did you mean '{near}'?"
        if near
        else "; no setting here is near it (rlhf-train --print-config lists them all; "
        "docs/from-verl.md says what each of verl's keys is here)"
    )
    return ConfigError(f"unknown config key '{path}'{hint}")


def parse_override(item: str) -> tuple[str, _OverrideText]:
    """Split `a.b.c=value` into the key and its unparsed value; Hydra's `+key=value` and
    `++key=value` (add or force a key, as verl scripts write them) set the key too."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if key.startswith("~"):
        raise ConfigError(
            f"override '{item}': removing a key (~key) is not supported; set it to null or "
            "its default instead"
        )
    key = key.lstrip("+")
    if not sep or not key:
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. data.seed=3)")
    return key, _OverrideText(value.strip())


_ENV = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")


def _expand_env(node: Any, path: str = "") -> Any:
    """`${oc.env:VAR}` and `${oc.env:VAR,default}` (OmegaConf's syntax) in every string of
    the tree replaced by the environment's value; the result is parsed as the key's type."""
    if isinstance(node, dict):
        return {k: _expand_env(v, f"{path}{k}.") for k, v in node.items()}
    if isinstance(node, list):
        return [_expand_env(v, f"{path.rstrip('.')}[{i}].") for i, v in enumerate(node)]
    text = node.text if isinstance(node, _OverrideText) else node
    if not isinstance(text, str) or "${oc.env:" not in text:
        return node

    def value(m: re.Match) -> str:
        name, default = m.group(1), m.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is None:
            raise ConfigError(
                f"{path.rstrip('.')}: environment variable {name} is not set and "
                f"${{oc.env:{name}}} gives no default (${{oc.env:{name},DEFAULT}})"
            )
        return default.strip().strip("'\"")

    return _OverrideText(_ENV.sub(value, text))


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"'{'.'.join(parts[: i + 1])}' is a value, cannot set '{key}'")
        node = child
    node[parts[-1]] = value


def type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(c) for c in typing.get_args(tp))
    if origin in (types.UnionType, typing.Union):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
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
        return load_text(text)
    except yaml.YAMLError:
        return text


def _parse_as(value: Any, example: Any) -> Any:
    """A tree value as the type of `example` (command-line text parsed; YAML values as they
    are): how `rlhf.config.verl_keys` compares values."""
    if isinstance(value, _OverrideText):
        return _parse_text(value.text, type(example) if isinstance(example, str) else Any)
    return value


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
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}")
    if origin is typing.Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}")
        return value
    if origin is dict:  # a free mapping (e.g. engine_kwargs.sglang), checked by its user
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _coerce(v, Any, f"{path}.{k}") for k, v in value.items()}
    if tp is Any:
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if tp is float:
        return _finite_float(value, path)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}")
    return value


def _check_range(value: Any, meta: typing.Mapping, path: str) -> None:
    if value is None:
        return
    bounds = [("gt", ">", lambda v, b: v > b), ("ge", ">=", lambda v, b: v >= b)]
    bounds += [("lt", "<", lambda v, b: v < b), ("le", "<=", lambda v, b: v <= b)]
    for name, sign, ok in bounds:
        if name in meta and not ok(value, meta[name]):
            raise ConfigError(f"{path}: must be {sign} {meta[name]}, got {value!r}")


def build(
    cls: type, data: Any, prefix: str = "", root: type | None = None, base: Any = None
) -> Any:
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types;
    `root`: the whole config's schema (`cls` itself at the top), where the nearest key of a
    misspelt one is looked for; `base`: the instance whose values the keys the dict lacks
    keep (a section's own default: `critic.model` given one key keeps its path
    `${actor_rollout_ref.model.path}`, not ModelConfig's empty one)."""
    root = root or cls
    if not isinstance(data, dict):
        where = prefix.rstrip(".") or "the config"
        raise ConfigError(f"{where}: expected a mapping of keys, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            raise _unknown_key(f"{prefix}{key}", root)
    kwargs = {}
    for name, value in data.items():
        path, tp = f"{prefix}{name}", hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            default = getattr(base, name) if base is not None else _default_of(fields[name])
            kwargs[name] = build(tp, value, path + ".", root, default)
        else:
            kwargs[name] = _coerce(value, tp, path)
            _check_range(kwargs[name], fields[name].metadata, path)
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def _default_of(field: dataclasses.Field) -> Any:
    """A dataclass field's default value (None: it has none)."""
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None if field.default is dataclasses.MISSING else field.default


_REF = re.compile(r"\$\{([A-Za-z0-9_.]+)\}")


def _lookup(cfg: Any, dotted: str) -> Any:
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _resolve_references(cfg: Any) -> None:
    """Replace `${a.b}` in string values by the referenced key's value (one level)."""
    keys = set(all_keys(type(cfg)))
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


def _on_gpu(device: str) -> bool:
    """trainer.device as the run will take it ('auto': a GPU when one is visible)."""
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def resolve_unset(cfg: Any) -> Any:
    """Values the schema leaves unset until the run's device is known: every Megatron
    layout's null `dtype` is bfloat16 on GPUs (verl's) and float32 on the CPU."""
    from rlhf.config.schema import MegatronParallelConfig

    trainer = getattr(cfg, "trainer", None)
    gpu = trainer is not None and _on_gpu(trainer.device)
    dtype: TrainDtype = "bfloat16" if gpu else "float32"

    def visit(node: Any) -> None:
        if isinstance(node, MegatronParallelConfig) and node.dtype is None:
            node.dtype = dtype
        for field in dataclasses.fields(node):
            child = getattr(node, field.name)
            if dataclasses.is_dataclass(child):
                visit(child)

    visit(cfg)
    return cfg


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, schema: type = RLHFConfig
) -> Any:
    """Read YAML `path` (optional), apply `key=value` overrides, type-check and validate ranges.

    The file is read strictly (`rlhf.config.yaml_file.read_yaml`): anchors, aliases and a
    key given twice are refused, as are a directory and a file that is not UTF-8 text.

    `schema`: the config tree (`RLHFConfig` for rlhf-train; rlhf-train-rm has its own,
    `rlhf.config.reward_training`); verl's key names are translated for `RLHFConfig` only.
    A Hydra file (a `defaults:` list) is composed by `rlhf.config.hydra_load.load_with_notes`."""
    tree: dict = {}
    if path is not None:
        path = Path(path)
        try:
            tree = read_yaml(path, "config file") or {}
        except (OSError, ValueError) as e:  # one line each (rlhf.config.yaml_file)
            raise ConfigError(str(e)) from None
        if not isinstance(tree, dict):
            raise ConfigError(f"{path}: top level must be a mapping of sections")
    keys = set(all_keys(schema))
    mappings = mapping_keys(schema)
    verl = schema is RLHFConfig
    for item in overrides or []:
        key, value = parse_override(item)
        known = key in keys or (verl and (key in VERL_KEYS or key.startswith(VERL_SECTIONS)))
        if not known and not any(key.startswith(m + ".") for m in mappings):
            raise _unknown_key(key, schema)
        _set_dotted(tree, key, value)
    tree = _expand_env(tree)
    if verl:
        try:
            translate(tree, _parse_as, default_of)
        except VerlKeyError as e:
            raise ConfigError(str(e)) from None
        inherit(tree)
    cfg = resolve_unset(build(schema, tree))
    _resolve_references(cfg)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """The config as plain nested dicts (for YAML/JSON output)."""
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Any) -> str:
    """The resolved config as YAML, in schema order."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)

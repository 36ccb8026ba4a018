"""A Hydra-composed config (verl's `--config-path/--config-name`) -> the nested dict the loader
type-checks, and the keys of it this system ignores.

Hydra's command-line grammar on the composed tree: `key=value` and `++key=value` set,
`+key=value` adds (refused when the files already have the key), `~key` / `~key=value`
deletes, `group=option` / `group@pkg=option` / `~group` choose a defaults-list option
(`rlhf.config.compose`). Interpolations (`${a.b}`, `${..x}`, `${oc.select:...}`,
`${oc.env:...}`) are resolved by OmegaConf after the overrides, as Hydra does.

Who set a key decides what an unsupported one does. The files are verl's defaults: a key this
system has no setting for, or a value `rlhf.config.verl_keys` would refuse, is listed as
ignored (`rlhf-train --print-config` prints the list). A key the user set on the command
line is refused in one line, unless it is one of the files' keys set to the files' value.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlhf.config.compose import VERL_TRAINER_CONFIGS, ComposeError, compose, leaves
from rlhf.config.inherit import CRITIC_FROM_ACTOR, inherit
from rlhf.config.loader import (
    ConfigError,
    _OverrideText,
    _parse_as,
    _resolve_references,
    _unknown_key,
    all_keys,
    build,
    default_of,
    load_config,
    mapping_keys,
    resolve_unset,
)
from rlhf.config.schema import RLHFConfig
from rlhf.config.tree import MISSING, get, pop, put
from rlhf.config.verl_keys import VERL_KEYS, VERL_SECTIONS, Alias, VerlKeyError, translate
from rlhf.config.yaml_file import load_text, read_yaml

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A checked config, and the keys of its composed files that this system ignores: one
    line each, `key=value: why` (empty for a plain file, whose every key is read)."""

    config: Any
    ignored: list[str]


def load_with_notes(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    schema: type = RLHFConfig,
    *,
    config_dir: str | Path | None = None,
    config_name: str | None = None,
) -> Loaded:
    """The config, and the keys of a Hydra-composed one that are ignored (with why).

    `config_dir` + `config_name` (Hydra's --config-path/--config-name), or a file `path` whose
    top level has a `defaults:` list or a `hydra:` section, is composed as Hydra composes it;
    any other file is read as it is (`rlhf.config.loader.load_config`)."""
    if config_name is None and path is not None and Path(path).is_file():
        with contextlib.suppress(OSError, ValueError):
            top = read_yaml(path, "config file")
            if isinstance(top, dict) and ("defaults" in top or "hydra" in top):
                config_dir, config_name = Path(path).parent, Path(path).name
    if config_name is None:
        return Loaded(load_config(path, overrides, schema), [])
    cfg, ignored = load_composed(Path(config_dir or "."), config_name, overrides or [], schema)
    _resolve_references(cfg)
    return Loaded(cfg, ignored)


def load_command_line(
    config: str | None, config_path: str | None, config_name: str | None, overrides: list[str]
) -> Loaded:
    """What `rlhf-train`'s command line names: `--config FILE`, or Hydra's
    `--config-path/--config-name`. verl's trainer configs, when the directory does not hold
    them (verl's scripts name verl's package directory), are this system's defaults."""
    if config_name is None:
        if config_path is not None:
            raise ConfigError("--config-path needs --config-name (the config to compose)")
        return load_with_notes(config, overrides)
    if config is not None:
        raise ConfigError("give --config FILE or --config-path/--config-name, not both")
    root, name = Path(config_path or "."), config_name.removesuffix(".yaml")
    if (root / f"{name}.yaml").is_file():
        return load_with_notes(None, overrides, config_dir=root, config_name=name)
    if name in VERL_TRAINER_CONFIGS:
        log.info("%s not found: this system's defaults stand in for verl's", root / f"{name}.yaml")
        return load_with_notes(None, overrides)
    raise ConfigError(f"config file {root / name}.yaml does not exist (--config-name {name})")


def parse_hydra_override(item: str) -> tuple[str, str, str | None]:
    """`(op, key, text)`: op one of `set` (key=v), `add` (+key=v), `force` (++key=v),
    `delete` (~key, ~key=v; text None without a value)."""
    key, sep, text = item.partition("=")
    key = key.strip()
    op = "set"
    for prefix, name in (("++", "force"), ("+", "add"), ("~", "delete")):
        if key.startswith(prefix):
            op, key = name, key[len(prefix) :]
            break
    if not key or (not sep and op != "delete"):
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. data.seed=3)")
    return op, key, (text.strip() if sep else None)


def _is_group(root: Path, key: str) -> bool:
    return "@" in key or (root / key.lstrip("/")).is_dir()


def _split(root: Path, overrides: list[str]) -> tuple[dict[str, Any], list[tuple]]:
    """Group choices (for the composition) and the value overrides, in order."""
    choices: dict[str, Any] = {}
    values = []
    for item in overrides:
        op, key, text = parse_hydra_override(item)
        if _is_group(root, key):
            choices[key.strip("/")] = None if op == "delete" else load_text(text or "null")
        else:
            values.append((op, key, text, item))
    return choices, values


class _Known:
    """Whether a key is this system's (or a verl key `rlhf.config.verl_keys` translates)."""

    def __init__(self, schema: type):
        self.keys = set(all_keys(schema))
        self.mappings = mapping_keys(schema)
        self.verl = schema.__name__ == "RLHFConfig"

    def __call__(self, key: str) -> bool:
        if key in self.keys or any(key == m or key.startswith(m + ".") for m in self.mappings):
            return True
        return self.verl and (key in VERL_KEYS or key.startswith(VERL_SECTIONS))


def _value(text: str) -> Any:
    try:
        return load_text(text)
    except Exception:  # not YAML: the text itself, as Hydra reads it
        return text


def _apply(tree: dict, values: list[tuple], known: _Known, origin: dict, where: str) -> None:
    for op, key, text, item in values:
        present = get(tree, key) is not MISSING
        if op == "delete":
            if not present:
                raise ConfigError(f"override '{item}': {key} is not in the config ({where})")
            if text is not None and get(tree, key) != _value(text):
                raise ConfigError(f"override '{item}': {key} is {get(tree, key)!r}, not {text}")
            pop(tree, key)
            continue
        if op == "add" and present:
            raise ConfigError(
                f"override '{item}': {key} is already in the config (from "
                f"{origin.get(key, where)}); set it with {key}=... or ++{key}=..."
            )
        if not present and not known(key):
            raise _unknown_key(key)
        put(tree, key, _value(text))


def _resolve(tree: dict, origin: dict, where: str) -> dict:
    """OmegaConf's interpolations resolved, each error one line naming the key and file."""
    try:
        resolved = OmegaConf.to_container(OmegaConf.create(tree), resolve=True)
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", "") or "the config"
        message = " ".join(str(e).splitlines()[0].split())
        raise ConfigError(f"{key}: {message} (from {origin.get(key, where)})") from None
    assert isinstance(resolved, dict)  # a mapping stays one
    return resolved


def load_composed(
    root: Path, name: str, overrides: list[str], schema: type
) -> tuple[Any, list[str]]:
    """The composed config `name` of `root` with `overrides`, verl's keys translated: the
    checked config (references not yet resolved), and the ignored keys (`key=value: why`)."""
    choices, values = _split(root, overrides)
    try:
        composition = compose(root, name, choices)
    except (ComposeError, OSError, ValueError) as e:
        raise ConfigError(str(e)) from None
    where = str(root / (name if name.endswith(".yaml") else name + ".yaml"))
    files = OmegaConf.to_container(composition.tree)
    assert isinstance(files, dict)  # the composed tree is a mapping
    ignored = [f"hydra: Hydra's own settings (from {where})"] if files.pop("hydra", None) else []
    ignored += [
        f"{name}: verl's trainer config, in no directory of the search path: this system's "
        "defaults stand in (verl's)"
        for name in composition.stand_ins
    ]
    tree, known, origin = copy.deepcopy(files), _Known(schema), composition.origin
    _apply(tree, values, known, origin, where)
    tree = _resolve(tree, origin, where)
    defaults = _resolve(files, origin, where)
    user = [key for op, key, _, _ in values if op != "delete"]
    for op, key, text, _ in values:  # command-line text is parsed as the key's type
        if op != "delete" and "${" not in text:
            put(tree, key, _OverrideText(text))
    on_command_line = _ByUser(user)
    by_user = _ByUser(user, origin, composition.verl_files)
    for key in leaves(tree):
        if not known(key):
            ignored.append(_unknown(tree, key, on_command_line(key), defaults, origin, where))
            pop(tree, key)
    if known.verl:
        ignored += _translate(tree, by_user, origin, where)
        ignored += _inherit(tree, by_user, origin, where)
    return _build(schema, tree, by_user, origin, where, ignored), ignored


def _inherit(tree: dict, by_user: Any, origin: dict, where: str) -> list[str]:
    """The critic keys the user did not set take the actor's values (`rlhf.config.inherit`):
    verl's files give the critic a layout of its own (TP 1 whatever the actor's), which one
    shared layout cannot follow; the ignored lines of those that differed."""
    ignored = []
    for key, source in CRITIC_FROM_ACTOR.items():
        value = get(tree, key)
        if value is MISSING or by_user(key):
            continue
        pop(tree, key)
        actor = get(tree, source)
        if actor is not MISSING and _shown(actor) != _shown(value):
            ignored.append(
                f"{key}={_shown(value)}: the critic takes the actor's ({_shown(actor)}) "
                f"(from {origin.get(key, where)})"
            )
    inherit(tree)
    return ignored


def _build(schema: type, tree: dict, by_user: Any, origin: dict, where: str, ignored: list) -> Any:
    """`build`, with a value from the files this system's key refuses (verl's -1 for "unset",
    say) ignored: the key keeps this system's default."""
    while True:
        try:
            cfg = resolve_unset(build(schema, copy.deepcopy(tree)))
            _check(cfg)
            return cfg
        except ConfigError as e:
            key = _named(str(e), tree)
            if key is None or by_user(key):
                if "cfg" in locals():  # a later rule: the caller validates with the world size
                    return cfg
                raise
            ignored.append(f"{e} (from {origin.get(key, where)}; ignored, the default stands)")
            pop(tree, key)


class _ByUser:
    """Whether the command line set a key (or a section holding it), or, given `origin` and
    `verl_files`, a config file that is not verl's trainer config or one it includes (the
    user's own, such as verl's multi-turn examples: their keys are held to every rule)."""

    def __init__(self, keys: list[str], origin: dict | None = None, verl_files: Any = ()):
        self.keys, self.origin, self.verl_files = keys, origin or {}, set(verl_files)

    def __call__(self, key: str) -> bool:
        if any(key == k or key.startswith(k + ".") or k.startswith(key + ".") for k in self.keys):
            return True
        return key in self.origin and self.origin[key] not in self.verl_files


def _shown(value: Any) -> str:
    return str(getattr(value, "text", value))


def _unknown(tree: dict, key: str, by_user: bool, defaults: dict, origin: dict, where: str) -> str:
    """The ignored line of a key this system has no setting for, or the refusal."""
    value = get(tree, key)
    if not by_user:
        return f"{key}={_shown(value)}: no such setting here (from {origin.get(key, where)})"
    default = get(defaults, key)
    if default is MISSING:
        raise _unknown_key(key)
    if _parse_as(value, default) != default:
        raise ConfigError(
            f"{key}={_shown(value)}: verl's setting has no equivalent here; only its default "
            f"({default!r}, {origin.get(key, where)}) is accepted: drop the override"
        )
    return f"{key}={_shown(value)}: verl's default; no such setting here"


def _check(cfg: Any) -> None:
    """`validate_config` without a world size: a file value that breaks a rule between keys
    (verl's token budget beside fixed micro-batches) is refused here, naming its key."""
    from rlhf.config.validate import validate_config

    if type(cfg).__name__ == "RLHFConfig":
        validate_config(cfg, None)


def _translate(tree: dict, by_user: _ByUser, origin: dict, where: str) -> list[str]:
    """`translate`, with each refusal of a value from the files turned into an ignored key."""
    ignored = _reward_model_off(tree, by_user) + _aliased_twice(tree, by_user, origin, where)
    while True:
        attempt = copy.deepcopy(tree)
        try:
            translate(attempt, _parse_as, default_of)
        except VerlKeyError as e:
            key = _named(str(e), tree)
            if key is None or by_user(key):
                raise ConfigError(str(e)) from None
            ignored.append(f"{e!s} (from {origin.get(key, where)}; ignored)")
            pop(tree, key)
            continue
        tree.clear()
        tree.update(attempt)
        return ignored


def _aliased_twice(tree: dict, by_user: _ByUser, origin: dict, where: str) -> list[str]:
    """A key and its verl alias both in the tree with different values, not both set by the
    user (verl's files hold FSDP's `model.lora_rank` beside Megatron's `model.lora.rank`):
    the one the user set wins, else verl's name (what verl's workers of that trainer config
    read); the other is dropped, as an ignored line."""
    ignored = []
    for key, rule in VERL_KEYS.items():
        if not isinstance(rule, Alias):
            continue
        mine, verls = get(tree, rule.target), get(tree, key)
        if mine is MISSING or verls is MISSING or _shown(mine) == _shown(verls):
            continue
        if by_user(key) and by_user(rule.target):
            continue  # `translate` refuses both
        drop, kept = (key, rule.target) if by_user(rule.target) else (rule.target, key)
        ignored.append(
            f"{drop}={_shown(get(tree, drop))}: {kept} sets it (from {origin.get(drop, where)})"
        )
        pop(tree, drop)
    return ignored


def _reward_model_off(tree: dict, by_user: _ByUser) -> list[str]:
    """verl's files' reward-model settings while `reward_model.enable` is off: dropped in one
    ignored line (the reward manager's keys stay: they score the rule rows either way)."""
    section = tree.get("reward_model")
    if not isinstance(section, dict) or _parse_as(section.get("enable", False), True) is True:
        return []
    keep = ("enable", "reward_manager", "reward_kwargs")  # and what is under them
    dropped = [
        key
        for key in leaves(tree, "")
        if key.startswith("reward_model.") and key.split(".")[1] not in keep and not by_user(key)
    ]
    for key in dropped:
        pop(tree, key)
    if not dropped:
        return []
    return [f"reward_model.* ({len(dropped)} keys of verl's files): verl's reward model is off"]


def _named(message: str, tree: dict) -> str | None:
    """The key of `tree` a refusal starts with (the longest)."""
    found = [
        k for k in leaves(tree) if message.startswith(k) and message[len(k) : len(k) + 1] in ":= ("
    ]
    return max(found, key=len) if found else None


_NO_SETTING = re.compile(
    r"(?P<key>[^=]+)=(?P<value>.*): no such setting here \(from (?P<file>.+)\)"
)


def grouped(ignored: list[str]) -> list[str]:
    """The ignored lines with the keys this system has no setting for grouped by section
    and file (verl's trainer config gives some 470 of them): one line each."""
    groups: dict[tuple[str, str], list[str]] = {}
    out = []
    for line in ignored:
        found = _NO_SETTING.fullmatch(line)
        if found is None:
            out.append(line)
            continue
        section, _, leaf = found["key"].rpartition(".")
        groups.setdefault((section, found["file"]), []).append(f"{leaf}={found['value']}")
    for (section, file), items in groups.items():
        out.append(f"{section}.{{{', '.join(items)}}}: no such setting here (from {file})")
    return out

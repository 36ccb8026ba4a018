"""Hydra's defaults lists, composed the way Hydra 1.3 composes them, with OmegaConf merging.

verl's trainer configs (`ppo_megatron_trainer.yaml` and the files its `defaults:` list names)
are Hydra configs. hydra-core itself is not a dependency: it pins antlr4-python3-runtime 4.9,
under which math-verify grades answers differently (docs/from-verl.md). OmegaConf, which Hydra
merges and interpolates with, is; this module is the part of Hydra between the two: which
files, in which order, under which package.

The forms of a defaults list handled (Hydra's semantics):

- `- group: option` / `- group@pkg: option`: the file `group/option.yaml`, the group path
  relative to the containing file's directory (`../optim`), absolute with a leading `/`;
  `option` may be a list (each merged) or null (the entry is skipped).
- `- name` / `- name@pkg`: the config `name.yaml` next to the containing file.
- `optional group: option`: skipped when the file does not exist.
- `override group: option`: changes the option of that group's entry.
- `_self_`: where the containing file's own values are merged; without it, after its
  defaults (Hydra 1.1 and later: the file's values win).
- packages: relative to the containing config's; by default the group path (`_group_`);
  a `# @package` header line sets a file's own (`_global_`: the root).

Command-line choices (`group=option`, `group@pkg=option`, `~group`) are given as `choices`.
Every error is one line naming the file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlhf.config.yaml_file import StrictLoader, read_yaml

SELF = "_self_"
_HEADER = re.compile(r"^#\s*@package\s+(\S+)\s*$")


class ComposeError(ValueError):
    """A defaults list that cannot be composed; the message is one line naming the file."""


class HydraLoader(StrictLoader):
    """`StrictLoader` that reads `1e-6` as a float, as OmegaConf's YAML loader (and so
    Hydra) does; YAML 1.1 reads a float without a dot as a string."""


HydraLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


@dataclass
class Entry:
    """One item of a defaults list: a group choice, a config, or `_self_`."""

    group: str | None  # the group path as written (None: a config entry or _self_)
    name: Any  # option (str, list or None) of a group, the config's path otherwise
    package: str | None  # `@pkg` as written
    optional: bool = False
    override: bool = False

    @property
    def is_self(self) -> bool:
        return self.group is None and self.name == SELF


@dataclass
class Composition:
    """The merged tree, and which file gave each leaf its value (for error messages)."""

    tree: DictConfig = field(default_factory=lambda: OmegaConf.create({}))
    origin: dict[str, str] = field(default_factory=dict)
    choices: dict[str, Any] = field(default_factory=dict)  # group key -> option (command line)
    used: set[str] = field(default_factory=set)  # the choice keys some entry matched
    stand_ins: list[str] = field(default_factory=list)  # verl trainer configs not found
    verl_files: set[str] = field(default_factory=set)  # verl's trainer configs and includes


# verl's trainer configs, which its example configs include from verl's package: where no
# directory of the search path holds them, this system's defaults stand in (verl's defaults)
VERL_TRAINER_CONFIGS = ("ppo_megatron_trainer", "ppo_trainer")


def parse_entry(item: Any, where: Path) -> Entry:
    """A defaults-list item as written in `where`."""
    if isinstance(item, str):
        path, _, package = item.partition("@")
        return Entry(None, path.strip(), package.strip() or None)
    if isinstance(item, dict) and len(item) == 1:
        ((key, option),) = item.items()
        words = str(key).split()
        flags, spec = words[:-1], words[-1] if words else ""
        if set(flags) - {"optional", "override"} or len(flags) > 1 or not spec:
            raise ComposeError(
                f"{where}: defaults entry {item!r}: expected "
                "[optional|override] GROUP[@PKG]: OPTION"
            )
        group, _, package = spec.partition("@")
        if not (option is None or isinstance(option, str | list)):
            raise ComposeError(
                f"{where}: defaults entry {item!r}: the option must be a config name, "
                "a list or null"
            )
        return Entry(group, option, package or None, "optional" in flags, "override" in flags)
    raise ComposeError(
        f"{where}: defaults entry {item!r} is not 'NAME', 'GROUP: OPTION' or '_self_'"
    )


def _join(parent: str, package: str) -> str:
    """Hydra's final package: relative to the parent's, `_global_` restarting at the root."""
    full = f"{parent}.{package}" if parent and package else parent or package
    at = full.rfind("_global_")
    return full if at < 0 else full[at + len("_global_") + 1 :]


def _header_package(path: Path) -> str | None:
    """The `# @package X` line among the file's leading comment lines, if any."""
    for line in path.read_text(encoding="utf-8-sig").splitlines():
        if not line.startswith("#"):
            return None
        match = _HEADER.match(line)
        if match:
            return match.group(1)
    return None


def _group_path(group: str, here: str) -> str:
    """`group` (relative to the directory `here` of the containing config) from the root."""
    if group.startswith("/"):
        return group.strip("/")
    parts = [p for p in f"{here}/{group}".split("/") if p and p != "."]
    out: list[str] = []
    for part in parts:
        if part == "..":
            if out:
                out.pop()
        else:
            out.append(part)
    return "/".join(out)


class Composer:
    """Composes the config `name` of the directory `root` (Hydra's `--config-path`)."""

    def __init__(self, root: Path, choices: dict[str, Any] | None = None):
        self.root = root
        self.search = [root]  # then the primary config's hydra.searchpath (file:// entries)
        self._in_verl = False  # loading verl's trainer config or a file it includes
        self.result = Composition(choices=dict(choices or {}))

    def compose(self, name: str) -> Composition:
        primary = self.root / (name if name.endswith(".yaml") else name + ".yaml")
        if not primary.is_file():
            raise ComposeError(f"config file {primary} does not exist")
        top = read_yaml(primary, "config file", HydraLoader)
        hydra = top.get("hydra") if isinstance(top, dict) else None
        paths = hydra.get("searchpath", []) if isinstance(hydra, dict) else []
        for item in paths if isinstance(paths, list) else []:
            if isinstance(item, str) and item.startswith("file://"):  # pkg:// is a package's
                self.search.append(Path(item.removeprefix("file://")))
        self._load(primary, "", "", None, "")
        unused = sorted(set(self.result.choices) - self.result.used)
        if unused:
            raise ComposeError(
                f"{primary}: '{unused[0]}' is not a group of its defaults list, so "
                f"'{unused[0]}={self.result.choices[unused[0]]}' chooses nothing"
            )
        return self.result

    def _file_of(self, rel: str) -> Path:
        """`rel`'s file in the first directory of the search path holding it (else the
        root's, which does not exist)."""
        for root in self.search:
            if (root / f"{rel}.yaml").is_file():
                return root / f"{rel}.yaml"
        return self.root / f"{rel}.yaml"

    def _load(self, path: Path, here: str, parent: str, own: str | None, default: str) -> None:
        """Merge the config file `path` (in directory `here` under the root) under `parent`'s
        package: at `own` (the entry's `@pkg`), else its `# @package` header, else `default`."""
        data = read_yaml(path, "config file", HydraLoader)
        data = {} if data is None else data
        verl = self._in_verl or path.stem in VERL_TRAINER_CONFIGS
        if verl:
            self.result.verl_files.add(str(path))
        outer, self._in_verl = self._in_verl, verl
        try:
            self._load_entries(data, path, here, parent, own, default)
        finally:
            self._in_verl = outer

    def _load_entries(
        self, data: Any, path: Path, here: str, parent: str, own: str | None, default: str
    ) -> None:
        if not isinstance(data, dict):
            raise ComposeError(f"config file {path}: top level must be a mapping")
        header = _header_package(path)
        relative = own if own is not None else header if header is not None else default
        package = _join(parent, relative.replace("_group_", here.replace("/", ".")))
        defaults = data.pop("defaults", [])
        if not isinstance(defaults, list):
            raise ComposeError(f"config file {path}: 'defaults' must be a list")
        entries = [parse_entry(item, path) for item in defaults]
        for e in entries:  # `override group: option` changes an entry loaded below
            if e.override and e.group is not None:
                self.result.choices.setdefault(_group_path(e.group, here), e.name)
        entries = [e for e in entries if not e.override]
        if not any(e.is_self for e in entries):
            entries.append(Entry(None, SELF, None))
        for entry in entries:
            if entry.is_self:
                self._merge(data, package, path)
            elif entry.group is None:
                self._config_entry(entry, path, here, package)
            else:
                self._group_entry(entry, path, here, package)

    def _config_entry(self, entry: Entry, path: Path, here: str, package: str) -> None:
        rel = _group_path(entry.name, here)
        file = self._file_of(rel)
        if not file.is_file() and rel in VERL_TRAINER_CONFIGS:
            self.result.stand_ins.append(rel)
            return
        if not file.is_file():
            raise ComposeError(
                f"{path}: defaults entry '{entry.name}': config file {file} does not exist"
            )
        sub_here = rel.rpartition("/")[0]
        self._load(
            file, sub_here, package, entry.package, entry.name.rpartition("/")[0].replace("/", ".")
        )

    def _choice(self, entry: Entry, absolute: str, package: str) -> Any:
        for key in (f"{absolute}@{package}", absolute):
            if key in self.result.choices:
                self.result.used.add(key)
                return self.result.choices[key]
        return entry.name

    def _group_entry(self, entry: Entry, path: Path, here: str, package: str) -> None:
        assert entry.group is not None  # a group entry
        absolute = _group_path(entry.group, here)
        own = entry.package if entry.package is not None else absolute.replace("/", ".")
        option = self._choice(entry, absolute, _join(package, own.replace("_group_", absolute)))
        for name in option if isinstance(option, list) else [option] if option is not None else []:
            file = self._file_of(f"{absolute}/{name}")
            if not file.is_file():
                if entry.optional:
                    continue
                found = sorted(p.stem for p in (self.root / absolute).glob("*.yaml"))
                raise ComposeError(
                    f"{path}: group '{absolute}' has no option '{name}' ({file} does not exist; "
                    f"options: {', '.join(found) or 'none'})"
                )
            pkg = None if entry.package is None else entry.package.replace("_name_", str(name))
            self._load(file, absolute, package, pkg, absolute.replace("/", "."))

    def _merge(self, data: dict, package: str, path: Path) -> None:
        node: Any = data
        for part in reversed(package.split(".") if package else []):
            node = {part: node}
        try:
            merged = OmegaConf.merge(self.result.tree, OmegaConf.create(node))
            assert isinstance(merged, DictConfig)  # two mappings merge into one
            self.result.tree = merged
        except Exception as e:  # OmegaConf's errors are several lines
            raise ComposeError(f"config file {path}: {' '.join(str(e).split())}") from None
        for leaf in leaves(data, package):
            self.result.origin[leaf] = str(path)


def leaves(tree: Any, prefix: str = "") -> list[str]:
    """The dotted paths of the values of a nested dict (an empty dict counts as a value)."""
    if not isinstance(tree, dict) or not tree:
        return [prefix] if prefix else []
    found = []
    for key, value in tree.items():
        found += leaves(value, f"{prefix}.{key}" if prefix else str(key))
    return found


def compose(root: str | Path, name: str, choices: dict[str, Any] | None = None) -> Composition:
    """The config `name` of directory `root` with its defaults lists composed (unresolved:
    `${...}` interpolations are kept, as Hydra keeps them until the config is read)."""
    return Composer(Path(root), choices).compose(name)

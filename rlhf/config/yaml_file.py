"""The YAML files a user gives (run configs, tool configs), read strictly, every mistake one line.

PyYAML's `safe_load` accepts three things a config should not have:

- anchors and aliases (`&name`, `*name`, `<<: *name`): refused, wherever they are. Nine
  levels of nine aliases each are a few hundred bytes that expand to 9**9 values in whatever
  walks the tree (the config loader's `${oc.env:...}` pass ran 120 s and 1.7 GB on one); no
  shipped config uses them.
- a key given twice in one mapping: the second silently replaced the first; refused naming
  both lines.
- bytes that are not UTF-8 text (a binary file): one line instead of a `UnicodeDecodeError`.

A directory, a missing file and an unreadable one are one line each too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

_MERGE_TAG = "tag:yaml.org,2002:merge"


class StrictYAMLError(yaml.MarkedYAMLError):
    """A YAML feature the project refuses (an alias, a duplicated key); a `yaml.YAMLError`."""


class StrictLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses anchors, aliases and duplicated mapping keys."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        name = getattr(event, "anchor", None)
        if name is not None:
            sign = "*" if isinstance(event, yaml.AliasEvent) else "&"
            raise StrictYAMLError(
                problem=f"YAML anchors and aliases ({sign}{name}) are not accepted here; "
                "write the values out",
                problem_mark=event.start_mark,
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            _check_unique_keys(self, node)
        return super().construct_mapping(node, deep=deep)


def _check_unique_keys(loader: StrictLoader, node: yaml.MappingNode) -> None:
    first_line: dict[Any, int] = {}
    for key_node, _ in node.value:
        if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
            continue
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in first_line:
            raise StrictYAMLError(
                problem=f"key {key!r} is given twice (lines {first_line[key]} and {line}); "
                "the second would silently replace the first",
                problem_mark=key_node.start_mark,
            )
        first_line[key] = line


def load_text(text: str, loader: type[StrictLoader] = StrictLoader) -> Any:
    """`text` parsed by `loader`, `StrictLoader` or a subclass (raises `yaml.YAMLError`)."""
    return yaml.load(text, Loader=loader)


def one_line(error: yaml.YAMLError) -> str:
    """A PyYAML error (several lines, with a caret) as one line: where, then what."""
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}"
        context = f" ({error.context})" if error.context else ""
        invalid = "" if isinstance(error, StrictYAMLError) else "not valid YAML at "
        return f"{invalid}{where}: {error.problem}{context}"
    return "not valid YAML: " + " ".join(str(error).split())


def read_yaml(path: str | Path, what: str, loader: type[StrictLoader] = StrictLoader) -> Any:
    """The document of the YAML file `path`, read with `StrictLoader`.

    `what` names the file in errors ("config file", "tool config"): FileNotFoundError when
    it does not exist, ValueError (one line) for a directory, an unreadable file, bytes that
    are not UTF-8, invalid YAML, an alias or a duplicated key."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {path} is a directory, not a YAML file")
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} {path} does not exist") from None
    except OSError as e:
        raise ValueError(f"{what} {path}: cannot be read ({e.strerror})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{what} {path}: not a UTF-8 text file (byte 0x{data[e.start]:02x} at offset "
            f"{e.start}); give a YAML file"
        ) from None
    if "\x00" in text:
        raise ValueError(f"{what} {path}: a binary file (NUL bytes), not YAML")
    try:
        return load_text(text, loader)
    except yaml.YAMLError as e:
        raise ValueError(f"{what} {path}: {one_line(e)}") from None
    except RecursionError:
        raise ValueError(f"{what} {path}: nested too deeply to be a config") from None
    except ValueError as e:  # a scalar PyYAML cannot convert (an int of 5,000 digits)
        raise ValueError(f"{what} {path}: {e}") from None

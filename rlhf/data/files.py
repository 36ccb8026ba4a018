"""Data file specs (a path, a list, a glob, a URI) -> concrete files and their filesystem.

Prompt data lives on local disks for the quickstart and on HDFS or object stores on
clusters, so `data.train_files` accepts all of them. URIs go through fsspec first (it knows
hdfs, s3, gcs, memory, ... and says which package a scheme needs), then through pyarrow's
own filesystems; local paths and `file://` URIs are read directly. The returned
`DataFile.filesystem` is what `pyarrow.parquet` takes as `filesystem=` (None for local).
A spec that is no file name (unset, an empty list, a directory, a URI nothing opens) is a
`DataFileError` naming its key, a missing file a `FileNotFoundError`: the CLIs print one line.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rlhf.errors import UserError


class DataFileError(ValueError, UserError):
    """A data file spec that names no readable file (unset, empty, a directory, a URI nothing
    opens); the message names its key."""


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


@dataclass(frozen=True)
class DataFile:
    """One resolved file: the name shown in messages, the path for `filesystem`, the fs."""

    name: str
    path: str
    filesystem: Any = None  # None: local disk; else a pyarrow or fsspec filesystem

    def size(self) -> int:
        if self.filesystem is None:
            return os.path.getsize(self.path)
        if hasattr(self.filesystem, "get_file_info"):  # pyarrow filesystem
            return self.filesystem.get_file_info(self.path).size
        return self.filesystem.size(self.path)


def _as_list(spec: str | Sequence[str] | None, key: str) -> list[str]:
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        raise DataFileError(f"{key} is not set: give a Parquet path, a list, a glob or a URI")
    items = [spec] if isinstance(spec, str) else list(spec)
    if not items:
        raise DataFileError(f"{key} is an empty list: give at least one Parquet file")
    for item in items:
        if not isinstance(item, str) or not item.strip():
            raise DataFileError(f"{key}: every entry must be a non-empty path, got {item!r}")
    return items


def _local(pattern: str, key: str) -> list[DataFile]:
    path = os.path.expanduser(pattern.removeprefix("file://"))
    if glob.has_magic(path):
        matches = sorted(m for m in glob.glob(path) if not os.path.isdir(m))
        if not matches:
            raise FileNotFoundError(f"{key}: no file matches the glob {pattern!r}")
        return [DataFile(name=m, path=m) for m in matches]
    if os.path.isdir(path):
        raise DataFileError(
            f"{key}: {pattern!r} is a directory; give a file or a glob such as "
            f"{os.path.join(pattern, '*.parquet')!r}"
        )
    if not os.path.exists(path):
        raise FileNotFoundError(f"{key}: file not found: {pattern!r}")
    return [DataFile(name=pattern, path=path)]


def _fsspec_filesystem(uri: str) -> tuple[Any, str] | None:
    """(fsspec filesystem, path) or None when fsspec is absent or knows no such scheme."""
    try:
        import fsspec.core
    except ImportError:
        return None
    try:
        return fsspec.core.url_to_fs(uri)
    except ValueError:  # "Protocol not known"
        return None


def _remote(uri: str, key: str) -> list[DataFile]:
    match = _SCHEME.match(uri)
    assert match is not None, f"{uri} was classified as a URI"
    scheme = match.group(1)
    errors = []
    try:
        found = _fsspec_filesystem(uri)
    except ImportError as e:  # fsspec knows the scheme but its package is missing
        found = None
        errors.append(f"fsspec: {e}")
    if found is not None:
        fs, path = found
        paths = sorted(fs.glob(path)) if glob.has_magic(path) else [path]
        if not paths or not fs.exists(paths[0]):
            raise FileNotFoundError(f"{key}: nothing found at {uri!r}")
        return [DataFile(name=fs.unstrip_protocol(p), path=p, filesystem=fs) for p in paths]
    if glob.has_magic(uri):
        errors.append("pyarrow: globs need fsspec")
    else:
        import pyarrow.fs as pafs

        try:
            fs, path = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError) as e:  # ArrowInvalid is a ValueError
            errors.append(f"pyarrow: {str(e).splitlines()[0]}")
        else:
            if fs.get_file_info(path).type == pafs.FileType.NotFound:
                raise FileNotFoundError(f"{key}: nothing found at {uri!r}")
            return [DataFile(name=uri, path=path, filesystem=fs)]
    raise DataFileError(
        f"{key}: cannot open {uri!r} ({'; '.join(errors)}); check the URI, or install the "
        f"fsspec package for '{scheme}://' (e.g. s3fs, gcsfs, adlfs)"
    )


def resolve_files(
    spec: str | Sequence[str] | None, key: str = "data.train_files"
) -> list[DataFile]:
    """Every file named by `spec`, in the given order (globs sorted); `key` names the setting."""
    files: list[DataFile] = []
    for item in _as_list(spec, key):
        item = item.strip()
        is_uri = _SCHEME.match(item) and not item.startswith("file://")
        files.extend(_remote(item, key) if is_uri else _local(item, key))
    return files

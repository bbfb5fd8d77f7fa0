"""A `dataset` job's data on an object store: `s3://` files inside an `s3://` data root.

Only the processes that hold the store's credentials call this: the API's admission (it lists the
files a path names), a dataset check's Ray task and a rank's parent (workers/runtime/isolated.py,
workers/runtime/actors.py). The children that parse and tokenize never reach the store. The check's
child reads a copy of the matched files staged into a directory of its own, under the local rules
of workers/data/datafiles.py; its token file is then put in the store's token cache
(`<ZERO1_CHECKPOINT_URI>/datasets/tokens/<key>.bin` and its sidecar, the sidecar last), and the job
records that object's URI (DatasetSpec.token_uri). A rank's parent fetches that one object into a
private cache for its child and downloads none of the data; only when it is gone (a lifecycle rule
expired it) are the files staged again, and the child tokenizes them.

A path is a file, a prefix (every object under it with the format's extension, none with a hidden
component), or a glob whose `*`, `?` and `[...]` match within one '/'-separated component, as for
local files. Listing is bounded by datafiles.MAX_CANDIDATES objects, matching by MAX_FILES files.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from workers.config import DatasetSpec
from workers.data.datafiles import EXTENSIONS, MAX_CANDIDATES, MAX_FILES
from workers.training.storage import filesystem, join_uri, parse_uri

_MAGIC = re.compile(r"[*?[]")
_TOKEN_NAME = re.compile(r"[0-9a-f]{16,128}\.bin")


def is_remote_path(path: str | None) -> bool:
    """Whether a data path names an object (a scheme before '://') rather than a local file."""
    return path is not None and "://" in path


def remote_roots(roots: Sequence[str] | None) -> list[str]:
    """The object-store roots among `roots`, as "bucket/prefix" keys (parse_uri's rules)."""
    return [parse_uri(root)[1] for root in roots or () if is_remote_path(root)]


def resolve_objects(
    path: str, *, format: str, roots: Sequence[str] | None, fs=None, max_candidates: int = MAX_CANDIDATES
) -> list[tuple[str, int]]:
    """(key, size) of each object `path` names, sorted by key; ValueError ("data.path: ...") for a
    path outside the object-store roots, naming no file or too many, or a listing past its bound."""
    try:
        scheme, key = parse_uri(path)
    except ValueError as exc:
        raise ValueError(f"data.path: {exc}") from None
    allowed = remote_roots(roots)
    if not any(key == root or key.startswith(root + "/") for root in allowed):
        shown = [f"{scheme}://{root}" for root in allowed]
        raise ValueError(f"data.path: {path!r} is outside the object-store data roots {shown} (ZERO1_DATA_ROOTS)")
    fs = fs if fs is not None else filesystem(scheme)
    parts = key.split("/")
    first = next((i for i, part in enumerate(parts) if _MAGIC.search(part)), len(parts))
    base, pattern = "/".join(parts[:first]), parts[first:]
    if not pattern and fs.isfile(key):
        return [(key, int(fs.size(key)))]
    listing = fs.find(base, detail=True)
    if len(listing) > max_candidates:
        raise ValueError(f"data.path: {path!r} lists more than {max_candidates:,} objects; name fewer")
    found = []
    for name, info in listing.items():
        relative = name[len(base) + 1 :].split("/") if name.startswith(base + "/") else []
        if info.get("type") != "file" or not relative:
            continue
        if pattern:  # hidden names only where the component asks for one, as a local glob
            matched = len(relative) == len(pattern) and all(map(_matches, relative, pattern))
        else:
            matched = name.endswith(EXTENSIONS[format]) and not any(part.startswith(".") for part in relative)
        if matched:
            found.append((name, int(info.get("size") or 0)))
    if not found:
        raise ValueError(f"data.path: {path!r} matches no {format} files")
    if len(found) > MAX_FILES:
        raise ValueError(f"data.path: {path!r} names more than {MAX_FILES} files")
    return sorted(found)


def _matches(name: str, part: str) -> bool:
    return fnmatch.fnmatchcase(name, part) and (part.startswith(".") or not name.startswith("."))


def stage(spec: DatasetSpec, *, into: str) -> DatasetSpec:
    """The objects spec.path names downloaded below `into` (at their keys), and the spec with its
    path and roots pointing there: what a child reads as local files."""
    scheme, key = parse_uri(spec.path)
    fs = filesystem(scheme)
    for name, _ in resolve_objects(spec.path, format=spec.format, roots=spec.roots, fs=fs):
        local = Path(into, *PurePosixPath(name).parts)
        local.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(name, str(local))
        os.chmod(local, 0o644)  # a child under its owner's uid (ZERO1_RUN_AS) reads it
    _open_up(into)
    local_roots = tuple(root for root in spec.roots or () if not is_remote_path(root))
    return replace(spec, path=str(Path(into, *key.split("/"))), roots=(*local_roots, os.path.realpath(into)))


def for_child(data: Any) -> tuple[Any, str | None]:
    """A rank's data as its child reads them, and the directory made for that (None: the data are
    local, as they are). For data on an object store, a new directory holds the token file the job's
    check stored (the child maps it by its key), or, when that is gone, the staged files (the child
    tokenizes them into it); the caller removes it after the run."""
    if not isinstance(data, DatasetSpec) or not is_remote_path(data.path):
        return data, None
    directory = tempfile.mkdtemp(prefix="zero1-data-")
    try:
        if data.token_uri is not None and fetch_tokens(data.token_uri, into=directory):
            return replace(data, cache_dir=directory), directory
        return replace(stage(data, into=directory), cache_dir=directory, token_uri=None), directory
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise


def fetch_tokens(token_uri: str, *, into: str) -> bool:
    """The token file `token_uri` names and its sidecar copied into `into`/tokens, the sidecar last;
    False when either is gone from the store (the data is then staged instead)."""
    scheme, key = parse_uri(token_uri)
    name = PurePosixPath(key).name
    if not _TOKEN_NAME.fullmatch(name):
        raise ValueError(f"data.token_uri: {token_uri!r} does not name a token file")
    fs = filesystem(scheme)
    directory = Path(into, "tokens")
    directory.mkdir(parents=True, exist_ok=True)
    try:
        for suffix in (".bin", ".json"):
            local = directory / f"{name.removesuffix('.bin')}{suffix}"
            fs.get_file(key.removesuffix(".bin") + suffix, str(local))
            os.chmod(local, 0o644)
    except FileNotFoundError:
        for stale in directory.iterdir():
            stale.unlink()
        return False
    _open_up(into)
    return True


def publish_tokens(token_file: str, *, store_uri: str) -> str:
    """A cached token file (`<key>.bin`, its `<key>.json` beside it) put under `store_uri` unless its
    sidecar is there already, the sidecar last; the URI of the stored token file."""
    scheme, root = parse_uri(store_uri)
    local = Path(token_file)
    if not _TOKEN_NAME.fullmatch(local.name):
        raise ValueError(f"not a token file: {token_file!r}")
    fs = filesystem(scheme)
    key = f"{root}/{local.stem}"
    if not fs.exists(f"{key}.json"):
        fs.put_file(str(local), f"{key}.bin")
        fs.put_file(str(local.with_suffix(".json")), f"{key}.json")
    return f"{scheme}://{key}.bin"


def token_store(checkpoint_uri: str) -> str:
    """The store's token cache: datasets/tokens under the checkpoint storage."""
    return join_uri(checkpoint_uri, "datasets", "tokens")


def _open_up(directory: str) -> None:
    """Every directory from `directory` down readable and searchable by others (a mkdtemp is 0700)."""
    for path, _, _ in os.walk(directory):
        os.chmod(path, 0o755)

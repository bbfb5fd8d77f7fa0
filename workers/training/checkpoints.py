"""The checkpoint directory's layout, and reading it from a directory or an object store
(workers/training/storage.py): standard library only (fsspec for a store), so the control plane
reads checkpoints without loading torch.

    <checkpoint_uri>/job-<id>-<run_id>/
        step-000000099/
            rank-00000-of-00002.safetensors   a rank's optimizer shard (workers/training/writer.py writes it)
            rank-00000-of-00002.metrics.json  that rank's metric rows since the previous checkpoint
            complete.json                     rank 0's marker once every shard is in place
            pruned.json                       instead of complete.json: shards deleted, rows kept
        final/                                a succeeded run's model (workers/training/artifacts.py writes it)
            manifest.json                     every other file's name, bytes and sha256

A marker or rows file that cannot be read (a torn write on a filesystem that lost it) makes
that checkpoint not count, with a warning: the one before it is used, never an exception that
would stop the control plane.
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from workers.records import MetricRow
from workers.training.storage import Store, as_store

log = logging.getLogger(__name__)

COMPLETE = "complete.json"
PRUNED = "pruned.json"
FINAL = "final"
MANIFEST = "manifest.json"
SHARD_SUFFIX = ".safetensors"
LEGACY_SHARD_SUFFIX = ".pt"
"""The shards of checkpoints written before safetensors (torch.save's zip): read at their own world size only."""
ROWS_SUFFIX = ".metrics.json"
MAX_HEADER_BYTES = 100 << 20
"""The largest shard header read (safetensors' own bound); a shard's holds about 100 bytes a parameter."""
_TENSOR_KEYS = ("dtype", "shape", "data_offsets")
MAX_JSON_BYTES = 64 << 20
"""The most of a marker or rows file read (a rows file holds a few hundred bytes a step)."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def final_dir(root: Path) -> Path:
    """Where a succeeded run's model goes, beside its checkpoints."""
    return root / FINAL


def step_of(directory: Path) -> int:
    return step_of_name(directory.name)


def step_of_name(name: str) -> int:
    return int(name.removeprefix("step-"))


def shard_name(step: int, rank: int, world_size: int, *, suffix: str = SHARD_SUFFIX) -> str:
    """A rank's shard, relative to the checkpoint root: step-000000099/rank-00001-of-00002.safetensors."""
    return f"step-{step:09d}/rank-{rank:05d}-of-{world_size:05d}{suffix}"


def rows_name(step: int, rank: int, world_size: int) -> str:
    """A rank's metric rows file beside its shard, relative to the checkpoint root."""
    return shard_name(step, rank, world_size, suffix=ROWS_SUFFIX)


def shard_file(root: Path, step: int, rank: int, world_size: int) -> Path:
    return root / shard_name(step, rank, world_size)


def shard_header(
    read: Callable[[int, int], bytes],
) -> tuple[int, dict[str, tuple[str, tuple[int, ...], int, int]], dict[str, str]]:
    """A safetensors file's header from its first bytes, in two small reads: read(0, 8) (the header's
    length n, little-endian), then read(8, 8 + n). (data_start, {tensor name: (dtype, shape, start,
    end)}, metadata): start and end are byte offsets from data_start, as the file keeps them.
    ValueError for a header that is none (a reader then reads nothing else of the file)."""
    (length,) = struct.unpack("<Q", _read_exactly(read, 0, 8))
    if length > MAX_HEADER_BYTES:
        raise ValueError(f"a safetensors header of {length:,} bytes, above {MAX_HEADER_BYTES:,}: not a shard")
    header = json.loads(_read_exactly(read, 8, 8 + length))
    if not isinstance(header, dict):
        raise ValueError("a safetensors header that is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("safetensors metadata that is not a map of strings")
    tensors = {}
    for name, entry in header.items():
        dtype, shape, offsets = (entry.get(key) if isinstance(entry, dict) else None for key in _TENSOR_KEYS)
        if not (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(isinstance(n, int) and n >= 0 for n in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(n, int) for n in offsets)
            and 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"tensor {name!r} of the safetensors header is not dtype, shape and data_offsets")
        tensors[name] = (dtype, tuple(shape), offsets[0], offsets[1])
    return 8 + length, tensors, metadata


def _read_exactly(read: Callable[[int, int], bytes], start: int, end: int) -> bytes:
    data = read(start, end)
    if len(data) != end - start:
        raise ValueError(f"bytes [{start}, {end}) of a shard: read {len(data)} of {end - start} (a file cut short)")
    return data


def atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """write(file) to a temporary file, fsync it, rename it over `path`, fsync the directory: a
    reader sees the old file or the whole new one, never a torn one, even after a power loss."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as file:
        write(file)
        file.flush()
        os.fsync(file.fileno())
    os.replace(tmp, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def write_json(path: Path, value: Any) -> None:
    atomic_write(path, lambda file: file.write(json.dumps(value, allow_nan=True).encode()))


def _read_json(store: Store, name: str) -> Any | None:
    """The file's JSON, or None (logged) when it is missing, torn or unreadable. The service reads
    what a job's code could have written: in a directory, the file and its step directory must not
    be links (they would point it at a file of the service's), and it must be a regular file
    (workers/training/storage.py's DirectoryStore reads so)."""
    try:
        return json.loads(store.read(name, limit=MAX_JSON_BYTES))
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable checkpoint file %s/%s: %s: %s", store.uri, name, type(exc).__name__, exc)
        return None


_STEP_DIR = re.compile(r"step-\d{9}")
_SHARD = re.compile(r"rank-\d{5}-of-\d{5}\.(?:safetensors|pt)")
_ROWS = re.compile(r"rank-\d{5}-of-\d{5}\.metrics\.json")


def _step_dirs(store: Store) -> list[str]:
    """The checkpoint directories of the store: named step-<9 digits>, real directories (a job's
    code could plant a link, or a name that is no step, where the service reads and deletes)."""
    return [name for name in store.list() if _STEP_DIR.fullmatch(name) and store.is_dir(name)]


def _markers(store: Store, name: str) -> list[str]:
    """The step directories that hold a `name` file (complete.json, pruned.json)."""
    return [directory for directory in _step_dirs(store) if store.is_file(f"{directory}/{name}")]


def latest_checkpoint(root: Path | Store, *, before: int | None = None) -> tuple[int, int] | None:
    """(step, world_size) of the newest complete checkpoint under root (a directory or a store), or None;
    of those before step `before` where given (a rollback's)."""
    store = as_store(root)
    best = None
    for directory in _markers(store, COMPLETE):
        meta = _read_json(store, f"{directory}/{COMPLETE}")
        if not isinstance(meta, dict) or not all(isinstance(meta.get(key), int) for key in ("step", "world_size")):
            continue
        if (before is None or meta["step"] < before) and (best is None or meta["step"] > best[0]):
            best = (meta["step"], meta["world_size"])
    return best


def discard_from(root: Path | Store, *, step: int) -> list[int]:
    """Delete every checkpoint directory at `step` or later, complete or not (a rollback's: written at or
    after the event, none may be resumed from, and their rows are superseded); the steps."""
    store = as_store(root)
    discarded = []
    for directory in _step_dirs(store):
        if step_of_name(directory) >= step:
            store.remove_tree(directory)
            discarded.append(step_of_name(directory))
    return sorted(discarded)


def prune_checkpoints(root: Path | Store, *, keep_last: int, keep_newest_unfinished: bool = True) -> list[int]:
    """Delete the shards of all but the newest `keep_last` complete checkpoints, and any
    unfinished checkpoint older than the newest complete (a crash's leftovers); the steps pruned.
    A running job keeps an unfinished one newer than its newest complete (being written now);
    a finished job (keep_newest_unfinished=False) does not.

    A pruned checkpoint keeps its metric rows (a few hundred bytes a step and rank) under a
    pruned.json marker: the control plane may not have stored them yet (it polls behind the
    ranks, and it can stop while they run on), and reads them back before a relaunch. It
    discards them once stored (discard_stored_metrics)."""
    store = as_store(root)
    complete = sorted(step_of_name(directory) for directory in _markers(store, COMPLETE))
    kept = set(complete[-keep_last:])
    newest = complete[-1] if complete else -1
    pruned = []
    for directory in _step_dirs(store):
        step = step_of_name(directory)
        if step in kept or (keep_newest_unfinished and step >= newest) or store.exists(f"{directory}/{PRUNED}"):
            continue
        if store.is_file(f"{directory}/{COMPLETE}"):
            store.rename(f"{directory}/{COMPLETE}", f"{directory}/{PRUNED}")  # no longer one to resume from
            for name in store.list(directory):
                if _SHARD.fullmatch(name):
                    store.remove(f"{directory}/{name}")
        else:
            store.remove_tree(directory)  # never complete: a later attempt redid its steps
        pruned.append(step)
    return sorted(pruned)


def discard_stored_metrics(root: Path | Store, *, through_step: int) -> list[int]:
    """Delete the pruned checkpoints whose rows are all stored (step <= through_step); the steps."""
    store = as_store(root)
    discarded = []
    for directory in _markers(store, PRUNED):
        step = step_of_name(directory)
        if step <= through_step:
            store.remove_tree(directory)
            discarded.append(step)
    return sorted(discarded)


def checkpointed_metrics(root: Path | Store, *, after_step: int) -> list[MetricRow]:
    """The rows (one per step, ranks merged) saved with the complete and pruned checkpoints of
    root for the steps after `after_step`, in step order."""
    store = as_store(root)
    by_step: dict[int, dict[int, MetricRow]] = {}
    saved = {directory for name in (COMPLETE, PRUNED) for directory in _markers(store, name)}
    for directory in saved:
        if step_of_name(directory) <= after_step:
            continue
        for name in store.list(directory):
            if not _ROWS.fullmatch(name):
                continue
            for row in map(MetricRow.from_json, _read_json(store, f"{directory}/{name}") or []):
                if row.step > after_step:
                    by_step.setdefault(row.step, {})[row.rank] = row
    # a step without rank 0's row (its file torn) is left out: the global values are rank 0's
    complete = [step for step in sorted(by_step) if 0 in by_step[step]]
    return [MetricRow.merge(by_step[step]) for step in complete]


def complete_checkpoints(root: Path | Store) -> list[tuple[int, list[tuple[str, int]]]]:
    """The complete checkpoints under root, oldest first: each step with its downloadable files
    (its ranks' shards and its complete.json marker, name and bytes). Only regular files in real
    step directories count (a job's code could plant a link where the service reads)."""
    store = as_store(root)
    found = []
    for directory in sorted(_markers(store, COMPLETE)):
        sizes = ((name, _file_size(store, directory, name)) for name in store.list(directory))
        found.append((step_of_name(directory), [(name, size) for name, size in sizes if size is not None]))
    return found


def checkpoint_file_size(root: Path | Store, step: int, name: str) -> int | None:
    """The bytes of `name` in the complete checkpoint at `step`, as complete_checkpoints lists it;
    None for a name it would not list, or a step with no complete checkpoint (only that step is read)."""
    store = as_store(root)
    directory = f"step-{step:09d}"
    if not (store.is_dir(directory) and store.is_file(f"{directory}/{COMPLETE}")):
        return None
    return _file_size(store, directory, name)


def _file_size(store: Store, directory: str, name: str) -> int | None:
    """A downloadable file's bytes: a shard or the marker, a regular file; None otherwise (or pruned meanwhile)."""
    if not is_checkpoint_file(name) or not store.is_file(f"{directory}/{name}"):
        return None
    try:
        return store.size(f"{directory}/{name}")
    except OSError:
        return None


def is_checkpoint_file(name: str) -> bool:
    """A name complete_checkpoints may list: a rank's shard or the marker."""
    return name == COMPLETE or _SHARD.fullmatch(name) is not None

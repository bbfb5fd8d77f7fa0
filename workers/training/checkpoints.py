"""The checkpoint directory's layout, and reading it: standard library only, so the control plane
reads checkpoints without loading torch.

    <checkpoint_uri>/job-<id>-<run_id>/
        step-000000099/
            rank-00000-of-00002.pt            a rank's optimizer shard (workers.training.loop writes it)
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
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from workers.records import MetricRow

log = logging.getLogger(__name__)

COMPLETE = "complete.json"
PRUNED = "pruned.json"
FINAL = "final"
MANIFEST = "manifest.json"
MAX_JSON_BYTES = 64 << 20
"""The most of a marker or rows file read (a rows file holds a few hundred bytes a step)."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:09d}"


def final_dir(root: Path) -> Path:
    """Where a succeeded run's model goes, beside its checkpoints."""
    return root / FINAL


def step_of(directory: Path) -> int:
    return int(directory.name.removeprefix("step-"))


def shard_file(root: Path, step: int, rank: int, world_size: int) -> Path:
    return step_dir(root, step) / f"rank-{rank:05d}-of-{world_size:05d}.pt"


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


def _read_json(path: Path) -> Any | None:
    """The file's JSON, or None (logged) when it is missing, torn or unreadable. The service reads
    what a job's code could have written: the file and its step directory must not be links (they
    would point it at a file of the service's), and it must be a regular file."""
    try:
        if path.parent.is_symlink():
            raise OSError(f"{path.parent.name} is a symbolic link")
        descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(descriptor, "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                raise OSError("not a regular file")
            return json.loads(file.read(MAX_JSON_BYTES + 1)[:MAX_JSON_BYTES])
    except (OSError, ValueError) as exc:
        log.warning("ignoring unreadable checkpoint file %s: %s: %s", path, type(exc).__name__, exc)
        return None


_STEP_DIR = re.compile(r"step-\d{9}")


def _step_dirs(root: Path) -> list[Path]:
    """The checkpoint directories under root: named step-<9 digits>, real directories (a job's code
    could plant a link, or a name that is no step, where the service reads and deletes)."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    return [entry for entry in entries if _STEP_DIR.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink()]


def _markers(root: Path, name: str) -> list[Path]:
    """The `name` files (complete.json, pruned.json) of root's checkpoint directories."""
    return [directory / name for directory in _step_dirs(root) if _is_plain_file(directory / name)]


def _is_plain_file(path: Path) -> bool:
    return path.is_file() and not path.is_symlink()


def latest_checkpoint(root: Path) -> tuple[int, int] | None:
    """(step, world_size) of the newest complete checkpoint under root, or None."""
    best = None
    for marker in _markers(root, COMPLETE):
        meta = _read_json(marker)
        if not isinstance(meta, dict) or not all(isinstance(meta.get(key), int) for key in ("step", "world_size")):
            continue
        if best is None or meta["step"] > best[0]:
            best = (meta["step"], meta["world_size"])
    return best


def prune_checkpoints(root: Path, *, keep_last: int, keep_newest_unfinished: bool = True) -> list[int]:
    """Delete the shards of all but the newest `keep_last` complete checkpoints, and any
    unfinished checkpoint older than the newest complete (a crash's leftovers); the steps pruned.
    A running job keeps an unfinished one newer than its newest complete (being written now);
    a finished job (keep_newest_unfinished=False) does not.

    A pruned checkpoint keeps its metric rows (a few hundred bytes a step and rank) under a
    pruned.json marker: the control plane may not have stored them yet (it polls behind the
    ranks, and it can stop while they run on), and reads them back before a relaunch. It
    discards them once stored (discard_stored_metrics)."""
    complete = sorted(step_of(m.parent) for m in _markers(root, COMPLETE))
    kept = set(complete[-keep_last:])
    newest = complete[-1] if complete else -1
    pruned = []
    for directory in _step_dirs(root):
        step = step_of(directory)
        if step in kept or (keep_newest_unfinished and step >= newest) or (directory / PRUNED).exists():
            continue
        marker = directory / COMPLETE
        if _is_plain_file(marker):
            os.replace(marker, directory / PRUNED)  # no longer a checkpoint to resume from
            for shard in directory.glob("rank-*.pt"):
                shard.unlink(missing_ok=True)
        else:
            shutil.rmtree(directory, ignore_errors=True)  # never complete: a later attempt redid its steps
        pruned.append(step)
    return sorted(pruned)


def discard_stored_metrics(root: Path, *, through_step: int) -> list[int]:
    """Delete the pruned checkpoints whose rows are all stored (step <= through_step); the steps."""
    discarded = []
    for marker in _markers(root, PRUNED):
        step = step_of(marker.parent)
        if step <= through_step:
            shutil.rmtree(marker.parent, ignore_errors=True)
            discarded.append(step)
    return sorted(discarded)


def checkpointed_metrics(root: Path, *, after_step: int) -> list[MetricRow]:
    """The rows (one per step, ranks merged) saved with the complete and pruned checkpoints of
    root for the steps after `after_step`, in step order."""
    by_step: dict[int, dict[int, MetricRow]] = {}
    saved = {marker.parent for name in (COMPLETE, PRUNED) for marker in _markers(root, name)}
    for directory in saved:
        if step_of(directory) <= after_step:
            continue
        for path in directory.glob("rank-*.metrics.json"):
            for row in map(MetricRow.from_json, _read_json(path) or []):
                if row.step > after_step:
                    by_step.setdefault(row.step, {})[row.rank] = row
    # a step without rank 0's row (its file torn) is left out: the global values are rank 0's
    complete = [step for step in sorted(by_step) if 0 in by_step[step]]
    return [MetricRow.merge(by_step[step]) for step in complete]

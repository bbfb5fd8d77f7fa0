"""A rank's checkpoints on an object store: the trusted parent does every read and write, and the
child, which runs the user's code, never holds a credential (issue 20's rule).

The child trains as if its checkpoint directory were local: it is a spool in the child's home on
this node (`<home>/checkpoints`). Its conversation with the parent (workers/runtime/ranks.py relays
it; child -> parent JSON, parent -> child pickled):

    child:  {"t": "latest"}                                   parent: {"latest": [step, world_size] | None}
    child:  {"t": "fetch", "name", "ranges": [[a, b], ...]}   parent: {"fetched": path} | {"error": why}
    child:  {"t": "saved", "step", "names": [...]}            no answer: the parent stores them, then deletes them

A fetch puts the byte ranges asked of one stored shard into a sparse local file of the object's
size (one per name, filled range by range), each range one range request: a resumed or resharded
rank reads the bytes it owns and the shard's header, never a whole state. A save is stored in
order, in a background thread; rank 0's manifest (complete.json) goes last, once every rank's rows
file of that step is stored (each rank stores its rows after its shard): a checkpoint exists only
once all of it does. Then rank 0's parent prunes to keep_last. The child learns that its files are
stored when they vanish from its spool. Rank 0's final/ is stored after the run, its manifest last.

Nothing the child names is trusted: a name must be one of its own rank's checkpoint files, and it
is opened without following a link (the child owns the spool and could plant one at the
service's files), as a regular file.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any

from workers.runtime.sandbox import RunAs
from workers.training.checkpoints import COMPLETE, FINAL, MANIFEST, latest_checkpoint, prune_checkpoints
from workers.training.storage import Store

log = logging.getLogger(__name__)

SPOOL = "checkpoints"
"""The child's checkpoint directory, in its home."""
PEER_TIMEOUT_S = 600.0
"""How long rank 0's parent waits for the other ranks' files of a checkpoint before the attempt fails."""
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_MAX_MARKER_BYTES = 1 << 20


class SpoolError(RuntimeError):
    """A save or a fetch the parent could not do: the attempt ends with it."""


class Spool:
    """One rank's parent's side of its checkpoints on `store` (the job's root there)."""

    def __init__(self, store: Store, *, home: str, rank: int, world_size: int, keep_last: int, run_as: RunAs | None):
        self.store, self.home, self.rank, self.world_size = store, Path(home), rank, world_size
        self.dir = self.home / SPOOL
        self.keep_last, self.run_as = keep_last, run_as
        self.bytes_fetched = self.range_requests = 0
        self._fetched: dict[str, Path] = {}
        self._saves: queue.Queue[tuple[int, list[str]] | None] = queue.Queue()
        self._unstored = 0  # saves announced and not yet stored (or failed)
        self._stored = threading.Condition()
        self.error: BaseException | None = None
        own = rf"rank-{rank:05d}-of-{world_size:05d}\.(?:safetensors|metrics\.json)"
        self._names = re.compile(
            rf"step-(\d{{9}})/(?:{own}|{re.escape(COMPLETE)})" if rank == 0 else rf"step-(\d{{9}})/{own}"
        )
        self._thread = threading.Thread(target=self._store_saves, name=f"spool-rank{rank}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- reads, before the run

    def latest(self) -> list[int] | None:
        found = latest_checkpoint(self.store)
        return None if found is None else list(found)

    def fetch(self, name: str, ranges: list[list[int]]) -> str:
        """The local file holding `ranges` of the stored `name` (a checkpoint's shard)."""
        if not re.fullmatch(r"step-\d{9}/rank-\d{5}-of-\d{5}\.safetensors", name):
            raise SpoolError(f"not a shard of a checkpoint: {name!r}")
        path = self._fetched.get(name)
        if path is None:
            path = self._fetched[name] = self._sparse_file(name)
        descriptor = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for start, end in ranges:
                if not (isinstance(start, int) and isinstance(end, int) and 0 <= start <= end):
                    raise SpoolError(f"bad byte range [{start}, {end}) of {name}")
                data = self.store.read_range(name, start, end)
                os.pwrite(descriptor, data, start)
                self.bytes_fetched += len(data)
                self.range_requests += 1
        finally:
            os.close(descriptor)
        return str(path)

    def _sparse_file(self, name: str) -> Path:
        """A new file of the object's size in the child's home, made without following a link
        (O_EXCL on a fresh name) and given to the child's uid: the child reads it."""
        size = self.store.size(name)
        fetched = self.home / "fetched"
        fetched.mkdir(mode=0o700, exist_ok=True)
        if fetched.is_symlink():
            raise SpoolError("the spool's fetched/ is a link")
        path = fetched / f"{len(self._fetched):04d}-{name.replace('/', '-')}"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(descriptor, size)
            if self.run_as is not None:
                os.fchown(descriptor, self.run_as.uid, self.run_as.gid)
        finally:
            os.close(descriptor)
        if self.run_as is not None:
            os.chown(fetched, self.run_as.uid, self.run_as.gid, follow_symlinks=False)
        return path

    # ---------------------------------------------------------------- saves, while the run goes on

    def saved(self, step: int, names: list[str]) -> None:
        """The child has written these files of `step`: store them, in order, in the background."""
        for name in names:
            match = self._names.fullmatch(name) if isinstance(name, str) else None
            if match is None or int(match[1]) != step:
                raise SpoolError(f"rank {self.rank} may not save {name!r} at step {step}")
        with self._stored:
            self._unstored += 1
        self._saves.put((step, list(names)))

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait until every save so far is stored; SpoolError if one failed."""
        with self._stored:
            done = self._stored.wait_for(lambda: self._unstored == 0, timeout_s)
        if not done:
            raise SpoolError(f"rank {self.rank}'s checkpoint files were not stored within {timeout_s:g} s")
        if self.error is not None:
            raise SpoolError(f"storing rank {self.rank}'s checkpoint failed: {self.error}") from self.error

    def _store_saves(self) -> None:
        while (item := self._saves.get()) is not None:
            step, names = item
            try:
                if self.error is None:
                    for name in names:
                        self._store_one(step, name)
            except BaseException as exc:  # noqa: BLE001 - the run's message loop raises it
                log.warning("rank %d: storing checkpoint %d failed: %s: %s", self.rank, step, type(exc).__name__, exc)
                self.error = exc
            with self._stored:
                self._unstored -= 1
                self._stored.notify_all()

    def _store_one(self, step: int, name: str) -> None:
        if name.endswith(COMPLETE):
            self._wait_for_peers(step)
            self._check_marker(step, name)
        with self._open_spooled(name) as file:
            self.store.put_file(file, name)
        os.unlink(self.dir / name)  # the child learns it is stored
        if name.endswith(COMPLETE):
            shutil.rmtree(self.dir / name.split("/")[0], ignore_errors=True)
            if self.keep_last:
                prune_checkpoints(self.store, keep_last=self.keep_last)

    def _wait_for_peers(self, step: int) -> None:
        size = self.world_size
        others = [f"step-{step:09d}/rank-{r:05d}-of-{size:05d}.metrics.json" for r in range(1, size)]
        deadline = time.monotonic() + PEER_TIMEOUT_S
        while others:
            others = [name for name in others if not self.store.exists(name)]
            if others and time.monotonic() > deadline:
                missing = f"{len(others)} rank(s) did not store their files, e.g. {others[0]}"
                raise SpoolError(f"checkpoint {step}: {missing}")
            if others:
                time.sleep(0.05)

    def _check_marker(self, step: int, name: str) -> None:
        with self._open_spooled(name) as file:
            marker = json.loads(file.read(_MAX_MARKER_BYTES))
        if not isinstance(marker, dict) or (marker.get("step"), marker.get("world_size")) != (step, self.world_size):
            raise SpoolError(f"rank 0's marker of step {step} does not name step {step} of {self.world_size} ranks")

    def _open_spooled(self, name: str) -> Any:
        """The spooled file, opened by a chain of opens that follows no link, as a regular file."""
        parts = name.split("/")
        parent = self._open_spooled_dir(*parts[:-1])
        try:
            descriptor = os.open(parts[-1], _FILE_FLAGS, dir_fd=parent)
        finally:
            os.close(parent)
        file = os.fdopen(descriptor, "rb")
        info = os.fstat(file.fileno())
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            file.close()
            raise SpoolError(f"{name} is not a plain file of the spool's")
        return file

    def _open_spooled_dir(self, *parts: str) -> int:
        descriptor = os.open(self.dir, _DIR_FLAGS)
        for part in parts:
            try:
                nested = os.open(part, _DIR_FLAGS, dir_fd=descriptor)
            finally:
                os.close(descriptor)
            descriptor = nested
        return descriptor

    # ---------------------------------------------------------------- after the run

    def store_final(self) -> None:
        """Rank 0: the run's final/ (its files, then manifest.json), when the child wrote one."""
        if self.rank != 0 or not (self.dir / FINAL).is_dir() or (self.dir / FINAL).is_symlink():
            return
        names = sorted(entry.name for entry in (self.dir / FINAL).iterdir() if entry.name != MANIFEST)
        self.store.remove_tree(FINAL)  # an earlier attempt's, if any: the manifest goes first
        for name in [*names, MANIFEST]:
            with self._open_spooled(f"{FINAL}/{name}") as file:
                self.store.put_file(file, f"{FINAL}/{name}")

    def close(self) -> None:
        self._saves.put(None)

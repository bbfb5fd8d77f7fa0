"""A rank's checkpoints on an object store: the trusted parent does every read and write, and the
child, which runs the user's code, never holds a credential (issue 20's rule).

The child trains as if its checkpoint directory were local: it is a spool in the child's home on
this node (`<home>/checkpoints`). Its conversation with the parent (workers/runtime/rank_parent.py relays
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

Nothing the child names is trusted: a name must be one of its own rank's checkpoint files. The
child owns its home and may swap anything in it for a link, at any moment: every path the parent
opens, creates or deletes there is walked from a descriptor of the home taken before the child ran,
no link followed on the way (workers/training/confined.py); a file it reads is a regular file with
one link, and one it fetches into is reopened only if it is still the file it made.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any

from workers.records import RunAs
from workers.training import confined
from workers.training.checkpoints import COMPLETE, FINAL, MANIFEST, latest_checkpoint, prune_checkpoints
from workers.training.storage import Store

log = logging.getLogger(__name__)

SPOOL = "checkpoints"
"""The child's checkpoint directory, in its home."""
PEER_TIMEOUT_S = 600.0
"""How long rank 0's parent waits for the other ranks' files of a checkpoint before the attempt fails."""
FETCHED = "fetched"
"""The directory of the home where the parent puts what the child asked to fetch."""
_MAX_MARKER_BYTES = 1 << 20


class SpoolError(RuntimeError):
    """A save or a fetch the parent could not do: the attempt ends with it."""


class Spool:
    """One rank's parent's side of its checkpoints on `store` (the job's root there)."""

    def __init__(self, store: Store, *, home: str, rank: int, world_size: int, keep_last: int, run_as: RunAs | None):
        self.store = store
        self.home = Path(home)
        self.rank = rank
        self.world_size = world_size
        self.dir = self.home / SPOOL
        # held from now on: the child, which owns its home, could later put a link at its path
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._home = os.open(self.home, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.keep_last = keep_last
        self.run_as = run_as
        self.bytes_fetched = self.range_requests = 0
        self._fetched: dict[str, tuple[str, int]] = {}  # name -> (its file in fetched/, that file's inode)
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
        if name not in self._fetched:
            self._fetched[name] = self._sparse_file(name)
        local, inode = self._fetched[name]
        descriptor = self._reopen(local, inode=inode)
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
        return str(self.home / local)

    def _sparse_file(self, name: str) -> tuple[str, int]:
        """A new file of the object's size in the child's home, fetched/<n>-<name> (relative to the
        home) and its inode: fetched/ opened from the home's descriptor without following a link and
        the file made in it with dir_fd and O_EXCL (workers/training/confined.py), then both given to
        the child's uid: the child reads it."""
        size = self.store.size(name)
        local = f"{FETCHED}/{len(self._fetched):04d}-{name.replace('/', '-')}"
        try:
            with confined.opened_dir(self._home, FETCHED, create_mode=0o700) as fetched:
                descriptor = confined.create_file(fetched, local.split("/")[1], mode=0o600)
                try:
                    os.ftruncate(descriptor, size)
                    if self.run_as is not None:
                        os.fchown(descriptor, self.run_as.uid, self.run_as.gid)
                        os.fchown(fetched, self.run_as.uid, self.run_as.gid)
                    return local, os.fstat(descriptor).st_ino
                finally:
                    os.close(descriptor)
        except OSError as exc:
            raise SpoolError(f"the spool's {local} cannot be made: {exc.strerror or exc}") from None

    def _reopen(self, local: str, *, inode: int) -> int:
        """The fetched file open to write, reached as it was made; SpoolError when it is not that file."""
        try:
            descriptor = confined.open_descriptor(self._home, local, flags=os.O_WRONLY)
        except OSError as exc:
            raise SpoolError(f"the spool's {local} cannot be opened: {exc.strerror or exc}") from None
        if os.fstat(descriptor).st_ino != inode:
            os.close(descriptor)
            raise SpoolError(f"the spool's {local} is not the file its parent made")
        return descriptor

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
        try:
            self._store_each()
        finally:
            os.close(self._home)  # close() ended the queue: nothing reads the home after

    def _store_each(self) -> None:
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
        confined.unlink(self._home, f"{SPOOL}/{name}")  # the child learns it is stored
        if name.endswith(COMPLETE):
            confined.remove_tree(self._home, f"{SPOOL}/{name.split('/')[0]}")
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
        """The spooled file, walked to from the home's descriptor without following a link, as a
        regular file with one link (workers/training/confined.py)."""
        try:
            return confined.open_file(self._home, f"{SPOOL}/{name}")
        except OSError as exc:
            raise SpoolError(f"{name} is not a plain file of the spool's: {exc.strerror or exc}") from None

    # ---------------------------------------------------------------- after the run

    def store_final(self) -> None:
        """Rank 0: the run's final/ (its files, then manifest.json), when the child wrote one."""
        found = confined.entry_stat(self._home, f"{SPOOL}/{FINAL}")
        if self.rank != 0 or found is None or not stat.S_ISDIR(found.st_mode):
            return
        names = [name for name in confined.list_dir(self._home, f"{SPOOL}/{FINAL}") if name != MANIFEST]
        self.store.remove_tree(FINAL)  # an earlier attempt's, if any: the manifest goes first
        for name in [*names, MANIFEST]:
            with self._open_spooled(f"{FINAL}/{name}") as file:
                self.store.put_file(file, f"{FINAL}/{name}")

    def close(self) -> None:
        self._saves.put(None)

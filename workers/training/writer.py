"""One rank's checkpoints: written beside the training, and read back at a resume.

A checkpoint of step s is, for each rank, its optimizer shard (step-s/rank-r-of-N.safetensors:
the owned fp32 state as 1-D tensors named buffers.{i}.{kind}, and the layout, steps and
hyperparameters as JSON in the metadata under "zero1") and its metric rows since the previous
checkpoint (rank-r-of-N.metrics.json, written after the shard); then rank 0's complete.json, last.
A checkpoint without it is never resumed from, so a crash mid-write leaves the previous one the
newest (workers/training/checkpoints.py holds the layout and its readers).

CheckpointWriter.save runs in the training thread at a checkpoint step: it waits for the previous
checkpoint's write, refuses a non-finite state (a collective: on every rank, in this thread), copies
the shard to host memory and returns; a background thread writes the files, one write in flight.
No collective may run there (it would race the training thread's), so in a shared directory rank
0's writer polls for every rank's rows file of the step before it writes complete.json.
Synchronous checkpoints (TrainConfig.async_checkpoints False) write in the training thread, with a
barrier in place of the polling.

Reading a checkpoint back (resume) is workers/training/reader.py's.
"""

from __future__ import annotations

import json
import logging
import math
import struct
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import Tensor

from workers import phases
from workers.records import MetricRow, NonFiniteError
from workers.training.checkpoints import (
    COMPLETE,
    atomic_write,
    latest_checkpoint,
    prune_checkpoints,
    rows_name,
    shard_name,
    step_dir,
    write_json,
)
from workers.zero.optimizer import ZeRO1AdamW

log = logging.getLogger("zero1.train")

PEER_TIMEOUT_S = 600.0
"""How long rank 0's writer waits for the other ranks' files of a checkpoint in a shared directory
before its write fails."""
EXIT_GRACE_S = 30.0
"""After an exception or a cancellation, how long rank 0's writer still waits for the other ranks'
files of the checkpoint in flight (they may never come)."""
POLL_S = 0.02
METADATA_KEY = "zero1"
"""The safetensors metadata key of a shard's layout (JSON)."""


@dataclass(frozen=True, kw_only=True)
class CheckpointIO:
    """How a rank reaches its job's checkpoint storage."""

    latest: Callable[[], tuple[int, int] | None]
    """(step, world_size) of the newest complete checkpoint, or None."""
    fetch: Callable[[str, list[tuple[int, int]]], Path]
    """fetch(name relative to the checkpoint root, e.g. "step-000000099/rank-00001-of-00002.safetensors",
    byte ranges [start, end)) -> a local file in which at least those byte ranges, and those asked of
    the same name before, hold the stored bytes: resume asks for a shard's header, then for the
    ranges it owns, and maps the file (safetensors reads the header from it again)."""
    publish: Callable[[int, list[Path]], None] | None = None
    """None: the checkpoint root is a directory every rank shares (rank 0's writer waits for the
    other ranks' files, writes complete.json, prunes). Given: the root is this rank's private local
    spool; each rank writes its files there, rank 0 also writes complete.json there right after its
    own files, without waiting for the others, and does not prune; then publish(step, [the files
    written, complete.json last]) is called in the writer's thread and returns once the files are
    durably stored elsewhere (it raises on failure). The writer deletes nothing: the publisher owns them."""


def shared_directory(root: Path) -> CheckpointIO:
    """A checkpoint root every rank reads and writes (one node's disk, a network filesystem)."""
    return CheckpointIO(latest=lambda: latest_checkpoint(root), fetch=lambda name, ranges: root / name)


class CheckpointWriter:
    """One rank's checkpoint files. save() runs in the training thread at every checkpoint step (on
    every rank, at the same steps); the files are written by a background thread (asynchronous) or
    before save() returns. A context manager: leaving it waits for the write in flight and raises
    its error; leaving it by an exception waits too, rank 0 for the others' files EXIT_GRACE_S at
    most, and logs the write's error (the run ends with its own). A write's error is raised at the
    next save() or on leaving, on every rank (settle)."""

    def __init__(
        self,
        opt: ZeRO1AdamW,
        *,
        root: Path,
        io: CheckpointIO,
        keep_last: int = 0,
        asynchronous: bool = True,
        peer_timeout_s: float = PEER_TIMEOUT_S,
    ) -> None:
        self.opt = opt
        self.root = root
        self.io = io
        self.keep_last = keep_last
        self.asynchronous = asynchronous
        self.peer_timeout_s = peer_timeout_s
        self.rank = opt.rank
        self.world_size = opt.world_size
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"checkpoint-rank{opt.rank}") if asynchronous else None
        self._host = self._host_buffers() if asynchronous or opt.device.type == "cuda" else None
        self._pending: Future[None] | None = None
        self._pending_step: int | None = None
        self._give_up_at = math.inf  # rank 0 stops waiting for the others' files by then (monotonic)
        self._abandoned = False

    def save(self, step: int, metrics: Sequence[MetricRow] = ()) -> float:
        """Checkpoint `step` with the rows since the previous checkpoint; the seconds the training
        thread was held up. Asynchronous, the row of `step` itself is saved with them."""
        phases.enter("checkpoint")
        started = time.perf_counter()
        self.settle()  # one write in flight at most; the host copy is free again
        if self.io.publish is None:
            # a rows file of this step that an earlier attempt left would tell rank 0 that this rank's
            # new files are in place: gone before the all-reduce below, so before rank 0 looks
            (self.root / rows_name(step, self.rank, self.world_size)).unlink(missing_ok=True)
        _refuse_nonfinite_state(self.opt, step=step)
        layout = self.opt.shard_layout()
        # synchronous on CPU, the files are written from the state itself: nothing changes it meanwhile
        tensors, copied = (self.opt.owned_state(), None) if self._host is None else self._copy_to_host()
        if self._pool is None:
            self._write(step, tensors, copied, layout, list(metrics))
            return time.perf_counter() - started
        blocked_s = time.perf_counter() - started
        rows = [replace(row, checkpoint_blocked_s=blocked_s) if row.step == step else row for row in metrics]
        self._pending = self._pool.submit(self._write, step, tensors, copied, layout, rows)
        self._pending_step = step
        return blocked_s

    def wait(self) -> None:
        """Until the write in flight, if any, is done (its complete.json written); its error, raised here."""
        pending = self._pending
        self._pending = None
        if pending is not None:
            pending.result()

    def settle(self) -> None:
        """wait(), on every rank at once (a collective: the training thread's, at the same point on
        every rank): a rank whose write failed raises its error, and every other rank an error naming
        the step, rather than go on to wait forever in a collective for the rank that failed."""
        step = self._pending_step
        error = None
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank
            error = exc
        if self._pool is not None and self.world_size > 1:
            failed = torch.tensor([int(error is not None)], device=self.opt.device)
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.opt.process_group)
            if failed.item() and error is None:
                raise RuntimeError(f"the checkpoint of step {step} was not written: another rank's write of it failed")
        if error is not None:
            raise error

    def abandon(self, *, grace_s: float = EXIT_GRACE_S) -> None:
        """After an exception or a cancellation: the write in flight finishes, rank 0 waiting for the
        others' files grace_s more at most; its error is logged, not raised."""
        self._give_up_at = time.monotonic() + grace_s
        self._abandoned = True
        try:
            self.wait()
        except Exception as exc:  # noqa: BLE001 - the run is ending with an error of its own
            log.warning("rank %d: the checkpoint in flight was not written: %s: %s", self.rank, type(exc).__name__, exc)

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        try:
            if exc_type is not None:
                self.abandon()
            elif not self._abandoned:  # a stop, the end: every rank leaves here at the same step
                self.settle()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=False)

    def _host_buffers(self) -> dict[str, Tensor]:
        """Host memory for a copy of the owned state, allocated once, before the first step: pinned on
        CUDA (the copies run as DMA), zeroed on CPU (its pages are faulted in now, not at a checkpoint)."""
        if self.opt.device.type == "cuda":
            return {
                name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for name, t in self.opt.owned_state().items()
            }
        return {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in self.opt.owned_state().items()}

    def _copy_to_host(self) -> tuple[dict[str, Tensor], torch.cuda.Event | None]:
        """The owned state copied into the host buffers. On CUDA the copies are only queued: the
        training stream's later kernels run after them, and the writer waits for the event before it
        reads the buffers."""
        state = self.opt.owned_state()
        cuda = self.opt.device.type == "cuda"
        for name, tensor in state.items():
            self._host[name].copy_(tensor, non_blocking=cuda)
        if not cuda:
            return self._host, None
        event = torch.cuda.Event()
        event.record()
        return self._host, event

    def _write(
        self,
        step: int,
        tensors: dict[str, Tensor],
        copied: torch.cuda.Event | None,
        layout: dict[str, Any],
        rows: list[MetricRow],
    ) -> None:
        """This rank's shard, then its rows file; rank 0's complete.json once every rank's are in
        place (shared directory: then the pruning), or every file handed to io.publish (a spool)."""
        if copied is not None:
            copied.synchronize()
        step_dir(self.root, step).mkdir(parents=True, exist_ok=True)
        shard = self.root / shard_name(step, self.rank, self.world_size)
        atomic_write(shard, lambda file: write_shard(file, tensors, layout))
        rows_file = self.root / rows_name(step, self.rank, self.world_size)
        write_json(rows_file, [row.to_json() for row in rows])
        files = [shard, rows_file]
        shared = self.io.publish is None
        if shared and self._pool is None and self.world_size > 1:
            dist.barrier(group=self.opt.process_group)  # every shard is in place before the checkpoint counts
        elif shared and self.rank == 0:
            self._wait_for_peers(step)
        if self.rank == 0:
            marker = step_dir(self.root, step) / COMPLETE
            write_json(marker, {"step": step, "world_size": self.world_size, "format": layout["format"]})
            files.append(marker)
        if not shared:
            self.io.publish(step, files)
        elif self.rank == 0 and self.keep_last:
            prune_checkpoints(self.root, keep_last=self.keep_last)

    def _wait_for_peers(self, step: int) -> None:
        """Until every other rank's rows file of `step` is in place (each writes it after its shard,
        atomically, and its stale one is gone before save's all-reduce); TimeoutError after peer_timeout_s."""
        started = time.monotonic()
        deadline = started + self.peer_timeout_s
        waiting = [rows_name(step, r, self.world_size) for r in range(1, self.world_size)]
        while waiting := [name for name in waiting if not (self.root / name).exists()]:
            if time.monotonic() > min(deadline, self._give_up_at):
                raise TimeoutError(
                    f"checkpoint of step {step}: {len(waiting)} of the other {self.world_size - 1} ranks' files are "
                    f"not in place after {time.monotonic() - started:.0f} s (e.g. {waiting[0]}): no complete.json"
                )
            time.sleep(POLL_S)


def write_shard(file: IO[bytes], tensors: dict[str, Tensor], layout: dict[str, Any]) -> None:
    """A safetensors file of `tensors` (1-D fp32, on the host), with `layout` as JSON in its metadata."""
    header = {}
    offset = 0
    for name, tensor in tensors.items():
        assert tensor.dtype == torch.float32 and tensor.dim() == 1 and tensor.device.type == "cpu", name
        header[name] = {
            "dtype": "F32",
            "shape": [tensor.numel()],
            "data_offsets": [offset, offset + 4 * tensor.numel()],
        }
        offset += 4 * tensor.numel()
    header["__metadata__"] = {METADATA_KEY: json.dumps(layout)}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    file.write(struct.pack("<Q", len(encoded)) + encoded)
    for tensor in tensors.values():
        file.write(tensor.numpy().data)  # little-endian, as safetensors wants it, on every machine we run on


def save_checkpoint(
    opt: ZeRO1AdamW, root: Path, *, step: int, metrics: Sequence[MetricRow] = (), keep_last: int = 0
) -> Path:
    """A synchronous checkpoint of `step` in the shared directory `root`, as train() writes it with
    async_checkpoints False: every rank writes its shard and rows, a barrier, then rank 0 marks it
    complete (and prunes). The rows travel with the checkpoint: a control plane that lost them (it
    and Ray stopped together) reads them back before resuming after this step. Every rank calls it."""
    with CheckpointWriter(opt, root=root, io=shared_directory(root), keep_last=keep_last, asynchronous=False) as w:
        w.save(step, metrics)
    return step_dir(root, step)


def _refuse_nonfinite_state(opt: ZeRO1AdamW, *, step: int) -> None:
    """NonFiniteError on every rank, before anything is written, if any rank's fp32 state holds a
    nan or inf: a resume would start from it, and pruning would delete the good checkpoints."""
    counts = opt.nonfinite_state_numel()
    total = sum(counts.values())
    if total:
        by_kind = ", ".join(f"{kind} {n}" for kind, n in counts.items())
        raise NonFiniteError(
            f"not saving the checkpoint of step {step}: {total} of the optimizer state's elements are nan or inf "
            f"({by_kind}) over {opt.world_size} rank(s)"
        )

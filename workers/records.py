"""What ranks report: a metrics row per step, the error that ended an attempt, a run's result, and
what a supervisor answers the control plane's poll.

One shape each, from the training loop through the supervisor (Ray pickles them), the
checkpoint files (JSON) and the scheduler into the database and the API. Standard library only.

May import: the standard library only.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from enum import Enum
from typing import Any


def finite_or_none(value: Any) -> Any:
    """JSON and the database have no inf or nan: such a float (an fp16 overflow's grad_norm) is None."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricRow:
    """One training step. A rank reports its own (`rank` set, its peak alone in mem_peak_bytes);
    the supervisor merges a step's rows of every rank into one (`rank` None, rank 0's global
    values, every rank's peak in rank order)."""

    step: int
    loss: float | None
    """The global batch's mean loss (the same on every rank)."""
    grad_norm: float | None
    """The global gradient norm before clipping; nan or inf on a skipped step."""
    loss_scale: float
    skipped: bool
    step_time_s: float
    tokens_per_s: float
    mem_peak_bytes: tuple[int, ...]
    """Measured peak bytes, by rank."""
    mem_planned_bytes: int
    eval_loss: float | None = None
    """Mean loss on the held-out data, on a step that evaluated (eval_every); else None."""
    world_size: int | None = None
    """The N the step ran at (an elastic job's changes with each resize)."""
    checkpoint_blocked_s: float | None = None
    """Seconds the step's checkpoint held training up (workers/training/writer.py): waiting for the
    previous checkpoint's write and copying the shard to host memory, or the whole write where
    checkpoints are synchronous; None on a step without a checkpoint."""
    lr: float | None = None
    """The learning rate the step used (its schedule's, workers/training/schedule.py)."""
    rank: int | None = None

    @classmethod
    def merge(cls, by_rank: dict[int, MetricRow]) -> MetricRow:
        """One step's row from every rank's: rank 0's values, each rank's peak in rank order."""
        peaks = tuple(peak for rank in sorted(by_rank) for peak in by_rank[rank].mem_peak_bytes)
        return replace(by_rank[0], rank=None, mem_peak_bytes=peaks)

    def to_json(self) -> dict[str, Any]:
        """As written to a checkpoint's rows file (nan and inf kept: Python's json writes them)."""
        return asdict(self) | {"mem_peak_bytes": list(self.mem_peak_bytes)}

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> MetricRow:
        """From to_json's dict; a rank's row of an older checkpoint has one int as mem_peak_bytes."""
        peaks = row["mem_peak_bytes"]
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in row.items() if k in known}
        return cls(**values | {"mem_peak_bytes": tuple(peaks) if isinstance(peaks, list) else (peaks,)})

    def stored(self) -> dict[str, Any]:
        """The database's columns (and a job's `latest`): the merged row, non-finite floats as null."""
        return {k: finite_or_none(v) for k, v in self.to_json().items() if k != "rank"}


STORED_FIELDS = tuple(f.name for f in fields(MetricRow) if f.name != "rank")
"""The columns a stored row has, in order."""


class NonFiniteError(RuntimeError):
    """The gradients stayed nan or inf for max_nonfinite_steps steps, or the optimizer state is
    not finite where a checkpoint would save it: the run fails rather than train on, or save, nothing."""


class DivergenceKind(str, Enum):
    """What diverged (workers/health.py decides it, step by step)."""

    SPIKE = "spike"
    """A loss health.spike_zscore standard deviations above the mean of the health.spike_window before it."""
    NONFINITE = "nonfinite"
    """max_nonfinite_steps steps in a row with a nan or inf gradient norm, each skipped."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Divergence:
    """A diverged run, as the rank that saw it reports it and the service rolls it back
    (service/scheduling/health.py): its kind and the step it was seen at."""

    kind: DivergenceKind
    step: int
    """A spike's step, or the last of the non-finite run: no checkpoint at or after it is used."""
    loss: float | None = None
    """The step's loss (None where it is not finite)."""
    zscore: float | None = None
    """A spike's standard deviations above the window's mean."""
    num_steps: int = 1
    """A non-finite run's steps in a row."""

    def describe(self) -> str:
        """The event's words: "loss spike 9.7σ at step 812", "loss not finite for 3 steps at step 14"."""
        if self.kind == DivergenceKind.SPIKE:
            return f"loss spike {self.zscore:.1f}σ at step {self.step}"
        return f"loss not finite for {self.num_steps} steps at step {self.step}"

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_json(cls, value: Any) -> Divergence | None:
        """From to_json's dict as a child sent it (untrusted); None for anything that is not one."""
        if not isinstance(value, dict) or value.get("kind") not in {kind.value for kind in DivergenceKind}:
            return None
        step, num_steps = value.get("step"), value.get("num_steps", 1)
        numbers = [value.get("loss"), value.get("zscore")]
        if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in (step, num_steps)):
            return None
        if not all(n is None or (isinstance(n, (int, float)) and not isinstance(n, bool)) for n in numbers):
            return None
        loss, zscore = (None if n is None else finite_or_none(float(n)) for n in numbers)
        kind = DivergenceKind(value["kind"])
        if kind == DivergenceKind.SPIKE and zscore is None:
            return None
        return cls(kind=kind, step=step, loss=loss, zscore=zscore, num_steps=num_steps)


class DivergenceError(RuntimeError):
    """The run diverged and the job may roll back (health.max_rollbacks > 0): the attempt ends with
    this, which the service turns into a rollback, not a failure."""

    def __init__(self, divergence: Divergence) -> None:
        super().__init__(f"{divergence.describe()}: the job rolls back to its last checkpoint before it")
        self.divergence = divergence

    def __reduce__(self):  # crosses a process as its record
        return (type(self), (self.divergence,))


PEER_LOSS_MARKERS = (
    "gloo/transport",
    "Connection closed by peer",
    "Connection reset by peer",
    "NCCL",
    "remote process",
)
"""Text of a collective's error that says a peer is gone (RankError.is_peer_loss)."""

OOM_EXCEPTIONS = frozenset({"OutOfMemoryError", "MemoryError"})
"""Exceptions that say a rank ran out of memory: torch.OutOfMemoryError (torch.cuda's is the same
class), Ray's memory monitor's, Python's MemoryError."""
OOM_KILLED = "the kernel's OOM killer"
"""What a child's end says when its SIGKILL came while the kernel's OOM killer was killing
(workers/runtime/sandbox.py, exit_reason)."""
OOM_MARKERS = ("CUDA out of memory", "HIP out of memory", "DefaultCPUAllocator: can't allocate memory", OOM_KILLED)
"""Text of an error of another type that says the same: an older torch's RuntimeError, a CPU
allocation refused, a child killed by the kernel for memory (RankError.is_oom)."""


COLLECTIVES = frozenset({"reduce_scatter", "all_reduce", "all_gather", "broadcast", "barrier"})
"""The phases of a rank's work (workers/phases.py) in which it waits for its peers."""
HANG_ERROR = "HangError"
"""The exception of a rank its parent found hung (workers/runtime/rank_parent.py)."""


def root_cause(errors: list[RankError]) -> RankError:
    """Of the errors that ended an attempt, in the order they arrived, the one that says why: the
    first that is not a collective's error on a rank whose peer went away, nor a hang in a collective
    (waiting for a peer), unless there is nothing else. When rank 1 dies, rank 0's all-reduce fails at
    the same moment, and either report may reach the supervisor first; when rank 1 hangs in its
    forward, rank 0 waits for it in a collective."""
    causes = [error for error in errors if not error.is_peer_loss]
    return next((error for error in causes if not error.is_peer_wait), causes[0] if causes else errors[0])


@dataclass(frozen=True, slots=True, kw_only=True)
class RankError:
    """Why an attempt ended: the exception's type and first line, the last lines of its traceback,
    and where (rank and node, when one rank's failure ended it; None for a start, a supervisor or
    the control plane)."""

    exception: str
    message: str
    rank: int | None = None
    node_id: str | None = None
    traceback: tuple[str, ...] = ()
    """The last TRACEBACK_LINES lines of the failing rank's traceback (a code bundle's files named
    relative to it); empty where there is none."""
    divergence: Divergence | None = None
    """What diverged, where the rank ended the attempt for a rollback (DivergenceError); else None."""

    @classmethod
    def of(cls, exc: BaseException, *, rank: int | None = None, node_id: str | None = None) -> RankError:
        """The error of `exc`; a Ray task error is its cause's, with the remote traceback's tail."""
        cause = getattr(exc, "cause", None)  # ray.exceptions.RayTaskError wraps the rank's own exception
        error = cause if isinstance(cause, BaseException) else exc
        reported = getattr(error, "rank_error", None)  # a rank's child's error, as its parent relayed it
        if isinstance(reported, RankError):
            return replace(reported, rank=rank, node_id=node_id)
        lines = str(error).strip().splitlines()
        return cls(
            exception=type(error).__name__,
            message=lines[0] if lines else type(error).__name__,
            rank=rank,
            node_id=node_id,
            # an actor that failed to start (a rank's, unpacking its bundle) ends Ray's text with its traceback
            traceback=_traceback_tail(exc) if error is not exc or getattr(exc, "actor_init_failed", False) else (),
            divergence=error.divergence if isinstance(error, DivergenceError) else None,
        )

    @property
    def is_peer_loss(self) -> bool:
        """Whether this is a collective's error on a rank whose peer went away (gloo's "Connection
        closed by peer" or "Read error" from its TCP transport, NCCL's remote error): the effect of
        another rank's failure, never its cause."""
        return self.exception in {"RuntimeError", "DistBackendError", "DistNetworkError"} and any(
            marker in self.message for marker in PEER_LOSS_MARKERS
        )

    @property
    def is_peer_wait(self) -> bool:
        """Whether this is a hang in a collective (its message ends with the phase, workers.phases.Hang):
        the rank waited for a peer, which may have hung elsewhere."""
        return self.exception == HANG_ERROR and self.message.rpartition(" in ")[2] in COLLECTIVES

    @property
    def is_oom(self) -> bool:
        """Whether the rank ran out of memory: an out-of-memory exception, or a child that the
        kernel's OOM killer ended (service/intake/replans.py plans such a job again, smaller)."""
        return self.exception in OOM_EXCEPTIONS or any(marker in self.message for marker in OOM_MARKERS)

    def to_json(self) -> dict[str, Any]:
        """As a job's `error` stores it."""
        divergence = None if self.divergence is None else self.divergence.to_json()
        return {**asdict(self), "traceback": list(self.traceback), "divergence": divergence}

    def reason(self) -> str:
        """The event text: where, then what."""
        where = f"rank {self.rank} on node {self.node_id}: " if self.rank is not None else ""
        return f"{where}{self.exception}: {self.message}"

    @staticmethod
    def tidy_traceback(lines: list[str]) -> tuple[str, ...]:
        """The last TRACEBACK_LINES lines of a traceback's text lines, without colours, caret lines
        or the directory a code bundle was unpacked in."""
        split = [part for line in lines for part in line.splitlines()]
        tidy = [_BUNDLE_DIR.sub("", _ANSI.sub("", line)).rstrip() for line in split]
        kept = [line for line in tidy if line.strip() and set(line.strip()) - set("^~")]
        return tuple(line[:500] for line in kept[-TRACEBACK_LINES:])

    def traceback_text(self) -> str:
        """The traceback's last lines, each on a line of its own after a newline; "" without one."""
        return "".join(f"\n{line}" for line in self.traceback)


TRACEBACK_LINES = 12
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_BUNDLE_DIR = re.compile(r"[^\s\"']*/working_dir_files/[^/]+/")
"""Where a child's code bundle is unpacked (workers/training/bundles.py): a user's file is named relative to it."""


def _traceback_tail(exc: BaseException) -> tuple[str, ...]:
    """The last lines of a Ray task error's remote traceback, without colours or caret lines."""
    return RankError.tidy_traceback(str(exc).splitlines()[1:])


STREAMS = ("stdout", "stderr", "log", "marker")
"""Where a line came from: a rank's stdout, its stderr, its Python logging, or zero1 (a marker
saying lines were dropped)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OutputLine:
    """One line a rank wrote: its stdout, stderr or a logging record (workers.runtime.capture)."""

    rank: int
    n: int
    """The rank's count of its lines in this attempt, from 0: the order they were written in."""
    time: float
    """When it was written (seconds since the epoch)."""
    stream: str
    """One of STREAMS."""
    line: str
    """The text, without its newline; at most workers.runtime.capture.MAX_LINE_CHARS characters."""
    dropped: tuple[int, int] = (0, 0)
    """A marker's: the lines and bytes it stands for, dropped on the way (never stored as a line:
    the job's one marker counts them)."""

    @property
    def size(self) -> int:
        """Bytes it counts against a job's bound (ZERO1_LOG_MAX_BYTES): its UTF-8 text."""
        return len(self.line.encode("utf-8", "replace"))


class AttemptStatus(str, Enum):
    """Where an attempt stands: as its supervisor says (STARTING to CANCELLED), or as the control
    plane sees a supervisor that does not say (UNKNOWN, LOST)."""

    STARTING = "starting"
    """Placing its ranks and waiting for them to rendezvous."""
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    STOPPED = "stopped"
    """Its ranks stopped after a checkpoint, as asked (a resize, a preemption)."""
    FAILED = "failed"
    CANCELLED = "cancelled"
    """Its ranks were killed by cancel(): the scheduler asks it only after its own cancel."""
    UNKNOWN = "unknown"
    """The supervisor did not answer in time: asked again, never taken for dead."""
    LOST = "lost"
    """The supervisor is known dead (no such actor, or Ray says it died)."""

    @property
    def ended(self) -> bool:
        """Whether its supervisor is done with it: its ranks have ended, or never will start."""
        return self in (AttemptStatus.SUCCEEDED, AttemptStatus.STOPPED, AttemptStatus.FAILED, AttemptStatus.CANCELLED)


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptPoll:
    """A supervisor's answer to poll(): its status, why it failed, and what it holds that the
    caller has not stored (rows after its after_step, lines after its acks)."""

    status: AttemptStatus
    error: RankError | None = None
    """Why it failed or was lost; None otherwise."""
    metrics: tuple[MetricRow, ...] = ()
    """One merged row a step, for the steps every rank has completed after the caller's after_step."""
    nodes: tuple[str, ...] = ()
    """The node id of each rank, by rank (empty until they rendezvous)."""
    logs: tuple[OutputLine, ...] = ()
    """Each rank's lines after the caller's acks, in its order."""
    log_dropped: tuple[int, int] = (0, 0)
    """Lines and bytes dropped past the bound since the attempt began."""

    @classmethod
    def unknown(cls) -> AttemptPoll:
        """No answer in time: nothing known, nothing brought."""
        return cls(status=AttemptStatus.UNKNOWN)

    @classmethod
    def lost(cls, message: str) -> AttemptPoll:
        """The supervisor is known dead, and why."""
        return cls(status=AttemptStatus.LOST, error=RankError(exception="SupervisorLost", message=message))


@dataclass(frozen=True, slots=True, kw_only=True)
class TrainResult:
    """What a rank's run returns."""

    rank: int
    first_step: int
    """The step this run started at (> 0 after a resume)."""
    last_step: int
    """The last step completed; -1 if none."""
    cancelled: bool
    stopped: bool = False
    """It stopped after the checkpoint of last_step, asked to (an elastic job's resize)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetSummary:
    """What a submit-time dataset check found (and cached): read by the service, made in a child."""

    num_tokens: int
    num_blocks: int
    num_train_blocks: int
    num_held_out_blocks: int
    vocab_size: int
    eos_id: int
    tokenized: bool
    token_file: str | None = None
    """The cache entry's token file (None without a cache): the service marks it used and trims the cache."""


@dataclass(frozen=True, slots=True)
class RunAs:
    """The uid and gid a job's children run under (ZERO1_RUN_AS); None where they run as the service."""

    uid: int
    gid: int

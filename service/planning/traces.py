"""Traced plans: a model's training step counted on fake tensors in a Ray task, cached by digest.

The trace needs torch and runs the model's own code, so it never runs in the API process: a
Ray task (num_cpus=0: a trace takes a second or so and must not queue behind the training
ranks holding the CPUs) does it within ZERO1_PLAN_TIMEOUT_S. What a trace depends on — the
model (a python model's code bundle digest with it, an hf directory's content digest with its
path), precision, micro-batch, sequence length and checkpointing — is hashed into a digest; an
identical request answers from the cache without asking Ray. A python model's trace runs in a child
of the task that imports from the bundle, which the task unpacks for it alone.

A route awaits a trace (`Tracer.trace_async`) without holding a thread, in one of the slots that
bound the traces running at once (ZERO1_MAX_TASKS, ZERO1_MAX_TASKS_PER_USER), then hands the
planning code, which is synchronous, a `KnownTrace` that answers without Ray.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from service.concurrency import Slots
from service.errors import ServiceError
from service.planning.tasks import Isolation, run_task, run_task_async
from workers.config import InvalidModelError
from workers.memory import model as memory
from workers.memory.buckets import DEFAULT_BUCKET_CAP_MB
from workers.records import RunAs

if TYPE_CHECKING:
    from workers.models.trace import StepTrace  # imports torch: the trace's process alone does

CACHE_ENTRIES = 1024
"""Traces the service remembers, least recently used dropped first (each is a few integers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TracedStep:
    """What a plan needs of a trace: parameter groups and the step's bytes beyond the states."""

    group_numels: tuple[int, ...]
    frozen_numel: int
    activations_bytes: int
    temporaries_bytes: int
    gathered_numel: int = 0
    """Parameters a ZeRO stage-3 rank holds whole at once (the root's and two units')."""
    gathered_bytes: int | None = None
    """A stage-3 rank's step peak beyond the stage-1 step's (what it holds gathered then)."""
    buckets_bytes: int | None = None
    """A stage-2 rank's step peak beyond the stage-1 step's (its gradient buckets staged then)."""
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    """The largest bucket the stage-2 count cut, MiB."""
    vocab_size: int | None = None
    """An hf model's, resolved from its config; None for the built-in models."""
    max_position_embeddings: int | None = None
    """An hf model's longest sequence (its default seq_len), likewise."""

    @classmethod
    def of(cls, trace: StepTrace, *, bucket_cap_mb: float, **shape: int | None) -> TracedStep:
        """What a plan needs of `trace` (its stage-2 count cut buckets of bucket_cap_mb MiB), with an hf
        or python model's vocab_size and max_position_embeddings (`shape`)."""
        return cls(
            group_numels=(trace.params.decay_numel, trace.params.no_decay_numel),
            frozen_numel=trace.params.frozen_numel,
            gathered_numel=trace.params.gathered_numel,
            gathered_bytes=trace.gathered_bytes,
            buckets_bytes=trace.buckets_bytes,
            bucket_cap_mb=bucket_cap_mb,
            activations_bytes=trace.memory.activations_bytes,
            temporaries_bytes=trace.memory.temporaries_bytes,
            **shape,
        )

    def workload(self, *, precision: str, optimizer: str = "adamw", overhead_bytes: int = 0) -> memory.Workload:
        """The memory model's Workload of this trace, in `precision` with `optimizer`."""
        return memory.Workload.from_trace(
            group_numels=self.group_numels,
            frozen_numel=self.frozen_numel,
            gathered_numel=self.gathered_numel,
            gathered_bytes=self.gathered_bytes,
            buckets_bytes=self.buckets_bytes,
            bucket_cap_mb=self.bucket_cap_mb,
            activations_bytes=self.activations_bytes,
            temporaries_bytes=self.temporaries_bytes,
            precision=precision,
            optimizer=optimizer,
            overhead_bytes=overhead_bytes,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRequest:
    """One micro-batch of one model's step: everything a trace depends on."""

    model: dict[str, Any]
    precision: str
    micro_batch_size: int
    seq_len: int | None
    activation_checkpointing: bool
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
    """The job's largest gradient bucket, MiB, which a stage-2 step's count cuts its buckets by."""

    @property
    def digest(self) -> str:
        step = [self.precision, self.micro_batch_size, self.seq_len, self.activation_checkpointing, self.bucket_cap_mb]
        canonical = json.dumps(
            [self.model, *step],
            sort_keys=True,
            separators=(",", ":"),
        )
        return "sha256:" + hashlib.sha256(canonical.encode()).hexdigest()


def run_trace(request: TraceRequest) -> TracedStep:
    """The trace itself, in the process that calls it (a Ray task's, or the CLI's): imports torch."""
    if request.model["kind"] == "hf":
        return _run_hf_trace(request)
    if request.model["kind"] == "python":
        return _run_python_trace(request)
    from workers.memory.specs import GPTSpec, MLPSpec
    from workers.models.builtin import trace_builtin

    fields = {k: v for k, v in request.model.items() if k != "kind"}
    spec = GPTSpec(**fields) if request.model["kind"] == "gpt" else MLPSpec(sizes=tuple(fields["sizes"]))
    trace = trace_builtin(
        spec,
        precision=request.precision,
        micro_batch_size=request.micro_batch_size,
        seq_len=request.seq_len,
        activation_checkpointing=request.activation_checkpointing,
        bucket_cap_mb=request.bucket_cap_mb,
    )
    return TracedStep.of(trace, bucket_cap_mb=request.bucket_cap_mb)


def _run_hf_trace(request: TraceRequest) -> TracedStep:
    """An hf model's trace: its config resolved by transformers (offline), its seq_len checked against it."""
    from workers.models.builtin import DTYPES
    from workers.models.hf import model_shape, resolve_config, trace_hf

    config = resolve_config(config=request.model.get("config"), path=request.model.get("path"))
    vocab_size, max_positions = model_shape(config)
    seq_len = request.seq_len or max_positions
    if seq_len > max_positions:
        raise InvalidModelError(
            "seq_len", f"seq_len ({seq_len}) must be <= the model's max_position_embeddings ({max_positions})"
        )
    trace = trace_hf(
        config,
        precision_dtype=DTYPES[request.precision],
        micro_batch_size=request.micro_batch_size,
        seq_len=seq_len,
        activation_checkpointing=request.activation_checkpointing,
        bucket_cap_mb=request.bucket_cap_mb,
    )
    return TracedStep.of(
        trace, bucket_cap_mb=request.bucket_cap_mb, vocab_size=vocab_size, max_position_embeddings=max_positions
    )


def _run_python_trace(request: TraceRequest) -> TracedStep:
    """A python model's trace, in a child whose working directory is its copy of the job's code bundle."""
    from workers.models.builtin import DTYPES
    from workers.models.usercode import trace_python

    assert request.seq_len is not None, "a python model's plan states seq_len"
    traced = trace_python(
        request.model["entrypoint"],
        request.model.get("args") or {},
        precision_dtype=DTYPES[request.precision],
        micro_batch_size=request.micro_batch_size,
        seq_len=request.seq_len,
        vocab_size=request.model.get("vocab_size"),
        bucket_cap_mb=request.bucket_cap_mb,
    )
    trace = traced.trace
    return TracedStep.of(
        trace,
        bucket_cap_mb=request.bucket_cap_mb,
        vocab_size=traced.vocab_size,
        max_position_embeddings=request.seq_len,
    )


class Traces(Protocol):
    """What the planning code asks of a tracer: one request's traced step."""

    def trace(self, request: TraceRequest) -> TracedStep: ...


@dataclass(frozen=True, slots=True)
class KnownTrace:
    """A trace made already (awaited by the route), answered to the synchronous planning code without
    Ray: a plan asks for one request's trace only, so no other can be asked of it."""

    request: TraceRequest
    step: TracedStep

    def trace(self, request: TraceRequest) -> TracedStep:
        assert request.digest == self.request.digest, "a plan traces one request"
        return self.step


class Tracer:
    """Traces on the Ray cluster within `timeout_s`, remembering each digest's result."""

    def __init__(
        self,
        *,
        timeout_s: float,
        in_process: bool = False,
        code_uri: Callable[[str], str] | None = None,
        slots: Slots | None = None,
        run_as: Callable[[str | None], RunAs | None] = lambda user: None,
    ) -> None:
        self.timeout_s = timeout_s
        self.in_process = in_process
        """Trace in this process (the CLI, which may import torch), not in a Ray task."""
        self.code_uri = code_uri
        """A code bundle's digest -> the stored zip's URI, which a trace's task unpacks for its child."""
        self.slots = slots
        """The bound on traces running at once (shared with dataset checks); None: unbounded (the CLI)."""
        self.run_as = run_as
        """A user -> the uid and gid its traces' children run under (ZERO1_RUN_AS)."""
        self.traces_run = 0
        """Traces made (not answered from the cache), since this Tracer was made."""
        self._cache: OrderedDict[str, TracedStep] = OrderedDict()
        self._lock = threading.Lock()

    def trace(self, request: TraceRequest, *, user: str | None = None) -> TracedStep:
        """The request's trace, waited for in this thread (the CLI's way, and the scheduler's replan of a
        job of `user`'s; a route awaits trace_async)."""
        cached = self._cached(request.digest)
        if cached is not None:
            return cached
        return self._remember(request.digest, self._run(request, user=user))

    async def trace_async(self, request: TraceRequest, *, user: str | None) -> TracedStep:
        """The request's trace, awaited without a thread; one not cached takes one of `user`'s slots
        while it runs (a 429 when none is free)."""
        cached = self._cached(request.digest)
        if cached is not None:
            return cached
        if self.in_process:
            return self.trace(request)
        with self.slots.hold(user) if self.slots is not None else contextlib.nullcontext():
            traced = await run_task_async(run_trace, request, **self._task_options(request, user=user))
        return self._remember(request.digest, traced)

    def _cached(self, digest: str) -> TracedStep | None:
        with self._lock:
            if digest in self._cache:
                self._cache.move_to_end(digest)
                return self._cache[digest]
        return None

    def _remember(self, digest: str, traced: TracedStep) -> TracedStep:
        with self._lock:
            self.traces_run += 1
            self._cache[digest] = traced
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return traced

    def _run(self, request: TraceRequest, *, user: str | None) -> TracedStep:
        if self.in_process:
            if request.model.get("code") is not None:  # user code never runs in this process
                raise invalid_model("model", "a python model is planned by the service (POST /v1/plan), not here")
            return _with_trace_errors(lambda: run_trace(request))
        return run_task(run_trace, request, **self._task_options(request, user=user))

    def _task_options(self, request: TraceRequest, *, user: str | None) -> dict[str, Any]:
        """run_task's options for this request: a python model's stored bundle, for the task's child; a
        crash of the task's process blamed on the model's code (entrypoint) or its config or directory."""
        code = request.model.get("code")
        if code is not None:
            assert self.code_uri is not None, "tracing a python model needs the code store"
            code = self.code_uri(code)
        blame = {"python": "model.entrypoint", "hf": "model.path" if request.model.get("path") else "model.config"}
        return {
            "timeout_s": self.timeout_s,
            "timed_out": self._timed_out,
            "failed": _trace_failed,
            "code": code,
            "blame": blame.get(request.model["kind"], "model"),
            "isolation": Isolation(
                result=TracedStep, run_as=self.run_as(user), child=request.model["kind"] in ("hf", "python")
            ),
        }

    def _timed_out(self) -> ServiceError:
        return ServiceError(
            f"tracing the model's step took more than ZERO1_PLAN_TIMEOUT_S = {self.timeout_s:g} s; "
            "the trace was stopped",
            status_code=422,
            error="trace_timeout",
        )


def _with_trace_errors(trace):
    from workers.models.trace import TraceError

    try:
        return trace()
    except (TraceError, ValueError) as exc:
        raise _trace_failed(exc) from None


def _trace_failed(exc: BaseException) -> ServiceError:
    if isinstance(exc, InvalidModelError):
        return invalid_model(exc.field, exc.reason)
    lines = str(exc).strip().splitlines()
    return ServiceError(
        f"the model's step could not be traced: {lines[0] if lines else type(exc).__name__}",
        status_code=422,
        error="trace_failed",
    )


def invalid_model(field: str, message: str) -> ServiceError:
    """A 422 naming the field of an hf model that transformers (or the model roots) refused."""
    detail = [{"field": field, "message": message, "type": "value_error"}]
    error = "invalid_model" if field.startswith("model") else "invalid_request"
    return ServiceError(f"{field}: {message}", status_code=422, error=error, detail=detail)

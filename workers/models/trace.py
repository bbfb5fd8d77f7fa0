"""What one micro-batch's forward and backward keep alive: counted op by op, on real tensors or fake.

LiveBytes is a dispatch mode that sees every storage an op creates, counts its bytes while
it lives (a weak reference tells when it is freed) and keeps the peak. Model states are not
counted: parameters, buffers and the tensors handed to `ignore` (the optimizer's flat
gradient buffer, its state), nor a gradient once autograd has accumulated it into `.grad`.
What remains is what the memory model calls activations (alive when forward returns: saved
for backward) and temporaries (the rest of the peak: logits, the loss's gradient, a layer's
gradients in flight, a recomputed block).

trace_step runs that count under FakeTensorMode on a model built on the meta device: no
memory is allocated and nothing is computed, so a 7B model's step is counted on a laptop
CPU. The training ranks run the same count on their real CPU tensors, so the plan and the
measurement count one thing the same way (on CUDA the ranks read the allocator instead).

Why not torch.distributed._tools.mem_tracker.MemTracker, which tests compare against: its
peak is the largest total with gradients allocated as autograd makes them, while zero1's
gradients live in one flat buffer allocated before the step; the peak that matters here is
that of everything but the states, which can fall at another moment. This mode also runs
unchanged inside a training step, and it is public torch API but for one hook,
_should_skip_dynamo, which keeps a rank from loading torch._dynamo.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from workers.memory.buckets import DEFAULT_BUCKET_CAP_MB
from workers.models.grad_buckets import Stage2Schedule
from workers.models.units import Stage3Schedule, gathered_numel, storage_resizes


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ops create while the mode is on and that are still alive, and their peak."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """Asked once, as the class is made. True (torch's answer) wraps __torch_dispatch__ in
        torch._disable_dynamo, whose first call imports torch._dynamo: about 1 s of CPU in every
        rank that counts a step. Where torch._dynamo is not loaded by then, nothing compiles that
        the wrapper would keep out of this mode; where it is, torch's wrapper stays."""
        return "torch._dynamo" in sys.modules

    def __init__(self, *, ignore: Iterable[Tensor] = ()) -> None:
        super().__init__()
        # id(storage) -> bytes counted for it (0: a state's); a finalizer drops the entry when the
        # storage is freed, so an id is never met again while its entry stands
        self._counted: dict[int, int] = {}
        self._ignored: set[int] = set()
        self.live_bytes = 0
        self.peak_bytes = 0
        for tensor in ignore:
            self.ignore(tensor)

    def ignore(self, tensor: Tensor) -> None:
        """Stop counting `tensor`'s storage (and never count it): a model state (of a ZeRO stage-3
        rank, a DTensor: its local shard)."""
        storage = _local(tensor).untyped_storage()
        key = id(storage)
        if key not in self._counted:
            weakref.finalize(storage, self._free, key)
        self.live_bytes -= self._counted.get(key, 0)
        self._counted[key] = 0
        self._ignored.add(key)

    def count(self, tensor: Tensor) -> None:
        """Count `tensor`'s storage while it lives, as if an op had made it (a step's input batch)."""
        storage = tensor.untyped_storage()
        if id(storage) not in self._counted:
            self._add(storage)

    def hold(self, nbytes: int) -> None:
        """Count `nbytes` more (fewer, when negative) that no op made: a stage-3 unit's parameters,
        gathered where the model is not sharded (workers/models/units.py's Stage3Schedule)."""
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        nbytes = storage.nbytes()
        self._counted[key] = nbytes
        weakref.finalize(storage, self._free, key)
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._counted.pop(key, 0)
        self._ignored.discard(key)

    def resized(self, storage: torch.UntypedStorage) -> None:
        """`storage` was resized in place (FSDP2 frees a gathered unit so and gathers it again into the
        same storage): count what it holds now."""
        key = id(storage)
        if key in self._ignored:
            return
        if key not in self._counted:
            self._add(storage)
            return
        self.live_bytes += storage.nbytes() - self._counted[key]
        self._counted[key] = storage.nbytes()
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = None
        for tensor in outputs if all(isinstance(o, Tensor) for o in outputs) else tree_flatten(out)[0]:
            if not isinstance(tensor, Tensor):
                continue
            storage = _local(tensor).untyped_storage()
            if id(storage) in self._counted:
                continue
            if inputs is None:
                flat = tree_flatten((args, kwargs))[0]
                inputs = {id(_local(t).untyped_storage()) for t in flat if isinstance(t, Tensor)}
            # a view or an in-place result shares an input's storage: nothing new was allocated
            if id(storage) not in inputs:
                self._add(storage)
        return out


def _local(tensor: Tensor) -> Tensor:
    """A DTensor's local shard (ZeRO stage 3's parameters and gradients); any other tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return tensor if to_local is None else to_local()


def model_states(model: nn.Module) -> list[Tensor]:
    """The tensors a model holds between steps: parameters, their gradients and buffers."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    return [*model.parameters(), *grads, *model.buffers()]


def loss_of(output) -> Tensor:
    """The scalar loss of a model's output: the tensor itself, or its `.loss` (transformers' outputs)."""
    loss = getattr(output, "loss", output)
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"the model must return a scalar loss tensor (or an object with .loss), got {type(loss)}")
    return loss


@dataclass(frozen=True, slots=True, kw_only=True)
class StepMemory:
    """Bytes beyond the model states during one micro-batch's forward and backward."""

    activations_bytes: int
    """Alive when forward returns: what autograd saved for backward (and the loss)."""
    temporaries_bytes: int
    """The rest of the step's peak: transient tensors alive at its highest point."""

    @property
    def peak_bytes(self) -> int:
        return self.activations_bytes + self.temporaries_bytes


def measure_step(
    model: nn.Module,
    inputs: Sequence[Tensor],
    run_forward: Callable[[], Tensor],
    run_backward: Callable[[Tensor], None],
    *,
    as_stage: int = 1,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> tuple[Tensor, StepMemory]:
    """loss = run_forward(); run_backward(loss); counted by LiveBytes with the micro-batch's
    `inputs`. Returns the loss and its StepMemory.

    A gradient autograd accumulates into a parameter's `.grad` becomes a state from then on
    (the trace has no flat buffer: its gradients are allocated as they arrive). as_stage 2 or 3:
    the unsharded model counted as a ZeRO rank of that stage holds it: each gradient copied into
    its bucket's staging buffer, of bucket_cap_mb MiB (grad_buckets.Stage2Schedule); FSDP2's
    gathered units and unsharded gradients (units.Stage3Schedule)."""
    meter = LiveBytes(ignore=model_states(model))
    for tensor in inputs:
        meter.count(tensor)
    schedule: Stage2Schedule | Stage3Schedule | None = None
    if as_stage == 2:
        schedule = Stage2Schedule(model, meter, bucket_cap_mb=bucket_cap_mb)
    elif as_stage == 3:
        schedule = Stage3Schedule(model, meter)
    hooks = [
        # at ZeRO stage 2 the optimizer's hook (registered first) has taken the gradient into its bucket
        p.register_post_accumulate_grad_hook(lambda p: None if p.grad is None else meter.ignore(p.grad))
        for p in model.parameters()
        if p.requires_grad and (schedule is None or not schedule.keeps_grad(p))
    ]
    try:
        with meter, storage_resizes(meter), schedule or contextlib.nullcontext():
            loss = loss_of(run_forward())
            activations = meter.live_bytes
            run_backward(loss)
    finally:
        for hook in hooks:
            hook.remove()
    return loss, StepMemory(activations_bytes=activations, temporaries_bytes=meter.peak_bytes - activations)


# --------------------------------------------------------------------------- tracing on fake tensors


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamCounts:
    """A model's parameters, each tensor once (a tied weight is one tensor), by optimizer group."""

    decay_numel: int
    """Trainable tensors of 2 or more dimensions (matrices, embeddings): weight-decayed."""
    no_decay_numel: int
    """Trainable vectors (biases, norms' weights)."""
    frozen_numel: int
    """requires_grad=False: weights alone, no gradient, no optimizer state."""
    gathered_numel: int = 0
    """Held whole at once by a ZeRO stage-3 rank: the root's and two units' (workers/models/units.py)."""

    @property
    def num_params(self) -> int:
        return self.decay_numel + self.no_decay_numel + self.frozen_numel

    @classmethod
    def of(cls, model: nn.Module) -> ParamCounts:
        params = list(model.parameters())  # named_parameters() and parameters() list a tied tensor once
        trainable = [p for p in params if p.requires_grad]
        return cls(
            decay_numel=sum(p.numel() for p in trainable if p.dim() >= 2),
            no_decay_numel=sum(p.numel() for p in trainable if p.dim() < 2),
            frozen_numel=sum(p.numel() for p in params if not p.requires_grad),
            gathered_numel=gathered_numel(model),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepTrace:
    """A traced micro-batch: the model's parameters and the step's memory beyond its states."""

    params: ParamCounts
    memory: StepMemory
    stage2_memory: StepMemory | None = None
    """The same step counted as a ZeRO stage-2 rank holds it (measure_step's as_stage 2): its peak beyond
    `memory`'s is what the rank's staging buffers of its gradient buckets add then."""
    stage3_memory: StepMemory | None = None
    """The same step counted as a ZeRO stage-3 rank holds it (measure_step's as_stage 3): its peak beyond
    `memory`'s is what the rank holds gathered then (units, unsharded gradients)."""
    traced_layers: tuple[int, ...] | None = None
    """The depths traced when the memory was extrapolated per layer; None: the whole model."""

    @property
    def buckets_bytes(self) -> int | None:
        """What a stage-2 rank's step peaks at beyond this step's: its gradient buckets' staging buffers,
        less the gradients they hold, which this step counts as states (the memory model's stage-2 term
        for a traced model)."""
        if self.stage2_memory is None:
            return None
        return max(0, self.stage2_memory.peak_bytes - self.memory.peak_bytes)

    @property
    def gathered_bytes(self) -> int | None:
        """What a stage-3 rank's step peaks at beyond this step's: the units it holds gathered and the
        gradients it holds unsharded then (the memory model's stage-3 term for a traced model)."""
        if self.stage3_memory is None:
            return None
        return max(0, self.stage3_memory.peak_bytes - self.memory.peak_bytes)


class TraceError(ValueError):
    """The model could not be built or stepped on fake tensors; the message names the operation."""


def trace_step(
    build: Callable[[], nn.Module],
    make_inputs: Callable[[], Sequence[Tensor]],
    *,
    dtype: torch.dtype,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> StepTrace:
    """One forward and backward of build()'s model on make_inputs(), on fake tensors, counted as
    a ZeRO stage-1, stage-2 (gradient buckets of bucket_cap_mb MiB) and stage-3 rank holds it.

    build() must construct the model on the meta device (`torch.device("meta")` is current
    while it runs); it is cast to `dtype` there and materialised as fake tensors, uninitialised."""
    params, measured = _counted(build, make_inputs, dtype=dtype, stages=(1, 2, 3), bucket_cap_mb=bucket_cap_mb)
    return StepTrace(params=params, memory=measured[1], stage2_memory=measured[2], stage3_memory=measured[3])


def _counted(
    build: Callable[[], nn.Module],
    make_inputs: Callable[[], Sequence[Tensor]],
    *,
    dtype: torch.dtype,
    stages: tuple[int, ...],
    bucket_cap_mb: float,
) -> tuple[ParamCounts, dict[int, StepMemory]]:
    """build()'s parameters, and its step counted on fake tensors as a rank of each of `stages` holds it."""
    with torch.device("meta"):
        model = _call("building the model", build)
    model = model.to(dtype)  # on meta: tied weights stay tied, nothing is allocated
    params = ParamCounts.of(model)
    measured = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        materialize(model)
        inputs = tuple(make_inputs())
        for stage in stages:
            model.zero_grad(set_to_none=True)  # each count sees the gradients made
            _, measured[stage] = _call(
                "running forward and backward",
                lambda stage=stage: measure_step(
                    model,
                    inputs,
                    lambda: model(*inputs),
                    lambda loss: loss.backward(),
                    as_stage=stage,
                    bucket_cap_mb=bucket_cap_mb,
                ),
            )
    return params, measured


def materialize(model: nn.Module) -> None:
    """model.to_empty(device="cpu"), with tied parameters tied again.

    Moving off the meta device makes a new Parameter per module that held one, which would
    untie a tied LM head: its gradient would then reach `.grad` at once instead of waiting in
    autograd's input buffer for the embedding's part, as a tied weight's does (and the trace
    would count two weights)."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None:
                holders.setdefault(id(param), []).append((module, name))
    model.to_empty(device="cpu")
    for (first, first_name), *others in holders.values():
        for module, name in others:
            module._parameters[name] = first._parameters[first_name]


def trace_layers(
    build: Callable[[int], nn.Module],
    make_inputs: Callable[[], Sequence[Tensor]],
    *,
    dtype: torch.dtype,
    num_layers: int,
    traced_layers: tuple[int, int] = (2, 3),
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> StepTrace:
    """trace_step of a stack of `num_layers` identical layers, from traces of two shallower stacks.

    Activations and temporaries are affine in the depth L once L >= 2: forward adds one layer's
    saved tensors per layer, and the peak falls in the head or the last layer's backward, which
    do not depend on L. So m(L) = m(a) + (L - a)·(m(b) - m(a)) for traced depths a < b. A stage-2
    rank's staging buffers are not (a deeper stack cuts more buckets, and stages more of them as the
    layers before hold less): that count runs on the whole stack, whose parameters are counted too."""
    low, high = traced_layers
    if num_layers <= high:
        return trace_step(lambda: build(num_layers), make_inputs, dtype=dtype, bucket_cap_mb=bucket_cap_mb)
    a, b = (
        _counted(lambda n=n: build(n), make_inputs, dtype=dtype, stages=(1, 3), bucket_cap_mb=bucket_cap_mb)[1]
        for n in traced_layers
    )
    params, deep = _counted(
        lambda: build(num_layers), make_inputs, dtype=dtype, stages=(2,), bucket_cap_mb=bucket_cap_mb
    )

    def extrapolate(at_low: int, at_high: int) -> int:
        return at_low + (num_layers - low) * (at_high - at_low) // (high - low)

    def extrapolated(stage: int) -> StepMemory:
        return StepMemory(
            activations_bytes=extrapolate(a[stage].activations_bytes, b[stage].activations_bytes),
            temporaries_bytes=extrapolate(a[stage].temporaries_bytes, b[stage].temporaries_bytes),
        )

    return StepTrace(
        params=params,
        memory=extrapolated(1),
        stage2_memory=deep[2],
        stage3_memory=extrapolated(3),
        traced_layers=traced_layers,
    )


def _call(what: str, fn):
    try:
        return fn()
    except TraceError:
        raise
    except Exception as exc:  # the user's model: any exception is theirs to read, with the op that failed
        raise TraceError(f"{what} on fake tensors failed: {type(exc).__name__}: {_first_line(exc)}") from exc


def _first_line(exc: Exception) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:500] if lines else ""

"""Models of the user's own code (the python kind): an entrypoint imported from the job's code
bundle, built for a rank or traced for a plan.

The bundle is the process's working directory and the first entry of sys.path: the child's parent
(a rank's actor, a trace's task) unpacks it there (workers/training/bundles.py), and nowhere else; the API process
never imports this room. Every failure of the user's code (an import error, an exception in the
function, a wrong return type, a module that cannot be built on the meta device, a forward that
fails on fake tensors) is an InvalidModelError that quotes the exception and the user's own
file:line, which the service turns into a 422 at submit.
"""

from __future__ import annotations

import importlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from workers.config import InvalidModelError, PythonSpec
from workers.memory.buckets import DEFAULT_BUCKET_CAP_MB
from workers.models.trace import StepTrace, TraceError, trace_step

ENTRYPOINT = "model.entrypoint"


def load_entrypoint(entrypoint: str) -> Callable[..., Any]:
    """The function `package.module:function` names, imported from the working directory."""
    module_name, _, function_name = entrypoint.partition(":")
    try:
        module = importlib.import_module(module_name)
    except BaseException as exc:  # noqa: BLE001 - SystemExit of user code at import time too: the user's to read
        raise _user_error(f"importing {module_name!r} failed", exc) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise InvalidModelError(ENTRYPOINT, f"module {module_name!r} has no function {function_name!r}")
    return function


def call_entrypoint(entrypoint: str, args: dict[str, Any]) -> nn.Module:
    """function(**args) on the current default device: the user's module, or InvalidModelError."""
    function = load_entrypoint(entrypoint)
    try:
        module = function(**args)
    except Exception as exc:  # noqa: BLE001 - any exception of the user's function is theirs to read
        raise _user_error(f"{entrypoint}(**args) raised", exc) from None
    if not isinstance(module, nn.Module):
        raise InvalidModelError(
            ENTRYPOINT,
            f"{entrypoint} returned {type(module).__module__}.{type(module).__qualname__}, not a torch.nn.Module",
        )
    return module


def build_python(
    spec: PythonSpec,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    activation_checkpointing: bool = False,
) -> nn.Module:
    """A rank's model: the entrypoint's module initialised from `seed` (the same on every rank), in
    `dtype` on `device`. The module's own code decides any activation checkpointing."""
    if activation_checkpointing:
        raise InvalidModelError("activation_checkpointing", "a python model checkpoints its own activations, if any")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        module = call_entrypoint(spec.entrypoint, spec.args)
    return module.to(device=device, dtype=dtype).train()


@dataclass(frozen=True, slots=True, kw_only=True)
class PythonTrace:
    """A python model's traced step and the token ids it takes."""

    trace: StepTrace
    vocab_size: int


def trace_python(
    entrypoint: str,
    args: dict[str, Any],
    *,
    precision_dtype: torch.dtype,
    micro_batch_size: int,
    seq_len: int,
    vocab_size: int | None = None,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> PythonTrace:
    """One micro-batch of the model's step on fake tensors (workers/models/trace.py), the whole model
    traced (user code has no depth to extrapolate by), stage 2's buckets of bucket_cap_mb MiB.

    The model's vocabulary is read off the embedding that looks up input_ids: every nn.Embedding
    called with input_ids itself is seen during the traced forward, and the smallest bounds the
    ids. `vocab_size` when given must fit it; without one the embedding's rows are the vocabulary.
    The traced batch holds the largest id, so an index the model cannot take is found here."""
    with torch.device("meta"):
        module = call_entrypoint(entrypoint, args)
    lookups: list[int] = []
    ids_box: list[Tensor] = []

    def on_embedding(embedding: nn.Embedding, inputs: tuple[Any, ...]) -> None:
        if ids_box and inputs and inputs[0] is ids_box[0]:
            lookups.append(embedding.num_embeddings)

    hooks = [m.register_forward_pre_hook(on_embedding) for m in module.modules() if isinstance(m, nn.Embedding)]

    def make_inputs() -> tuple[Tensor, Tensor]:
        largest = (vocab_size or 1) - 1
        ids_box[:] = [torch.full((micro_batch_size, seq_len), largest, dtype=torch.long)]
        return ids_box[0], torch.zeros(micro_batch_size, seq_len, dtype=torch.long)  # input_ids, labels

    try:
        trace = trace_step(lambda: module, make_inputs, dtype=precision_dtype, bucket_cap_mb=bucket_cap_mb)
    except TraceError as exc:
        raise _user_error(str(exc), exc.__cause__ or exc, quote=False) from None
    finally:
        for hook in hooks:
            hook.remove()
    return PythonTrace(trace=trace, vocab_size=_vocabulary(vocab_size, lookups))


def _vocabulary(stated: int | None, lookups: list[int]) -> int:
    rows = min(lookups, default=None)
    if stated is None and rows is None:
        raise InvalidModelError(
            "model.vocab_size",
            "no nn.Embedding of the model looks up input_ids: state vocab_size, the number of token ids it takes",
        )
    if stated is not None and rows is not None and stated > rows:
        raise InvalidModelError(
            "model.vocab_size", f"vocab_size ({stated}) is more than the {rows} rows of the embedding of input_ids"
        )
    return stated if stated is not None else rows


def _user_error(what: str, exc: BaseException, *, quote: bool = True) -> InvalidModelError:
    """`what`, the exception (type: message, first line) and where in the user's files it came from."""
    lines = str(exc).strip().splitlines()
    text = f"{what}: {type(exc).__name__}: {lines[0][:500] if lines else ''}".rstrip(": ") if quote else what
    where = user_location(exc)
    return InvalidModelError(ENTRYPOINT, f"{text} (at {where})" if where else text)


def user_location(exc: BaseException) -> str | None:
    """`file:line` of the innermost frame of `exc` in the working directory's files (the bundle's),
    relative to it; a SyntaxError's own file and line; None when none of the frames is the user's."""
    root = os.path.realpath(os.getcwd())
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        candidates = [(exc.filename, exc.lineno)]
    else:
        candidates = [(frame.filename, frame.lineno) for frame in reversed(traceback.extract_tb(exc.__traceback__))]
    for filename, lineno in candidates:
        real = os.path.realpath(filename)
        if os.path.commonpath([real, root]) == root and "site-packages" not in real.split(os.sep):
            return f"{os.path.relpath(real, root)}:{lineno}"
    return None

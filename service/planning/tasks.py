"""Work the API process hands to a Ray task because it needs torch or runs a model's code: a traced
plan (service/planning/traces.py), a dataset read and tokenized at submit (service/planning/dataset_checks.py). One way
to run it: within a time limit, stopped past it, and every way it can fail answered as a 4xx or a
503, never a 500.

Whose fault a failure is decides its answer. The input's — the function raised, the user's code
crashed or ran its worker out of memory, the user's code bundle could not be fetched or unpacked for
the task's child — is a 422 naming the request field to blame. The cluster's — Ray unreachable, a
node or object lost, any other Ray error — is a 503 with Retry-After: the same request may succeed
later. `run_task_async` awaits the task without holding a thread (a route's way); `run_task` blocks
(the CLI's, and code that runs in a worker thread anyway).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from service.errors import ServiceError
from workers.records import RunAs
from workers.runtime.isolated import IsolatedCall, run_isolated
from workers.training.bundles import BundleError

log = logging.getLogger(__name__)

T = TypeVar("T")
_REMOTE: Any = None
CHILD_GRACE_S = 5.0
"""How much longer than its caller waits a task's child may run before the task kills it."""
RETRY_AFTER_S = 10
"""What a 503 for the cluster's fault asks the client to wait before trying again."""
_MAX_DETAIL_CHARS = 300


def run_task(
    fn: Callable[[Any], T],
    request: Any,
    *,
    timeout_s: float,
    timed_out: Callable[[], ServiceError],
    failed: Callable[[BaseException], ServiceError],
    code: str | None = None,
    blame: str = "body",
    isolation: Isolation | None = None,
) -> T:
    """fn(request) as a Ray task within timeout_s, waited for in this thread. Past the limit the task
    is cancelled and timed_out() raised; fn's own exception becomes failed(cause); a crash of its
    process is a 422 naming `blame` (the request field whose code or data ran), a bundle that cannot
    be unpacked a 422 naming `code`, any other Ray error a 503. `code` (a code bundle's stored URI)
    is unpacked by the task for its child alone, never put on the task's own import path."""
    import ray

    ref = _submit(_call(fn, request, timeout_s, code, blame, isolation))
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise timed_out() from None
    except Exception as exc:  # noqa: BLE001  (every Ray error is answered; task_error re-raises the rest)
        raise task_error(exc, failed=failed, blame=blame) from None


async def run_task_async(
    fn: Callable[[Any], T],
    request: Any,
    *,
    timeout_s: float,
    timed_out: Callable[[], ServiceError],
    failed: Callable[[BaseException], ServiceError],
    code: str | None = None,
    blame: str = "body",
    isolation: Isolation | None = None,
) -> T:
    """run_task awaited on the event loop: no request thread waits while the task runs. A request
    cancelled meanwhile (its client gone) cancels the task too."""
    import ray

    ref = _submit(_call(fn, request, timeout_s, code, blame, isolation))
    try:
        return await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout_s)
    except TimeoutError:
        ray.cancel(ref, force=True)
        raise timed_out() from None
    except asyncio.CancelledError:
        ray.cancel(ref, force=True)
        raise
    except Exception as exc:  # noqa: BLE001  (every Ray error is answered; task_error re-raises the rest)
        raise task_error(exc, failed=failed, blame=blame) from None


@dataclass(frozen=True, slots=True, kw_only=True)
class Isolation:
    """How a task's child runs: as whom, what its answer is, where its token files go."""

    result: type | None = None
    """The dataclass the child's JSON answer is checked against and rebuilt as (None: the JSON as is)."""
    run_as: RunAs | None = None
    """The request's owner's uid and gid (ZERO1_RUN_AS)."""
    token_cache: str | None = None
    """The dataset cache's tokens/ directory, where the task moves a token file its child made."""
    token_store: str | None = None
    """The object store's token cache (s3://.../datasets/tokens), where the token file of data staged
    from a store is put."""
    child: bool = True
    """False: the work runs no user code and reads no user file (a built-in model's trace), so it
    runs in the task's own process."""


def _call(
    fn: Callable[[Any], Any],
    request: Any,
    timeout_s: float,
    code: str | None,
    blame: str,
    isolation: Isolation | None,
) -> IsolatedCall:
    """fn(request) as the task runs it: in a child of the task's process (workers/runtime/isolated.py), killed
    a little after the caller stops waiting (the caller's timeout answers first)."""
    isolation = isolation or Isolation()
    return IsolatedCall(
        function=f"{fn.__module__}:{fn.__qualname__}",
        argument=request,
        result=isolation.result,
        blame=blame,
        timeout_s=timeout_s + CHILD_GRACE_S,
        run_as=isolation.run_as,
        bundle=code,
        token_cache=isolation.token_cache,
        token_store=isolation.token_store,
        child=isolation.child,
    )


def _submit(call: IsolatedCall):
    """The task's ObjectRef. num_cpus=0: such a task takes seconds and must not queue behind training
    ranks holding the CPUs (the callers bound how many run at once); no retries: a failure is the
    input's, or the cluster's to report. A 503 when this process is not connected to Ray (ray.remote
    would start a Ray of its own here)."""
    import ray

    global _REMOTE
    if not ray.is_initialized():
        raise cluster_unavailable("Ray is not connected")
    if _REMOTE is None:  # made once; ray.remote needs Ray imported, which the API does lazily
        _REMOTE = ray.remote(num_cpus=0, max_retries=0)(run_isolated)
    try:
        return _REMOTE.remote(call)
    except (ray.exceptions.RayError, ConnectionError) as exc:
        raise cluster_unavailable(f"the task could not be submitted: {_first_line(exc)}") from None


def task_error(
    exc: BaseException,
    *,
    failed: Callable[[BaseException], ServiceError],
    blame: str,
) -> ServiceError:
    """The answer to a task that did not return: a ServiceError, or `exc` itself re-raised when it is no
    Ray error (a bug here is not to be hidden as a 503)."""
    import ray

    errors = ray.exceptions
    if isinstance(exc, errors.RayTaskError) and isinstance(exc.cause, BundleError):
        return input_fault("code", str(exc.cause))
    if isinstance(exc, errors.RayTaskError):
        return failed(exc.cause if exc.cause is not None else exc)
    if isinstance(exc, errors.UnserializableException | errors.UserCodeException):
        return failed(exc)
    if isinstance(exc, errors.OutOfMemoryError):
        return input_fault(blame, f"the task's process was killed for using too much memory: {_first_line(exc)}")
    if isinstance(exc, errors.WorkerCrashedError):
        return input_fault(
            blame,
            "the task's process exited while it ran the request's code (os._exit, a signal, or the "
            f"out-of-memory killer): {_first_line(exc)}",
        )
    if isinstance(exc, errors.RayError | ConnectionError):
        log.warning("a task failed for the cluster: %s: %s", type(exc).__name__, _first_line(exc))
        return cluster_unavailable(f"{type(exc).__name__}: {_first_line(exc)}")
    raise exc


def input_fault(field: str, message: str) -> ServiceError:
    """A 422 blaming the request's `field` for what its task did."""
    detail = [{"field": field, "message": message, "type": "value_error"}]
    return ServiceError(f"{field}: {message}", status_code=422, error="task_failed", detail=detail)


def cluster_unavailable(why: str) -> ServiceError:
    """A 503: the Ray cluster could not run the task; the same request may succeed later."""
    return ServiceError(
        f"the Ray cluster could not run the task ({why}); retry in {RETRY_AFTER_S} s",
        status_code=503,
        error="cluster_unavailable",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return (lines[0] if lines else type(exc).__name__)[:_MAX_DETAIL_CHARS]

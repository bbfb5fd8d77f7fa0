"""Work the API process hands to a Ray task because it needs torch or runs a model's code: a traced
plan (service/tracing.py), a dataset read and tokenized at submit (service/dataprep.py). One way
to run it: within a time limit, stopped past it, its failure turned into the caller's 422."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from service.errors import ServiceError

T = TypeVar("T")
_REMOTES: dict[Callable[..., Any], Any] = {}


def run_task(
    fn: Callable[[Any], T],
    request: Any,
    *,
    timeout_s: float,
    timed_out: Callable[[], ServiceError],
    failed: Callable[[BaseException], ServiceError],
    runtime_env: dict[str, Any] | None = None,
) -> T:
    """fn(request) as a Ray task within timeout_s. num_cpus=0: such a task takes seconds and must
    not queue behind training ranks holding the CPUs; no retries: a failure is the input's. Past
    the limit the task is cancelled and timed_out() raised; its exception becomes failed(cause).
    `runtime_env` (a code bundle's working_dir) runs it in a worker of that environment."""
    import ray

    remote = _REMOTES.get(fn)
    if remote is None:  # made once per function; ray.remote needs Ray imported, which the API does lazily
        remote = _REMOTES[fn] = ray.remote(num_cpus=0, max_retries=0)(fn)
    ref = (remote.options(runtime_env=runtime_env) if runtime_env else remote).remote(request)
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise timed_out() from None
    except ray.exceptions.RayTaskError as exc:
        raise failed(exc.cause if exc.cause is not None else exc) from None

"""A `dataset` job's data checked at submit: read and tokenized into the token cache in a Ray task.

Reading with `datasets` and tokenizing need libraries the API process does not load (torch among
them), so a Ray task (num_cpus=0, like a trace: the submit must not queue behind training ranks)
does it within ZERO1_DATA_TIMEOUT_S, awaited by the submit without holding a thread, in a slot of
those a trace takes too (ZERO1_MAX_TASKS, ZERO1_MAX_TASKS_PER_USER). It leaves the token file in
the cache, so the job's ranks only hash the files and map it. Data on an object store are staged
for the check's child by its task (workers/runtime/isolated.py), which then stores the token file in
the store's token cache and answers its URI as the summary's token_file. Its ValueErrors name the field
("data.text_field: ...") and are answered 422 with that field.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

from service.concurrency import Slots
from service.errors import ServiceError
from service.planning.tasks import Isolation, run_task, run_task_async
from workers.config import DatasetSpec
from workers.records import DatasetSummary, RunAs
from workers.training.staging import token_store
from workers.uris import is_remote


@dataclass(frozen=True, slots=True, kw_only=True)
class DatasetRequest:
    """What the check depends on: the data, and the model's vocabulary and blocks."""

    data: DatasetSpec
    vocab_size: int
    seq_len: int
    global_batch_size: int
    seed: int
    tokenizer_dir: str | None = None
    """An hf model's directory, whose tokenizer.json is used when data.tokenizer is omitted."""


def run_check(request: DatasetRequest) -> DatasetSummary:
    """The check itself, in the process that calls it (a Ray task's): a DatasetSummary."""
    from workers.data.datasets import DatasetSource

    source = DatasetSource(
        spec=request.data,
        seq_len=request.seq_len,
        seed=request.seed,
        vocab_size=request.vocab_size,
        global_batch_size=request.global_batch_size,
        tokenizer_dir=request.tokenizer_dir,
    )
    return source.summary()


class DatasetChecker:
    """Runs run_check on the Ray cluster within `timeout_s` (or in this process, for the CLI and tests)."""

    def __init__(
        self,
        *,
        timeout_s: float,
        in_process: bool = False,
        slots: Slots | None = None,
        run_as: Callable[[str | None], RunAs | None] = lambda user: None,
        token_cache: str | None = None,
        token_store: str | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.run_as = run_as
        """A user -> the uid and gid its checks' children run under (ZERO1_RUN_AS)."""
        self.token_cache = token_cache
        """The cache's tokens/ directory: a token file a check's child made is moved there."""
        self.token_store = token_store
        """The object store's token cache, where data read from a store leave their token file; None: no store."""
        self.in_process = in_process
        self.slots = slots
        """The bound on checks running at once (shared with traces); None: unbounded."""

    def check(self, request: DatasetRequest) -> DatasetSummary:
        """The check, waited for in this thread (a route awaits check_async)."""
        if self.in_process:
            try:
                return run_check(request)
            except ValueError as exc:
                raise invalid(exc) from None
        return run_task(run_check, request, **self._task_options(user=None))

    async def check_async(self, request: DatasetRequest, *, user: str | None) -> DatasetSummary:
        """The check awaited without a thread, in one of `user`'s slots (a 429 when none is free)."""
        if self.in_process:
            return self.check(request)
        with self.slots.hold(user) if self.slots is not None else contextlib.nullcontext():
            return await run_task_async(run_check, request, **self._task_options(user=user))

    def _task_options(self, *, user: str | None) -> dict:
        # the task reads and tokenizes the user's files: a crash of its process is blamed on them
        isolation = Isolation(
            result=DatasetSummary, run_as=self.run_as(user), token_cache=self.token_cache, token_store=self.token_store
        )
        return {
            "timeout_s": self.timeout_s,
            "timed_out": self._timed_out,
            "failed": invalid,
            "blame": "data",
            "isolation": isolation,
        }

    def _timed_out(self) -> ServiceError:
        return ServiceError(
            f"data: reading and tokenizing the dataset took more than ZERO1_DATA_TIMEOUT_S = {self.timeout_s:g} s; "
            "it was stopped",
            status_code=422,
            error="data_timeout",
        )


def token_store_of(checkpoint_uri: str) -> str | None:
    """The object store's token cache under ZERO1_CHECKPOINT_URI; None when that is a directory."""
    return token_store(checkpoint_uri) if is_remote(checkpoint_uri) else None


def invalid(exc: BaseException) -> ServiceError:
    """A 422 naming the field the worker's message starts with ("data.tokenizer: ...")."""
    lines = str(exc).strip().splitlines()
    first = lines[0] if lines else type(exc).__name__
    if not isinstance(exc, ValueError):  # not a check that failed, but the reading (an OSError...): say what broke
        first = f"data: the dataset could not be read: {type(exc).__name__}: {first}"
    return invalid_data(first)


def invalid_data(message: str) -> ServiceError:
    """A 422 for "data.<field>: why", naming that field in its detail."""
    field, _, why = message.partition(": ")
    if not field.startswith("data"):
        field = "data"
        why = message
    detail = [{"field": field, "message": why, "type": "value_error"}]
    return ServiceError(message, status_code=422, error="invalid_request", detail=detail)

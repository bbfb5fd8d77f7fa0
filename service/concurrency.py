"""Concurrency limits of the API's long calls: a global and a per-user count of calls in flight,
refused with a 429 past either.

A traced plan or a dataset's tokenizing is a Ray task that may run for minutes, and a log
follower holds its connection until the job ends; without a bound, one user could start as many
as their client can open, taking the cluster's CPUs or the server's connections from everyone.
A call past the bound is not queued: it is answered at once with the numbers and Retry-After,
so that no request waits on the server for a slot.

May import: service.errors, service.settings.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from service.errors import ServiceError
from service.settings import Settings


@dataclass(frozen=True, slots=True, kw_only=True)
class SlotLimits:
    """The bounds of one kind of call and the settings that set them (which a 429 names)."""

    what: str
    """What is counted, plural: "traces and dataset checks"."""
    total: int
    per_user: int
    total_setting: str
    per_user_setting: str
    retry_after_s: int


class Slots:
    """Calls in flight, in total and per user (None: the anonymous user of an app without tokens).
    Thread-safe: routes take slots on the event loop, tests and worker threads too."""

    def __init__(self, limits: SlotLimits) -> None:
        self.limits = limits
        self._lock = threading.Lock()
        self._by_user: Counter[str | None] = Counter()
        self._total = 0

    @property
    def in_flight(self) -> int:
        return self._total

    def acquire(self, user: str | None) -> None:
        """Take a slot for `user`, or raise the 429 that says which bound is full."""
        with self._lock:
            if self._total >= self.limits.total:
                raise self._refusal(f"{self._total} are in flight", self.limits.total_setting, self.limits.total)
            if self._by_user[user] >= self.limits.per_user:
                who = "anonymous" if user is None else user
                raise self._refusal(
                    f"{who} has {self._by_user[user]} in flight", self.limits.per_user_setting, self.limits.per_user
                )
            self._total += 1
            self._by_user[user] += 1

    def release(self, user: str | None) -> None:
        with self._lock:
            assert self._by_user[user] > 0, f"a slot of {user!r} released twice"
            self._total -= 1
            self._by_user[user] -= 1
            if not self._by_user[user]:
                del self._by_user[user]

    @contextmanager
    def hold(self, user: str | None) -> Iterator[None]:
        """A slot for the block (a 429 instead of entering it when none is free)."""
        self.acquire(user)
        try:
            yield
        finally:
            self.release(user)

    def _refusal(self, count: str, setting: str, bound: int) -> ServiceError:
        limits = self.limits
        return ServiceError(
            f"too many {limits.what} at once: {count}, the limit of {setting} = {bound}; "
            f"retry in {limits.retry_after_s} s",
            status_code=429,
            error="too_many_requests",
            headers={"Retry-After": str(limits.retry_after_s)},
        )


def task_limits(settings: Settings) -> SlotLimits:
    """The bounds on traced plans and dataset checks: Ray tasks that take seconds to minutes."""
    return SlotLimits(
        what="traces and dataset checks",
        total=settings.max_tasks,
        per_user=settings.max_tasks_per_user,
        total_setting="ZERO1_MAX_TASKS",
        per_user_setting="ZERO1_MAX_TASKS_PER_USER",
        retry_after_s=5,
    )


def follower_limits(settings: Settings) -> SlotLimits:
    """The bounds on log streams (?follow=true), each open until its job ends."""
    return SlotLimits(
        what="log streams",
        total=settings.max_log_followers,
        per_user=settings.max_log_followers_per_user,
        total_setting="ZERO1_MAX_LOG_FOLLOWERS",
        per_user_setting="ZERO1_MAX_LOG_FOLLOWERS_PER_USER",
        retry_after_s=30,
    )

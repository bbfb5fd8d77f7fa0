"""A sweep, as the client sees it: `Sweep` (its API answer in `info`, refreshed on demand)."""

from __future__ import annotations

import time
from typing import Any

from service.schemas.sweeps import SweepPublic

from .errors import raise_for
from .jobs import Job

ENDED = frozenset({"succeeded", "failed", "cancelled"})
"""The statuses a sweep never leaves."""


class Sweep:
    """A sweep of the service behind `client`: `info` is the last SweepPublic it answered."""

    def __init__(self, client: Any, sweep: SweepPublic) -> None:
        self.client = client
        self.info = sweep

    @property
    def id(self) -> int:
        return self.info.id

    @property
    def status(self) -> str:
        return self.info.status

    @property
    def done(self) -> bool:
        """Every trial has ended (a suspended sweep has not: it waits for a resume)."""
        return self.info.status in ENDED

    def refresh(self) -> Sweep:
        """Asks again; the sweep."""
        self.info = SweepPublic.model_validate(raise_for(self.client.http.get(f"/v1/sweeps/{self.id}")).json())
        return self

    def wait(self, timeout: float | None = None, *, interval: float = 1.0) -> Sweep:
        """Until every trial has ended (a TimeoutError after `timeout` seconds); the sweep, refreshed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.refresh().done:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"sweep {self.id} is still running after {timeout} s")
            time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))
        return self

    def best(self) -> Job | None:
        """The job of the succeeded trial with the least metric, as of the last refresh; None before one."""
        best = self.info.best
        return None if best is None or best.job_id is None else self.client.job(best.job_id)

    def cancel(self) -> Sweep:
        """Its trials' jobs cancelled and the rest skipped; the sweep as the API answered."""
        return self._steer("cancel")

    def suspend(self) -> Sweep:
        """No further trial submitted, its trials' jobs suspended (a running one with a checkpoint)."""
        return self._steer("suspend")

    def resume(self) -> Sweep:
        """Its suspended trials' jobs back in the queue, its next trials submitted again."""
        return self._steer("resume")

    def _steer(self, action: str) -> Sweep:
        answer = raise_for(self.client.http.post(f"/v1/sweeps/{self.id}/{action}"))
        self.info = SweepPublic.model_validate(answer.json())
        return self

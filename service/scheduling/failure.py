"""The failure policy, as a pure function of what the scheduler knows of a failed attempt: retry it
from the latest checkpoint (at which N), send it back to the queue, or fail the job, with the reason.

A failed or lost attempt is retried while the job's max_retries allows, each retry counted; a
retry runs at the N the scheduler found free for it (service/scheduling/elastic.py, relaunch_size),
and goes back to the queue, its retry spent, where its owner's quota no longer holds its fewest GPUs.
An attempt that ran out of memory is relaunched at the smaller configuration its Replan names
(service/intake/replans.py) with no retry spent, as DeepSpeed's and Determined's users expect of a
job that only asked too much of a GPU; it is bounded, as each replan plans fewer bytes than the last.
With no Replan, or none left, it is a failure as any other. Ray Train v2's FailurePolicy.make_decision
is the model.

No database, no Ray, no clock: service/scheduling/scheduler.py gathers the failure and
service/scheduling/outcomes.py carries out the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from service.schemas.requests import JobSpec
from service.schemas.responses import PlanPublic
from workers.records import RankError


class FailureAction(str, Enum):
    """What the scheduler does with a failed attempt."""

    RETRY = "retry"
    """A new attempt from the latest complete checkpoint, at the decision's size."""
    REQUEUE = "requeue"
    """A retry spent, but past its owner's GPU quota: back to the queue, holding no GPU."""
    FAIL = "fail"
    """No retry left: the job fails with the cause."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Replan:
    """An out-of-memory attempt's job at its next configuration (the same global batch, fewer planned
    bytes), or, without spec and plan, why there is none."""

    reason: str
    """The event's words: `out of memory at micro_batch_size 4 on rank 0: retrying at ...`, or why not."""
    spec: JobSpec | None = None
    plan: PlanPublic | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class AttemptFailure:
    """A failed (or lost) attempt, as the scheduler knows it."""

    error: RankError | None
    """Why it failed; None where its supervisor gave no cause."""
    num_retries: int
    """Retries the job has spent before this failure."""
    relaunch_size: int | None
    """The N a retry would run at now (elastic.relaunch_size); None past its owner's GPU quota."""
    replan: Replan | None = None
    """An out-of-memory failure's next configuration (or why none); None for any other failure."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FailureDecision:
    """What to do, and the words the job's event says it with."""

    action: FailureAction
    reason: str
    """The cause, with the retry this is or the retries spent."""
    num_retries: int
    """Retries the job has spent, this one counted."""
    size: int | None = None
    """RETRY's N; None otherwise."""
    tail: str = ""
    """The failing rank's last traceback lines, each after a newline ("" without them)."""
    replan: Replan | None = None
    """The configuration RETRY or REQUEUE relaunches at, its spec and plan (an out-of-memory replan)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class FailurePolicy:
    """A job's policy: retry a failed attempt up to max_retries times, then fail."""

    max_retries: int
    """The job's spec.max_retries: 0 fails at the first failure."""

    def make_decision(self, failure: AttemptFailure) -> FailureDecision:
        """Retry, requeue or fail `failure`'s job."""
        error = failure.error
        cause = "failed" if error is None else error.reason()
        tail = "" if error is None else error.traceback_text()
        replan = failure.replan if error is not None and error.is_oom else None
        if replan is not None and replan.spec is not None:  # no retry spent: it plans fewer bytes each time
            action = FailureAction.RETRY if failure.relaunch_size is not None else FailureAction.REQUEUE
            quota = "" if failure.relaunch_size is not None else "; past its owner's GPU quota"
            reason = f"{replan.reason}; no retry spent{quota}"
            return FailureDecision(
                action=action,
                reason=reason,
                num_retries=failure.num_retries,
                size=failure.relaunch_size,
                tail=tail,
                replan=replan,
            )
        if replan is not None:
            cause = f"{cause}; {replan.reason}"
        if failure.num_retries >= self.max_retries:
            spent = f" after {failure.num_retries} of max_retries {self.max_retries}" if self.max_retries else ""
            return FailureDecision(
                action=FailureAction.FAIL, reason=f"{cause}{spent}", num_retries=failure.num_retries, tail=tail
            )
        num_retries = failure.num_retries + 1
        cause = f"{cause}; retry {num_retries} of {self.max_retries}"
        if failure.relaunch_size is None:
            reason = f"{cause}; past its owner's GPU quota"
            return FailureDecision(action=FailureAction.REQUEUE, reason=reason, num_retries=num_retries, tail=tail)
        return FailureDecision(
            action=FailureAction.RETRY, reason=cause, num_retries=num_retries, size=failure.relaunch_size, tail=tail
        )

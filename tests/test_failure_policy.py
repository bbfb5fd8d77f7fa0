"""The failure policy (service/scheduling/failure.py): a failed attempt is retried at the N the
scheduler found while max_retries allows, sent back to the queue past its owner's quota, else its
job fails with the cause and the retries spent.

Pure functions: each case states the failure and checks the decision.

Packages: service.scheduling, workers.records (root_cause: which rank's failure is the cause).
"""

from __future__ import annotations

from dataclasses import replace

from service.scheduling.failure import AttemptFailure, FailureAction, FailureDecision, FailurePolicy
from workers.records import RankError, root_cause

OOM = RankError(
    exception="OutOfMemoryError",
    message="CUDA out of memory",
    rank=1,
    node_id="n1",
    traceback=("File train.py, line 3", "OutOfMemoryError: CUDA out of memory"),
)
TAIL = "\nFile train.py, line 3\nOutOfMemoryError: CUDA out of memory"


def failure(*, num_retries: int = 0, relaunch_size: int | None = 2, error: RankError | None = OOM) -> AttemptFailure:
    return AttemptFailure(error=error, num_retries=num_retries, relaunch_size=relaunch_size)


def test_a_job_without_retries_fails_at_its_first_failure_with_the_rank_and_its_traceback():
    decision = FailurePolicy(max_retries=0).make_decision(failure())
    assert decision == FailureDecision(
        action=FailureAction.FAIL,
        reason="rank 1 on node n1: OutOfMemoryError: CUDA out of memory",
        num_retries=0,
        tail=TAIL,
    )


def test_a_failure_with_retries_left_is_retried_at_the_size_found_and_counted():
    decision = FailurePolicy(max_retries=3).make_decision(failure(num_retries=1, relaunch_size=4))
    assert decision == FailureDecision(
        action=FailureAction.RETRY,
        reason="rank 1 on node n1: OutOfMemoryError: CUDA out of memory; retry 2 of 3",
        num_retries=2,
        size=4,
        tail=TAIL,
    )


def test_the_last_retry_spent_fails_the_job_saying_how_many():
    decision = FailurePolicy(max_retries=2).make_decision(failure(num_retries=2))
    assert (decision.action, decision.num_retries, decision.size) == (FailureAction.FAIL, 2, None)
    assert decision.reason == "rank 1 on node n1: OutOfMemoryError: CUDA out of memory after 2 of max_retries 2"


def test_a_retry_past_its_owners_quota_goes_back_to_the_queue_its_retry_spent():
    decision = FailurePolicy(max_retries=1).make_decision(failure(relaunch_size=None))
    assert (decision.action, decision.num_retries, decision.size) == (FailureAction.REQUEUE, 1, None)
    assert decision.reason.endswith("; retry 1 of 1; past its owner's GPU quota")


def test_a_failure_without_a_cause_says_failed_and_has_no_traceback():
    retried = FailurePolicy(max_retries=1).make_decision(failure(error=None))
    assert (retried.action, retried.reason, retried.tail) == (FailureAction.RETRY, "failed; retry 1 of 1", "")
    ended = FailurePolicy(max_retries=0).make_decision(failure(error=None))
    assert (ended.action, ended.reason, ended.tail) == (FailureAction.FAIL, "failed", "")


def test_a_supervisor_lost_is_retried_as_a_failure_is():
    lost = RankError(exception="SupervisorLost", message="supervisor zero1-job-1-a0 died")
    decision = FailurePolicy(max_retries=1).make_decision(failure(error=lost, relaunch_size=1))
    assert (decision.action, decision.size) == (FailureAction.RETRY, 1)
    assert decision.reason == "SupervisorLost: supervisor zero1-job-1-a0 died; retry 1 of 1"


GLOO_PEER_GONE = RankError(
    exception="RuntimeError",
    message="[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4211: "
    "Connection reset by peer",
    rank=0,
)
CHILD_EXITED = RankError(exception="ChildExited", message="rank 1 exited with code 3", rank=1)
USER_ERROR = RankError(exception="ValueError", message="bad batch", rank=1)


def test_the_attempt_fails_with_the_rank_that_died_whichever_report_arrived_first():
    """When rank 1 dies, rank 0's collective fails at the same moment: its report may reach the
    supervisor first (seen in CI), and the job must still name the rank that died."""
    assert GLOO_PEER_GONE.is_peer_loss and not CHILD_EXITED.is_peer_loss and not USER_ERROR.is_peer_loss
    assert root_cause([GLOO_PEER_GONE, CHILD_EXITED]) == CHILD_EXITED
    assert root_cause([CHILD_EXITED, GLOO_PEER_GONE]) == CHILD_EXITED
    assert root_cause([GLOO_PEER_GONE, USER_ERROR]) == USER_ERROR


def test_with_only_collective_errors_the_first_to_arrive_is_the_cause():
    later = replace(GLOO_PEER_GONE, rank=1, message="NCCL error: remote process exited or there was a network error")
    assert later.is_peer_loss
    assert root_cause([GLOO_PEER_GONE, later]) == GLOO_PEER_GONE
    assert root_cause([later, GLOO_PEER_GONE]) == later

"""Estimated starts (service/scheduling/estimates.py): the queue's policy replayed forward on a snapshot.
Jobs holding GPUs end after their steps left x their step time, the queue ahead takes the GPUs in the
policy's order (backfill and preemption as the scheduler does them), and a start that depends on when a
job of unknown length ends is unknown.

Pure functions: each case states the cluster and checks the seconds until each queued job starts.

Packages: service.scheduling.
"""

from __future__ import annotations

import pytest

from service.scheduling.estimates import starts
from service.scheduling.queue_policy import Holding, Preempt, Waiting, decide, decide_fifo


def policy(total: int, **rules):
    """The priority policy as the dispatcher calls it, on `total` GPUs."""
    return lambda queue, held, in_flight: decide(queue, held, total=total, in_flight=in_flight, **rules)


def running(job_id: int, gpus: int, *, left: int | None, step_s: float | None = 1.0, **facts) -> Holding:
    """A job training on `gpus` with `left` steps to go (None: its steps unknown), a step of `step_s` seconds;
    of priority 95 unless told (no queued job here preempts it)."""
    values = {"priority": 95, "age_s": 1000.0, "step": 99, "steps": None if left is None else 100 + left}
    values |= {"step_gpu_s": None if step_s is None else step_s * gpus}
    return Holding(id=job_id, owner=None, gpus=gpus, sizes=(gpus,), running=True, **{**values, **facts})


def queued(job_id: int, gpus: int, *, priority: int = 50, left: int | None = None, step_s: float = 1.0) -> Waiting:
    """A queued job; `left`: the steps it has to go after an earlier attempt (None: it never trained)."""
    step_gpu_s = None if left is None else step_s * gpus
    return Waiting(id=job_id, priority=priority, owner=None, sizes=(gpus,), steps_left=left, step_gpu_s=step_gpu_s)


def test_the_head_starts_when_the_running_job_that_holds_its_gpus_ends():
    estimate = starts([queued(9, 4)], [running(1, 2, left=300), running(2, 2, left=50)], policy=policy(4))
    assert estimate == {9: 300.0}  # both must end: the later one's 300 steps of 1 s
    estimate = starts([queued(9, 2)], [running(1, 2, left=300), running(2, 2, left=50, step_s=2.0)], policy=policy(4))
    assert estimate == {9: 100.0}  # the first to free 2 GPUs: 50 steps of 2 s


def test_the_queue_ahead_takes_the_gpus_first_for_as_long_as_it_runs():
    # job 8 (it trained before: 500 steps left) starts at 100 on the 2 GPUs freed; job 9 waits for its end
    queue = [queued(8, 2, priority=70, left=500), queued(9, 2)]
    estimate = starts(queue, [running(1, 2, left=100), running(2, 2, left=10_000)], policy=policy(4))
    assert estimate == {8: 100.0, 9: 600.0}
    # its start-up counts too: 30 s before its steps
    queue = [Waiting(id=8, priority=70, owner=None, sizes=(2,), steps_left=500, step_gpu_s=2.0, restart_s=30.0)]
    estimate = starts([*queue, queued(9, 2)], [running(1, 2, left=100), running(2, 2, left=10_000)], policy=policy(4))
    assert estimate == {8: 100.0, 9: 630.0}


def test_a_job_behind_backfills_on_gpus_the_head_cannot_use():
    queue = [queued(8, 4, priority=70), queued(9, 1, left=20)]
    estimate = starts(queue, [running(1, 3, left=100)], policy=policy(4))
    assert estimate == {8: 100.0, 9: 0.0}  # 1 GPU idle now: job 9 starts at once, ends at 20, before the head


def test_a_start_that_waits_on_a_job_of_unknown_length_is_unknown():
    # job 1 has no step time yet (no row stored): when it frees its GPU is not known. Job 9 needs 2:
    # job 1's one would not do, job 2's 2 will at 50, whenever job 1 ends
    unknown = running(1, 1, left=100, step_s=None)
    assert starts([queued(9, 2)], [unknown, running(2, 2, left=50)], policy=policy(3)) == {9: 50.0}
    assert starts([queued(9, 3)], [unknown, running(2, 2, left=50)], policy=policy(3)) == {9: None}  # needs both
    assert starts([queued(9, 1)], [unknown, running(2, 1, left=50)], policy=policy(2)) == {9: None}  # either
    # a queued job that never trained holds what it takes for as long as nobody knows: job 9 may start
    # when job 8 ends (unknown) or at 200, when job 2 ends; job 10 backfills the idle GPU at once
    queue = [queued(8, 2, priority=70), queued(9, 2), queued(10, 1, left=5)]
    estimate = starts(queue, [running(1, 2, left=100), running(2, 1, left=200)], policy=policy(4))
    assert estimate == {8: 100.0, 9: None, 10: 0.0}


def test_a_higher_priority_job_starts_once_its_victim_stops_at_its_next_step_with_a_checkpoint():
    victim = running(1, 4, left=5000, priority=10, step_s=2.0, checkpoint_every=100, checkpoint_s=5.0)
    estimate = starts([queued(9, 4, priority=90), queued(10, 4, priority=10)], [victim], policy=policy(4))
    # a step (2 s), the stop's checkpoint (5 s); then job 1 waits again ahead of job 10 (its earlier id)
    assert estimate == {9: 7.0, 10: None}
    assert starts([queued(9, 4, priority=90)], [victim], policy=policy(4, victims="least_loss")) == {9: 7.0}
    due = running(1, 4, left=5000, priority=10, step_s=2.0, checkpoint_every=100, step=98, checkpoint_s=5.0)
    assert starts([queued(9, 4, priority=90)], [due], policy=policy(4)) == {9: 2.0}  # its checkpoint falls there
    # a victim younger than the minimum runtime is preempted once it is old enough
    young = running(1, 4, left=5000, priority=10, age_s=30.0, step_s=2.0, checkpoint_every=100, checkpoint_s=5.0)
    rules = {"min_runtime_s": 120.0}
    estimate = starts([queued(9, 4, priority=90)], [young], policy=policy(4, **rules), min_runtime_s=120.0)
    assert estimate == {9: pytest.approx(90.0 + 7.0)}


def test_a_stop_in_flight_and_a_shrunk_victim():
    victim = running(1, 4, left=5000, priority=10, step_s=3.0)
    in_flight = {1: Preempt(victim=1, to_n=None, by=9, by_priority=90, frees=4)}
    estimate = starts([queued(9, 4, priority=90)], [victim], policy=policy(4), in_flight=in_flight)
    assert estimate == {9: 3.0}  # its step, then it leaves
    elastic = Holding(
        id=1, priority=10, owner=None, gpus=4, sizes=(2, 4), running=True, age_s=1000.0, step=99, steps=5100,
        step_gpu_s=4.0,
    )  # fmt: skip
    # shrunk to 2 after its step (1 s at 4 GPUs): 2 s a step from then on, 4999 steps left
    queue = [queued(9, 2, priority=90, left=100_000), queued(10, 2, priority=10)]
    estimate = starts(queue, [elastic], policy=policy(4))
    assert estimate == {9: 1.0, 10: pytest.approx(1.0 + 4999 * 2.0)}


def test_a_cancel_or_suspend_asked_frees_the_gpus_after_the_step_and_the_job_does_not_come_back():
    leaving = running(1, 4, left=5000, ending=True, step_s=4.0)
    assert starts([queued(9, 4)], [leaving], policy=policy(4)) == {9: 4.0}


def test_under_fifo_the_head_waits_and_nothing_overtakes_it():
    def fifo(queue, held, in_flight):
        return decide_fifo(queue, held, total=4)

    queue = [queued(8, 2, left=50), queued(9, 1, priority=90, left=10)]
    held = [running(1, 2, left=100), running(2, 1, left=300)]
    assert starts(queue, held, policy=fifo, order=lambda w: (w.id,)) == {8: 100.0, 9: 100.0}
    assert starts(queue, held, policy=policy(4)) == {8: 100.0, 9: 0.0}  # by priority, job 9 goes first

"""The queue's policy on snapshots (service/scheduling/queue_policy.py): order by priority then submission,
backfill, quotas with borrowing, and which jobs a waiting one preempts: borrowed first; by least loss
(the fewest GPU-seconds lost, a due checkpoint counting nothing, then the lowest priority) or, as
before it, shrinks first, then whole jobs, the lowest priority, then the most recently started; never
a young one. And the facts least loss reads, as dispatch.py fills them from the database.

Pure functions: each case states the cluster and checks the decision.

Packages: service.scheduling.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from service.scheduling.queue_policy import (
    Holding,
    Preempt,
    Start,
    Waiting,
    checkpoint_due,
    decide,
    decide_fifo,
    stop_loss_gpu_s,
)


def waiting(job_id: int, priority: int, *sizes: int, owner: str | None = None) -> Waiting:
    return Waiting(id=job_id, priority=priority, owner=owner, sizes=tuple(sizes))


def holding(job_id: int, priority: int, gpus: int, *, sizes=None, age_s=1000.0, **kwargs) -> Holding:
    return Holding(
        id=job_id,
        priority=priority,
        owner=kwargs.pop("owner", None),
        gpus=gpus,
        sizes=tuple(sizes or (gpus,)),
        running=kwargs.pop("running", True),
        age_s=age_s,
        **kwargs,
    )


def test_a_higher_priority_job_stops_a_lower_one_whole_and_says_so():
    d = decide([waiting(2, 90, 2)], [holding(1, 10, 4, step=430)], total=4)
    assert d.starts == []
    assert d.preempts == [Preempt(victim=1, to_n=None, by=2, by_priority=90, frees=4)]
    assert d.reasons[2] == "preempting job 1 (checkpoint at step 431 in progress)"


def test_an_elastic_victim_shrinks_to_the_largest_n_that_frees_enough():
    d = decide([waiting(2, 90, 2)], [holding(1, 10, 4, sizes=(1, 2, 4))], total=4)
    assert d.preempts == [Preempt(victim=1, to_n=2, by=2, by_priority=90, frees=2)]
    d = decide([waiting(2, 90, 3)], [holding(1, 10, 4, sizes=(1, 2, 4))], total=4)
    assert [(p.victim, p.to_n) for p in d.preempts] == [(1, 1)]


def test_before_least_loss_shrinks_came_first_and_stops_went_lowest_priority_then_newest_first():
    jobs = [holding(1, 20, 2), holding(2, 30, 4, sizes=(2, 4)), holding(3, 10, 2, age_s=500), holding(4, 10, 2)]
    d = decide([waiting(9, 90, 2)], jobs, total=10, victims="lowest_priority")
    assert [(p.victim, p.to_n) for p in d.preempts] == [(2, 2)]  # a shrink frees enough: no stop
    d = decide([waiting(9, 90, 4)], jobs, total=10, victims="lowest_priority")
    # the shrink frees 2, then whole jobs: priority 10 first, the most recently started (job 3) of those
    assert [(p.victim, p.to_n) for p in d.preempts] == [(2, 2), (3, None)]


def test_what_is_taken_past_the_need_is_given_back():
    # stopping job 1 (2 GPUs) then job 2 (4) frees 6 for a need of 4: job 1 is left alone
    jobs = [holding(1, 10, 2, age_s=100.0), holding(2, 20, 4)]
    d = decide([waiting(9, 90, 4)], jobs, total=6, min_runtime_s=0)
    assert [(p.victim, p.to_n) for p in d.preempts] == [(2, None)]


def test_no_job_younger_than_the_minimum_runtime_is_preempted():
    d = decide([waiting(2, 90, 2)], [holding(1, 10, 4, age_s=119.0)], total=4, min_runtime_s=120)
    assert d.preempts == [] and d.reasons[2] == "waiting for 2 GPUs, 0 free"
    d = decide([waiting(2, 90, 2)], [holding(1, 10, 4, age_s=121.0)], total=4, min_runtime_s=120)
    assert [p.victim for p in d.preempts] == [1]


def test_nothing_is_taken_when_all_that_may_be_would_not_be_enough():
    d = decide([waiting(2, 90, 4)], [holding(1, 10, 2), holding(3, 95, 2)], total=4)
    assert d.preempts == []


def test_equal_priorities_do_not_preempt_and_a_starting_job_is_not_a_victim():
    assert decide([waiting(2, 50, 2)], [holding(1, 50, 4)], total=4).preempts == []
    assert decide([waiting(2, 90, 2)], [holding(1, 10, 4, running=False)], total=4).preempts == []


def test_preemptions_in_flight_are_counted_as_coming_and_not_asked_twice():
    in_flight = {1: Preempt(victim=1, to_n=None, by=2, by_priority=90, frees=4)}
    d = decide([waiting(2, 90, 2)], [holding(1, 10, 4, step=7)], total=4, in_flight=in_flight)
    assert d.preempts == [] and d.reasons[2] == "preempting job 1 (checkpoint at step 8 in progress)"


def test_the_queue_goes_by_priority_then_submission_and_backfills_behind_a_waiting_head():
    queue = [waiting(5, 90, 4), waiting(2, 50, 1), waiting(3, 50, 1), waiting(4, 10, 1)]
    d = decide(queue, [holding(1, 95, 2)], total=4)
    assert d.starts == [Start(2, 1, backfilled=False), Start(3, 1, backfilled=False)]
    assert d.reasons[5] == "waiting for 4 GPUs, 2 free" and d.behind == "behind job 5 (priority 90)"
    assert 4 not in d.reasons  # not looked at: no GPU is free and the head is known
    # a job of the head's own priority that backfills is marked: the head may take its GPUs back
    d = decide([waiting(5, 50, 4), waiting(6, 50, 1)], [holding(1, 95, 2)], total=4)
    assert d.starts == [Start(6, 1, backfilled=True)]
    later = decide([waiting(5, 50, 4)], [holding(1, 95, 2, age_s=5), holding(6, 50, 2, backfilled=True)], total=4)
    assert later.preempts == []  # job 1 is not preemptible (95), job 6 alone is not enough
    freed = decide([waiting(5, 50, 4)], [holding(6, 50, 2, backfilled=True)], total=4)
    assert freed.starts == [] and [p.victim for p in freed.preempts] == [6]


def test_an_owner_past_its_quota_waits_or_borrows_idle_gpus():
    quota = {"intern": 2}.get
    held = [holding(1, 50, 2, owner="intern")]
    d = decide([waiting(2, 50, 2, owner="intern")], held, total=4, quota=quota, borrowing=False)
    assert d.starts == [] and d.reasons[2] == "quota: intern holds 2 of 2 GPUs"
    d = decide([waiting(2, 50, 2, owner="intern")], held, total=4, quota=quota)
    assert d.starts == [Start(2, 2, borrowed=True)]
    # nothing borrows GPUs a job within its quota waits for
    queue = [waiting(3, 50, 4, owner="research"), waiting(2, 50, 2, owner="intern")]
    assert decide(queue, held, total=4, quota=quota).starts == []


def test_a_borrowed_job_is_preempted_by_one_within_quota_whatever_the_priorities():
    quota = {"intern": 2}.get
    held = [holding(1, 90, 2, owner="intern"), holding(2, 90, 2, owner="intern", borrowed=True)]
    d = decide([waiting(3, 50, 2, owner="research")], held, total=4, quota=quota)
    assert [(p.victim, p.to_n) for p in d.preempts] == [(2, None)]


def test_an_elastic_job_starts_at_the_most_its_quota_and_the_free_gpus_allow():
    d = decide([waiting(1, 50, 1, 2, 4, owner="a")], [], total=8, quota={"a": 2}.get)
    assert d.starts == [Start(1, 2)]


def test_fifo_starts_in_submission_order_and_the_head_waits():
    d = decide_fifo([waiting(1, 10, 4), waiting(2, 90, 1)], [holding(9, 50, 2)], total=4)
    assert d.starts == [] and d.reasons == {1: "waiting for 4 GPUs, 2 free"}
    d = decide_fifo([waiting(1, 10, 1), waiting(2, 90, 4)], [], total=4)
    assert d.starts == [Start(1, 1)]


def test_the_queue_is_read_in_its_order_with_each_jobs_sizes_on_both_databases(database):
    """snapshot.waiting has the database extract the two numbers of a spec the sizes need."""
    from service.scheduling import snapshot
    from service.store.tables import Job

    def job(name: str, priority: int, num_gpus: int, **spec) -> Job:
        return Job(
            name=name,
            status="queued",
            spec={"micro_batch_size": 1, **spec},
            plan={},
            num_gpus=num_gpus,
            min_gpus=spec.pop("min_gpus", None),
            steps=10,
            priority=priority,
        )

    with database.session() as session:
        session.add_all(
            [
                job("a", 10, 2),
                job("b", 90, 4, min_gpus=1, global_batch_size=4),  # N in 1, 2, 4: each divides 4
                job("c", 90, 3),
                job("d", 50, 6, min_gpus=2, micro_batch_size=2, global_batch_size=12),  # N = 2, 3, 6
            ]
        )
    with database.session() as session:
        read = [(w.priority, w.sizes) for w in snapshot.waiting(session)]
        fifo = [w.sizes for w in snapshot.waiting(session, fifo=True)]
    assert read == [(90, (1, 2, 4)), (90, (3,)), (50, (2, 3, 6)), (10, (2,))]
    assert fifo == [(2,), (1, 2, 4), (3,), (2, 3, 6)]


# --------------------------------------------------------------------------- least loss (issue 44)


def measured(job_id: int, priority: int, gpus: int, **facts) -> Holding:
    """A running job whose rows say how it goes: a step of 1 s on its N, a checkpoint every 100 steps
    that holds it up 5 s, 30 s to start; at step 149 unless told (its next stop, step 150, is no checkpoint's)."""
    values = {"step": 149, "steps": 10_000, "step_gpu_s": 1.0 * gpus, "checkpoint_every": 100, "checkpoint_step": 99}
    return holding(job_id, priority, gpus, **{**values, "checkpoint_s": 5.0, "restart_s": 30.0, **facts})


def test_a_stop_loses_its_checkpoint_and_its_relaunch_on_each_gpu_and_a_due_checkpoint_counts_nothing():
    job = measured(1, 10, 4)
    assert not checkpoint_due(job)
    assert stop_loss_gpu_s(job) == 4 * 5.0 + 4 * 30.0  # its checkpoint, then its start-up at its 4 GPUs
    due = measured(1, 10, 4, step=198)  # it stops after step 199: the checkpoint after every 100th step
    assert checkpoint_due(due) and stop_loss_gpu_s(due) == 4 * 30.0
    elastic = measured(1, 10, 4, sizes=(2, 4))
    assert stop_loss_gpu_s(elastic, to_n=2) == 4 * 5.0 + 2 * 30.0  # every rank stops; 2 start again
    assert stop_loss_gpu_s(holding(1, 10, 4)) == 0.0  # nothing known of it: nothing counted


def test_a_stop_past_the_grace_is_a_kill_that_loses_the_steps_since_the_last_checkpoint():
    # a step of 50 s and a checkpoint of 20 s do not end within a grace of 60 s: killed at it
    slow = measured(1, 10, 2, step_gpu_s=2 * 50.0, checkpoint_s=20.0, step=130, checkpoint_step=99)
    assert stop_loss_gpu_s(slow, grace_s=60.0) == 2 * (31 * 50.0 + 60.0) + 2 * 30.0
    assert stop_loss_gpu_s(slow, grace_s=100.0) == 2 * 20.0 + 2 * 30.0  # within a longer grace: a stop


def test_least_loss_takes_the_victims_that_lose_the_fewest_gpu_seconds():
    # a quick restart beats a slow one, whatever the priorities (both may be preempted)
    jobs = [measured(1, 10, 2, restart_s=300.0), measured(2, 40, 2, restart_s=20.0)]
    d = decide([waiting(9, 90, 2)], jobs, total=4)
    assert d.preempts == [Preempt(victim=2, to_n=None, by=9, by_priority=90, frees=2)]
    assert decide([waiting(9, 90, 2)], jobs, total=4, victims="lowest_priority").preempts[0].victim == 1
    # one job of 2 GPUs loses less than the 8 of the lowest priority: the fewest GPUs that free enough
    jobs = [measured(1, 10, 8), measured(2, 40, 2), measured(3, 40, 1), measured(4, 40, 1)]
    d = decide([waiting(9, 90, 2)], jobs, total=12)
    assert [(p.victim, p.to_n) for p in d.preempts] == [(2, None)]  # 2 x 35 GPU-seconds, not 8 x 35
    # a stop that coincides with a checkpoint loses no checkpoint
    jobs = [measured(1, 10, 2), measured(2, 40, 2, step=98)]
    assert [p.victim for p in decide([waiting(9, 90, 2)], jobs, total=4).preempts] == [2]


def test_least_loss_on_a_tie_takes_the_lowest_priority_then_a_shrink_then_the_newest():
    jobs = [measured(1, 40, 2), measured(2, 10, 2), measured(3, 20, 2)]
    assert [p.victim for p in decide([waiting(9, 90, 2)], jobs, total=6).preempts] == [2]
    young, old = measured(1, 10, 2, age_s=200.0), measured(2, 10, 2, age_s=900.0)
    assert [p.victim for p in decide([waiting(9, 90, 2)], [old, young], total=4).preempts] == [1]
    # nothing known of either: no loss to tell them apart; the lowest priority's 2 GPUs
    jobs = [holding(1, 20, 2), holding(2, 30, 4, sizes=(2, 4)), holding(3, 10, 2, age_s=500), holding(4, 10, 2)]
    assert [(p.victim, p.to_n) for p in decide([waiting(9, 90, 2)], jobs, total=10).preempts] == [(3, None)]
    # an elastic job shrunk 4 -> 2 loses its checkpoint on 4 GPUs and starts again on 2: a stop of the
    # 2-GPU job of its priority loses less; of a shrink and a stop that lose alike, the shrink
    jobs = [measured(1, 10, 4, sizes=(2, 4)), measured(2, 10, 2)]
    assert [(p.victim, p.to_n) for p in decide([waiting(9, 90, 2)], jobs, total=6).preempts] == [(2, None)]
    jobs = [measured(1, 10, 4, sizes=(2, 4), checkpoint_s=0.0), measured(2, 10, 2, checkpoint_s=0.0)]
    assert [(p.victim, p.to_n) for p in decide([waiting(9, 90, 2)], jobs, total=6).preempts] == [(1, 2)]


def test_least_loss_takes_borrowed_gpus_first_and_all_of_them_before_any_within_a_quota():
    quota = {"intern": 2}.get
    borrowed = measured(1, 90, 4, owner="intern", borrowed=True, restart_s=600.0)
    cheap = measured(2, 10, 2, owner="research")
    d = decide([waiting(9, 50, 2, owner="research")], [borrowed, cheap], total=6, quota=quota)
    assert [(p.victim, p.to_n) for p in d.preempts] == [(1, None)]  # dearer, but borrowed
    # 4 borrowed GPUs are not enough for 6: all of them, then the least loss of the others for the rest
    others = [measured(2, 10, 4, owner="research"), measured(3, 10, 2, owner="research")]
    d = decide([waiting(9, 50, 6, owner="research")], [borrowed, *others], total=10, quota=quota)
    assert [(p.victim, p.to_n) for p in d.preempts] == [(1, None), (3, None)]


def test_least_loss_takes_nothing_when_all_that_may_be_taken_is_not_enough():
    d = decide([waiting(2, 90, 4)], [measured(1, 10, 2), measured(3, 95, 2)], total=4)
    assert d.preempts == []


# --------------------------------------------------------------------------- the facts, from the database


@pytest.mark.parametrize("attempt_rows", [(100, 160), ()], ids=["resumed-with-rows", "no-row-yet"])
def test_the_snapshot_reads_each_running_jobs_step_time_checkpoints_and_start_up(database, attempt_rows):
    """snapshot.holding and with_loss_facts: a step's GPU-seconds from the latest row (its step time x
    the N it ran at), the newest checkpoint (the last periodic one, or the one its attempt resumed
    from), the periodic checkpoint's blocked seconds, and the last start's seconds from the events."""
    from service.scheduling import snapshot
    from service.store.metric_rows import store_metrics
    from service.store.tables import Job, JobEvent
    from workers.records import MetricRow

    def row(step: int) -> MetricRow:
        blocked_s = 3.0 if step == 149 else None  # the periodic checkpoint after step 149 (every 50)
        return MetricRow(
            step=step, loss=1.0, grad_norm=1.0, loss_scale=1.0, skipped=False, step_time_s=0.5, tokens_per_s=1.0,
            mem_peak_bytes=(1,), mem_planned_bytes=1, world_size=2, checkpoint_blocked_s=blocked_s,
        )  # fmt: skip

    began = datetime(2026, 1, 1, tzinfo=UTC)
    with database.session() as session:
        job = Job(
            name="measured",
            status="running",
            spec={"checkpoint_every": 50, "micro_batch_size": 1, "global_batch_size": 4},
            plan={},
            num_gpus=4,
            world_size=4,
            steps=1000,
            priority=10,
            attempt=1,
        )
        session.add(job)
        session.flush()
        starting = JobEvent(job_id=job.id, at=began, from_status="queued", to_status="starting", reason="placing")
        running = JobEvent(job_id=job.id, at=began + timedelta(seconds=42), to_status="running", reason="training")
        session.add_all([starting, running])
        if attempt_rows:
            store_metrics(session, job, [row(step) for step in range(*attempt_rows)])  # attempt 1 resumed at 100
        else:
            job.step = 99  # its resume kept the rows up to its checkpoint; none of this attempt yet
        job_id = job.id
    with database.session() as session:
        [fresh] = snapshot.holding(session, age_s=lambda _: 500.0)
        [facts] = snapshot.with_loss_facts(session, [fresh])
    assert (facts.id, facts.gpus, facts.steps, facts.checkpoint_every, facts.age_s) == (job_id, 4, 1000, 50, 500.0)
    assert facts.restart_s == 42.0
    if attempt_rows:
        assert (facts.step, facts.step_gpu_s, facts.step_time_s) == (159, 0.5 * 2, 0.25)  # ran at 2, now at 4
        assert (facts.checkpoint_step, facts.checkpoint_s) == (149, 3.0)
    else:
        assert (facts.step, facts.step_gpu_s, facts.checkpoint_step, facts.checkpoint_s) == (99, None, 99, 0.0)


def test_the_queue_read_for_estimates_says_what_each_job_has_left_and_how_fast_it_went(database):
    """snapshot.waiting(paced=True): a job preempted at step 199 of 1000, whose rows ran at 0.5 s a step on
    2 GPUs, has 800 steps left of 1 GPU-second each; a job that never trained, its steps and no pace."""
    from service.scheduling import snapshot
    from service.store.tables import Job

    with database.session() as session:
        for name, step, latest in (("preempted", 199, {"step_time_s": 0.5, "world_size": 2}), ("new", None, None)):
            spec = {"micro_batch_size": 1}
            job = Job(name=name, status="queued", spec=spec, plan={}, num_gpus=2, steps=1000, step=step, latest=latest)
            session.add(job)
    with database.session() as session:
        paced = [(w.steps_left, w.step_gpu_s) for w in snapshot.waiting(session, paced=True)]
        plain = [(w.steps_left, w.step_gpu_s) for w in snapshot.waiting(session)]
    assert paced == [(800, 1.0), (1000, None)]
    assert plain == [(None, None), (None, None)]  # a tick's policy reads neither

"""The queue's policy on snapshots (service/scheduling/queue_policy.py): order by priority then submission,
backfill, quotas with borrowing, and which jobs a waiting one preempts (shrinks first, then whole
jobs; borrowed first, then the lowest priority, then the most recently started; never a young one).

Pure functions: each case states the cluster and checks the decision.

Packages: service.scheduling.
"""

from __future__ import annotations

from service.scheduling.queue_policy import Holding, Preempt, Start, Waiting, decide, decide_fifo


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


def test_shrinks_come_before_stops_and_stops_go_lowest_priority_then_newest_first():
    jobs = [holding(1, 20, 2), holding(2, 30, 4, sizes=(2, 4)), holding(3, 10, 2, age_s=500), holding(4, 10, 2)]
    d = decide([waiting(9, 90, 2)], jobs, total=10)
    assert [(p.victim, p.to_n) for p in d.preempts] == [(2, 2)]  # a shrink frees enough: no stop
    d = decide([waiting(9, 90, 4)], jobs, total=10)
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
    """dispatch.waiting has the database extract the two numbers of a spec the sizes need."""
    from service.scheduling import dispatch
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
        read = [(w.priority, w.sizes) for w in dispatch.waiting(session)]
        fifo = [w.sizes for w in dispatch.waiting(session, fifo=True)]
    assert read == [(90, (1, 2, 4)), (90, (3,)), (50, (2, 3, 6)), (10, (2,))]
    assert fifo == [(2,), (1, 2, 4), (3,), (2, 3, 6)]

"""Jobs from submit to end: admission (a job's checks before it is stored), storing a submitted job
(submission: idempotency, each owner's limit of queued jobs), the job state machine (job_states),
the scheduler's tick, what a job's transaction records of each attempt's news (outcomes), the
queue's policy (queue: priorities, backfill, quotas, preemption; pure) and its dispatch, the
failure policy (failure: retry at which N, or fail; pure), a job's controls (priority, suspend,
resume), elastic world sizes, the jobs and GPUs gauges, and the launcher that dispatches a job to
Ray and only talks to Ray (where a job's files live: service.store.job_storage).

May import: service.settings, service.errors, service.auth, service.telemetry, service.schemas,
service.store, service.planning, workers.
"""

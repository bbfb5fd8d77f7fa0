"""Jobs from queued to end: the job state machine (job_states), the scheduler's tick, what a job's
transaction records of each attempt's news (outcomes), the queue's policy (queue_policy: priorities,
backfill, quotas, preemption by least loss; pure), each queued job's estimated start (estimates: the
policy replayed forward; pure), what a tick decides on, read from the database (snapshot), and its
dispatch, the failure policy (failure: retry at which N, or fail; pure), the rollback policy after a
diverged run (health; pure), a job's controls (priority, suspend, resume), a job's dependencies on
others, elastic world sizes, the jobs and GPUs gauges, and the launcher that dispatches a job to Ray and
only talks to Ray (where a job's files live: service.store.job_storage). How a job is checked and
stored: service.intake; sweeps: service.experiments.

May import: service.settings, service.errors, service.auth, service.telemetry, service.schemas,
service.store, workers.
"""

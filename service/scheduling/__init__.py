"""Jobs from submit to end: admission (a job's checks before it is stored), the job state machine
and its queries (jobs: where the GPUs a job holds are counted), the scheduler's tick, the queue's
policy (queue: priorities, backfill, quotas, preemption; pure) and its dispatch, a job's controls
(priority, suspend, resume), elastic world sizes, the jobs and GPUs gauges, and the launcher that
dispatches a job to Ray and only talks to Ray (where a job's files live: service.store.job_storage).

May import: service.settings, service.errors, service.auth, service.telemetry, service.schemas,
service.store, service.planning, workers.
"""

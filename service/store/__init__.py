"""What the control plane keeps: the database (engine, tables, metric rows, log lines, artifacts,
code uploads) and the files on the checkpoint storage it owns (code bundles, job directories, the
dataset token cache), with the housekeeping that bounds them; the reads of the jobs table
(job_repository: a job, the job a principal may see, the queue's order, the GPUs active jobs hold);
each job's storage (job_storage: where its files live and what they hold, asked by the launcher,
the scheduler, the exporter and the routes); the uid each owner's children run under
(ZERO1_RUN_AS), allocated once and kept; and the code bundles (code: their checks, their stores
and who uploaded which).

May import: service.settings, service.placeholders, service.run_as, service.errors, service.auth, service.schemas,
workers.
"""

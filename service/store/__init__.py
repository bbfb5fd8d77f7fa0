"""What the control plane keeps: the database (engine, tables, metric rows, log lines, artifacts,
code uploads) and the files on the checkpoint storage it owns (code bundles, job directories, the
dataset token cache), with the housekeeping that bounds them; each job's storage (job_storage: where
its files live and what they hold, asked by the launcher, the scheduler, the exporter and the routes);
and the uid each owner's children run under (ZERO1_RUN_AS), allocated once and kept.

May import: service.settings, service.run_as, service.errors, service.auth, service.schemas, workers.
"""

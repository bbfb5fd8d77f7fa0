"""The REST routes, one module per resource: plan (plans and recommendations), jobs (submit, list, read,
cancel, metrics, events, logs, artifacts), checkpoints (a job's, to download), code (bundles), cluster,
health and prometheus (/metrics)."""

"""Tracking: each job exported as an MLflow run by the service (never by the ranks, which hold no
credentials), on a thread of its own, from the rows the database already holds; what a run holds
(runs), how MLflow is called (mlflow_client), the exporter that resumes from its cursor (exporter), a
sweep as a parent run with its trials' runs nested under it (sweep_runs: its best trial as the API
names it, service.experiments.sweeps), and the tracking URI without its credentials, as it is shown and
logged (uris). Each job's end and each sweep's end POSTed to a webhook, and a job's end to its own
`notify` URL, on a thread of its own too, from its cursor
(webhooks). Both loop, and back off while their receiver does not answer, alike (backoff).

May import: service.settings, service.errors, service.store, service.schemas, service.scheduling,
service.experiments.
"""

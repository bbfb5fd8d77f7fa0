"""MLflow as the exporter calls it: a fail-fast client (one try per request, a short timeout: the
exporter's own backoff retries, so a down server costs seconds, never minutes of MLflow's retries),
the experiment and a job's (or a sweep's) run found or made, and batches within MLflow's limits.

mlflow (the package of the extra zero1[mlflow], mlflow-skinny) is imported here only, and only once
ZERO1_MLFLOW_TRACKING_URI is set.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_METRICS_PER_BATCH = 1000
"""MLflow's log_batch limits: 1000 metrics, 100 params, 100 tags in one call."""
MAX_PARAMS_PER_BATCH = 100
HTTP_TIMEOUT_S = "10"
"""MLFLOW_HTTP_REQUEST_TIMEOUT for the service's process, unless the environment sets it: per connect and read."""


class MissingPackage(RuntimeError):
    """ZERO1_MLFLOW_TRACKING_URI is set and the mlflow client package is not installed."""


def check_installed() -> None:
    try:
        import mlflow  # noqa: F401
    except ImportError:
        raise MissingPackage(
            "ZERO1_MLFLOW_TRACKING_URI is set but the MLflow client is not installed: "
            "pip install 'zero1[mlflow]' (mlflow-skinny), or unset ZERO1_MLFLOW_TRACKING_URI"
        ) from None


def is_unreachable(error: BaseException) -> bool:
    """MLflow did not answer, or answered with a server error (retry everything later); False for a
    request it refused (4xx: that job's try is retried on its own, later)."""
    from mlflow.exceptions import MlflowException

    if isinstance(error, MlflowException):
        status = error.get_http_status_code()
        return status >= 500 or status == 429
    return True


class Mlflow:
    def __init__(self, tracking_uri: str) -> None:
        check_installed()
        # One try per request: MLflow's defaults (7 retries, 2 s backoff factor, 120 s timeout) hold
        # a call for minutes against a server that is down; the exporter backs off itself.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)
        # MLflow prints each terminated run's link to stdout (the service's log), made from the
        # tracking URI with its credentials: never (service/tracking/uris.py)
        os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=tracking_uri)

    def experiment_id(self, name: str) -> str:
        """The experiment's id, made if missing (another service making it first is fine)."""
        from mlflow.exceptions import MlflowException

        found = self.client.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:
            found = self.client.get_experiment_by_name(name)
            if found is None:
                raise
            return found.experiment_id

    def find_or_create_run(
        self,
        experiment_id: str,
        *,
        key: str,
        name: str,
        start_time_ms: int,
        tags: dict[str, str],
        params: dict[str, str],
        key_tag: str = "zero1.job_key",
    ) -> str:
        """The run tagged `key_tag`=`key` (a job's zero1.job_key, a sweep's zero1.sweep_key), else a new
        one with these tags and params; its id."""
        key_filter = "tags.`{}` = '{}'".format(key_tag, key.replace("'", ""))
        found = self.client.search_runs([experiment_id], filter_string=key_filter, max_results=1)
        if found:
            return found[0].info.run_id
        run = self.client.create_run(experiment_id, start_time=start_time_ms, tags=tags, run_name=name[:250])
        self.log_params(run.info.run_id, params)
        return run.info.run_id

    def log_params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], v) for k, v in sorted(params.items())]
        for first in range(0, len(items), MAX_PARAMS_PER_BATCH):
            self.client.log_batch(run_id, params=items[first : first + MAX_PARAMS_PER_BATCH], synchronous=True)

    def log_points(self, run_id: str, points: list[tuple[str, float, int]], *, timestamp_ms: int) -> None:
        """(name, value, step) points in batches of MAX_METRICS_PER_BATCH, all with one timestamp."""
        from mlflow.entities import Metric

        metrics = [Metric(name, value, timestamp_ms, step) for name, value, step in points]
        for first in range(0, len(metrics), MAX_METRICS_PER_BATCH):
            self.client.log_batch(run_id, metrics=metrics[first : first + MAX_METRICS_PER_BATCH], synchronous=True)

    def set_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()], synchronous=True)

    def log_file(self, run_id: str, path: Path, *, folder: str) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path=folder)

    def terminate(self, run_id: str, *, status: str, end_time_ms: int | None) -> None:
        self.client.set_terminated(run_id, status=status, end_time=end_time_ms)

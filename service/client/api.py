"""`Client`: the API's endpoints as methods, answering the API's own response models."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from service.schemas.responses import (
    ClusterPublic,
    CodeBundlePublic,
    DryRunPublic,
    JobPublic,
    PlanPublic,
    QueuePublic,
    RecommendationsPublic,
)
from service.schemas.sweeps import SweepPublic
from service.schemas.usage import UsagePublic

from .bundle import upload_chunks, zip_directory
from .errors import raise_for
from .jobs import Job
from .sweeps import Sweep

DEFAULT_URL = "http://127.0.0.1:8000"

SUBMIT_TIMEOUT_S = 600
"""A submit waits for the service's admission: a traced plan and a dataset tokenized at submit
(ZERO1_PLAN_TIMEOUT_S, ZERO1_DATA_TIMEOUT_S), each bounded by the service."""


class UploadedBundle(CodeBundlePublic):
    """A code bundle as an upload answered it."""

    created: bool
    """Stored by this upload (201); false when the service already had it (200)."""


class Client:
    """A client of a running zero1 API at `url` (default: ZERO1_URL, else http://127.0.0.1:8000),
    sending `token` (default: ZERO1_TOKEN) as its bearer token. `http` is an httpx.Client to use
    instead of its own (a test's transport); the client closes only its own. Use it in a `with`
    block, or call close()."""

    def __init__(self, url: str | None = None, token: str | None = None, *, timeout_s: float = 30, http=None) -> None:
        self.url = (url or os.environ.get("ZERO1_URL") or DEFAULT_URL).rstrip("/")
        token = (os.environ.get("ZERO1_TOKEN", "") if token is None else token).strip()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._owned = http is None
        if http is None:
            import httpx  # here, not at import: httpx's own command line loads rich (100 ms), which `zero1 plan` skips

            http = httpx.Client(base_url=self.url, timeout=timeout_s, headers=headers)
        self.http = http

    def __repr__(self) -> str:
        return f"Client(url={self.url!r})"

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._owned:
            self.http.close()

    def plan(self, spec: dict | None = None, **fields: Any) -> PlanPublic:
        """POST /v1/plan: the per-GPU memory of a model (`num_params=7.5e9` or `model={...}`) at N GPUs."""
        return PlanPublic.model_validate(self._post("/v1/plan", json={**(spec or {}), **fields}))

    def recommend(self, spec: dict | None = None, **fields: Any) -> RecommendationsPublic:
        """POST /v1/plan/recommend: the configurations of a model that fit, cheapest first."""
        return RecommendationsPublic.model_validate(self._post("/v1/plan/recommend", json={**(spec or {}), **fields}))

    def submit(
        self,
        spec: dict | str | Path,
        code: str | Path | None = None,
        dry_run: bool = False,
        *,
        priority: int | None = None,
        tags: list[str] | None = None,
        notes: str | None = None,
        depends_on: list[int] | None = None,
        progress: bool = False,
    ) -> Job | DryRunPublic:
        """POST /v1/jobs: a job spec (a dict, or the path of a JSON file) admitted and queued; its Job.
        `code` is a python model's code: a directory (zipped and uploaded, a bar on stderr if
        `progress`) or the digest of an uploaded bundle. With `dry_run` nothing is stored: the answer
        is the plan and whether it would be admitted. `tags` and `depends_on` are added to the spec's,
        `notes` replace its. A job that does not fit is an ApiError "does_not_fit" whose `body["plan"]` is
        the plan."""
        body = dict(spec) if isinstance(spec, dict) else json.loads(Path(spec).read_text())
        if code is not None:
            digest = str(code) if str(code).startswith("sha256:") else self.upload_code(code, progress=progress).code
            body["code"] = digest
        if priority is not None:
            body["priority"] = priority
        if tags is not None:
            body["tags"] = sorted({*body.get("tags", []), *tags})
        if notes is not None:
            body["notes"] = notes
        if depends_on is not None:
            body["depends_on"] = sorted({*body.get("depends_on", []), *depends_on})
        answer = self._post("/v1/jobs", json=body, params={"dry_run": str(dry_run).lower()}, timeout=SUBMIT_TIMEOUT_S)
        if dry_run:
            return DryRunPublic.model_validate(answer)
        return Job(self, JobPublic.model_validate(answer))

    def upload_code(self, directory: str | Path, *, progress: bool = False) -> UploadedBundle:
        """POST /v1/code: `directory` zipped (without .git, caches, virtualenvs and what its .gitignore
        lists) and uploaded; the stored bundle (`.code` is its digest; `.created`, whether it is new)."""
        directory = Path(directory)
        if not directory.is_dir():
            raise NotADirectoryError(f"{directory}: not a directory")
        data, files = zip_directory(directory)
        content = upload_chunks(data, label=f"uploading {directory} ({files} files)") if progress else data
        response = raise_for(
            self.http.post(
                "/v1/code",
                content=content,
                headers={"Content-Type": "application/zip", "Content-Length": str(len(data))},
                timeout=SUBMIT_TIMEOUT_S,
            )
        )
        return UploadedBundle.model_validate(response.json() | {"created": response.status_code == 201})

    def job(self, job_id: int) -> Job:
        """GET /v1/jobs/{id}."""
        return Job(self, JobPublic.model_validate(self._get(f"/v1/jobs/{job_id}")))

    def jobs(
        self, status: str | list[str] | None = None, limit: int = 20, tag: str | list[str] | None = None
    ) -> list[Job]:
        """GET /v1/jobs: the newest first, `limit` of them, only these statuses if given, only those with
        every tag given."""
        params: dict[str, Any] = {"limit": limit}
        if status:
            params["status"] = [status] if isinstance(status, str) else list(status)
        if tag:
            params["tag"] = [tag] if isinstance(tag, str) else list(tag)
        return [Job(self, JobPublic.model_validate(j)) for j in self._get("/v1/jobs", params=params)["data"]]

    def sweep(self, spec: dict | str | Path) -> Sweep:
        """POST /v1/sweeps: a sweep (a dict, or the path of a JSON file) planned whole and stored; its trials
        start from the scheduler's next tick. A trial that does not fit is an ApiError naming it."""
        body = dict(spec) if isinstance(spec, dict) else json.loads(Path(spec).read_text())
        return Sweep(self, SweepPublic.model_validate(self._post("/v1/sweeps", json=body, timeout=SUBMIT_TIMEOUT_S)))

    def get_sweep(self, sweep_id: int) -> Sweep:
        """GET /v1/sweeps/{id}: one of yours (an admin: anyone's), with its trials."""
        return Sweep(self, SweepPublic.model_validate(self._get(f"/v1/sweeps/{sweep_id}")))

    def sweeps(self) -> list[Sweep]:
        """GET /v1/sweeps: yours (an admin: everyone's), newest first."""
        return [Sweep(self, SweepPublic.model_validate(s)) for s in self._get("/v1/sweeps")["data"]]

    def queue(self, limit: int = 100) -> QueuePublic:
        """GET /v1/queue: the queued jobs in the order they start, why each waits, and who holds the GPUs."""
        return QueuePublic.model_validate(self._get("/v1/queue", params={"limit": limit}))

    def usage(self, since: str | None = None, until: str | None = None) -> UsagePublic:
        """GET /v1/usage: GPU-seconds held and spent training by owner and priority class over [since, until)
        (ISO 8601 times; defaults: the start of this month, now), and each owner's against their quota."""
        params = {key: value for key, value in (("since", since), ("until", until)) if value is not None}
        return UsagePublic.model_validate(self._get("/v1/usage", params=params))

    def cluster(self) -> ClusterPublic:
        """GET /v1/cluster: the GPUs, free and in all, and their memory."""
        return ClusterPublic.model_validate(self._get("/v1/cluster"))

    def _get(self, path: str, **kwargs) -> Any:
        return raise_for(self.http.get(path, **kwargs)).json()

    def _post(self, path: str, **kwargs) -> Any:
        return raise_for(self.http.post(path, **kwargs)).json()

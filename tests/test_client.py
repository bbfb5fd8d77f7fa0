"""The Python client (`from zero1 import Client`): the README's snippet run as written against the
app on the session's Ray cluster, its answers as the API's own response models equal to the API's
JSON, ApiError's fields, waiting with a timeout, and a job cancelled, suspended and resumed.

The client's HTTP goes to the app through its TestClient (the same routes, database and Ray jobs,
without a socket): `httpx.Client`, as the client makes it, is replaced by a stand-in that forwards
to it with the client's own headers.

Packages: service.client, service.api, service.schemas.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import httpx
import pytest

from zero1 import ApiError, Client, Job

from helpers import job_body, wait_for

ROOT = Path(__file__).resolve().parents[1]


class _ThroughTheApp:
    """httpx.Client(base_url=, timeout=, headers=) as the client makes it, answering from the app."""

    def __init__(self, app, headers: dict) -> None:
        self.app = app
        self.headers = headers

    def close(self) -> None:
        return None

    def __getattr__(self, method: str):
        call = getattr(self.app, method)  # get, post, patch, stream: the TestClient's (an httpx.Client's)

        def forward(*args, headers=None, timeout=None, **kwargs):  # no socket: a timeout means nothing here
            return call(*args, headers=self.headers | (headers or {}), **kwargs)

        return forward


@pytest.fixture
def through(client, monkeypatch):
    """Every Client made in the test talks to the module's app; the headers each one sent, in order."""
    made = []

    def make(*, base_url: str, timeout: float, headers: dict) -> _ThroughTheApp:
        made.append(headers)
        return _ThroughTheApp(client, headers)

    monkeypatch.setattr(httpx, "Client", make)
    return made


def readme_snippet() -> str:
    """The README's one python block."""
    (snippet,) = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return snippet


def test_the_readme_snippet_runs_as_written(through, client, tmp_path, monkeypatch, capsys):
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "tiny-gpt.json", tmp_path / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ZERO1_TOKEN", "t0ken")
    namespace: dict = {}
    exec(compile(readme_snippet(), "README.md", "exec"), namespace)

    job = namespace["job"]
    frame = namespace["frame"]
    assert through == [{"Authorization": "Bearer t0ken"}]  # ZERO1_TOKEN, as the CLI sends it
    assert isinstance(job, Job) and job.status == "succeeded"
    rows = client.get(f"/v1/jobs/{job.id}/metrics", params={"limit": 10_000}).json()["data"]
    assert len(frame) == len(rows) == 300 and list(frame["step"]) == list(range(300))
    assert list(frame["loss"]) == [row["loss"] for row in rows] and frame["lr"].eq(0.003).all()
    out = capsys.readouterr().out
    assert "300/300" in out and "succeeded" in out  # the progress line, at its end
    assert "[rank 0] " in out and "[rank 1] " in out  # the job's lines, as `zero1 logs` prints them
    listing = client.get(f"/v1/jobs/{job.id}/artifacts").json()["data"]
    assert sorted(p.name for p in (tmp_path / "tiny-gpt").iterdir()) == sorted(e["name"] for e in listing)


def test_answers_are_the_apis_models_equal_to_its_json(through, client):
    zero1 = Client()
    body = {"num_params": 7_500_000_000, "num_gpus": 64}
    assert zero1.plan(body).model_dump(mode="json") == client.post("/v1/plan", json=body).json()
    assert zero1.plan(**body) == zero1.plan(body)
    recommend = {"model": json.loads((ROOT / "examples" / "tiny-gpt.json").read_text())["model"]}
    recommend |= {"global_batch_size": 16, "max_gpus": 4}
    assert (
        zero1.recommend(recommend).model_dump(mode="json") == client.post("/v1/plan/recommend", json=recommend).json()
    )
    assert zero1.cluster().num_gpus == 4
    dry = zero1.submit(job_body(name="dry"), dry_run=True)
    assert dry.admitted and dry.plan.num_gpus == job_body()["num_gpus"]
    assert [j.id for j in zero1.jobs(limit=3)] == [j["id"] for j in client.get("/v1/jobs?limit=3").json()["data"]]


def test_an_error_answer_is_an_api_error_with_the_fields_at_fault(through):
    zero1 = Client()
    with pytest.raises(ApiError) as bad:
        zero1.submit(job_body(num_gpus=0))
    assert (bad.value.status, bad.value.error) == (422, "invalid_request")
    assert bad.value.detail[0]["field"] == "num_gpus" and "num_gpus" in bad.value.message
    with pytest.raises(ApiError) as big:
        zero1.submit(json.loads((ROOT / "examples" / "gpt-7.5b.json").read_text()), dry_run=True)
    assert big.value.error == "does_not_fit" and big.value.body["plan"]["min_gpus"] == 3
    with pytest.raises(ApiError) as missing:
        zero1.job(999_999)
    assert missing.value.status == 404 and str(missing.value).startswith("404 not_found: ")


class WaitClock:
    """time for the module of Job.wait: monotonic() reads now_s, which only sleep() moves on; each sleep is kept."""

    def __init__(self) -> None:
        self.now_s = 0.0
        self.sleeps_s: list[float] = []

    def monotonic(self) -> float:
        return self.now_s

    def sleep(self, seconds: float) -> None:
        self.sleeps_s.append(seconds)
        self.now_s += seconds


def test_wait_times_out_and_a_job_is_suspended_resumed_and_cancelled(through, monkeypatch):
    zero1 = Client()
    job = zero1.submit(job_body(name="long", steps=100_000))  # 100,000 steps: it cannot end during the wait
    clock = WaitClock()
    with monkeypatch.context() as patched, pytest.raises(TimeoutError, match=f"job {job.id} is still .* after 2 s"):
        patched.setattr(f"{Job.__module__}.time", clock)  # zero1.jobs: service/client/jobs.py as installed
        job.wait(timeout=2, interval=0.5)
    assert clock.sleeps_s == [0.5] * 4  # asked at 0, 0.5, 1, 1.5 and 2 s on the wait's clock, then gave up
    job.suspend()  # a queued job leaves the queue at once; a running one at its next step
    wait_for(lambda: job.refresh().status, lambda status: status == "suspended", what="the job suspended")
    assert job.resume().status == "queued" and job.info.queue_position == 1
    changes = [(event.from_status, event.to_status) for event in job.events()]
    assert ("suspended", "queued") in changes  # the scheduler may have started it again since
    job.cancel()
    assert job.wait(timeout=120, interval=0.05).status == "cancelled" and job.done

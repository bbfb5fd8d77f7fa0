"""The webhook (ZERO1_WEBHOOK_URL): each job's end reaches a receiver on loopback once, in order, signed
with ZERO1_WEBHOOK_SECRET; while the receiver is down the events wait and arrive after it returns; a
receiver that never answers holds up no scheduler tick. The sender is driven pass by pass (run_once)
where the order of events is the point, and on its own thread in the app on stand-ins for Ray.

Packages: service.tracking, service.store.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fakes import end_attempt
from fastapi.testclient import TestClient

from service.scheduling.job_states import transition
from service.store.tables import Job, WebhookCursor
from service.tracking.webhooks import Unreachable, Webhooks

import helpers
from conftest import make_settings, serve_on_fakes
from helpers import free_port, wait_for

SECRET = "webhook-secret-of-the-tests"


class Receiver:
    """An HTTP server on 127.0.0.1:port that keeps each POST (headers and body) and answers `status`;
    with `open` cleared it answers nothing until it is set again. stop() and start() again: the port
    refuses, then takes them again."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/hook"
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.status = 200
        self.open = threading.Event()
        self.open.set()
        self.holding = threading.Event()
        """Set once a request waits for `open`."""
        self.server: ThreadingHTTPServer | None = None

    def start(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if not receiver.open.is_set():  # held: until the test opens it
                    receiver.holding.set()
                    receiver.open.wait()
                receiver.received.append((dict(self.headers), body))
                self.send_response(receiver.status)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def bodies(self) -> list[dict]:
        return [json.loads(body) for _, body in self.received]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    found = Receiver()
    found.start()
    yield found
    found.open.set()
    found.stop()


@pytest.fixture
def api(tmp_path, database_url, receiver) -> Iterator[TestClient]:
    """The app on stand-ins for Ray, its scheduler stopped (ticked by the test), its webhook sender not
    started: the test drives it."""
    settings = make_settings(tmp_path, database_url=database_url, webhook_url=receiver.url, webhook_secret=SECRET)
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.webhooks.stop()
        yield client


def sender(api: TestClient) -> Webhooks:
    runtime = api.app.state.runtime
    return Webhooks(db=runtime.db, settings=runtime.settings)


def submit(api: TestClient, **fields) -> int:
    response = api.post("/v1/jobs", json=helpers.job_body(**{"steps": 1_000_000, **fields}))
    assert response.status_code == 201, response.text
    return response.json()["id"]


def end(api: TestClient, job_id: int, status: str) -> None:
    with api.app.state.runtime.db.session() as session:
        job = session.get(Job, job_id)
        if status != "cancelled":
            assert transition(session, job, "starting", "test") and transition(session, job, "running", "test")
        assert transition(session, job, status, f"the test ended it {status}")


def verified(headers: dict[str, str], body: bytes) -> bool:
    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers["X-Zero1-Signature"], expected)


def test_each_end_arrives_once_in_order_signed_and_slack_readable(api, receiver):
    hook = sender(api)
    jobs = [submit(api, name=f"<!channel> job {i}", tags=["t"]) for i in range(3)]
    for job_id, status in zip(jobs, ("succeeded", "failed", "cancelled"), strict=True):
        end(api, job_id, status)
    assert hook.run_once() is False
    assert hook.run_once() is False  # nothing new: nothing sent twice
    bodies = receiver.bodies()
    assert [(b["job"]["id"], b["event"]) for b in bodies] == [
        (jobs[0], "job.succeeded"),
        (jobs[1], "job.failed"),
        (jobs[2], "job.cancelled"),
    ]
    assert all(verified(headers, body) for headers, body in receiver.received)
    assert [headers["X-Zero1-Delivery"] for headers, _ in receiver.received] == [str(b["delivery"]) for b in bodies]
    first = bodies[0]
    assert first["job"]["tags"] == ["t"] and first["reason"] == "the test ended it succeeded"
    assert first["text"].startswith(f"zero1: job #{jobs[0]} “&lt;!channel&gt; job 0” succeeded (0/1,000,000 steps)")
    assert first["text"].endswith(f"/jobs/{jobs[0]}|open>")

    tampered = receiver.received[0][1].replace(b"succeeded", b"failed")
    assert not verified(receiver.received[0][0], tampered)

    runtime = api.app.state.runtime
    another = runtime.settings.model_copy(update={"webhook_url": receiver.url + "?another"})
    assert Webhooks(db=runtime.db, settings=another).run_once() is False  # a URL new to the database
    assert len(receiver.received) == 3  # starts after the events stored before it: none sent


def test_while_the_receiver_is_down_the_events_wait_and_arrive_after_it_returns(api, receiver):
    hook = sender(api)
    first = submit(api)
    end(api, first, "cancelled")
    receiver.stop()  # the port refuses
    with pytest.raises(Unreachable, match="ConnectError"):
        hook.run_once()
    second = submit(api)
    end(api, second, "cancelled")
    receiver.status = 503
    receiver.start()
    with pytest.raises(Unreachable, match="HTTP 503"):
        hook.run_once()
    receiver.received.clear()
    receiver.status = 200
    restarted = sender(api)  # as after a service restart: from the stored cursor
    assert restarted.run_once() is False
    assert [b["job"]["id"] for b in receiver.bodies()] == [first, second]

    refused = submit(api)
    end(api, refused, "cancelled")
    receiver.status = 400  # refused for good: passed over, not sent again
    assert restarted.run_once() is False and restarted.run_once() is False
    assert [b["job"]["id"] for b in receiver.bodies()] == [first, second, refused]
    with api.app.state.runtime.db.session() as session:
        key = sender(api).key  # the job events' cursor of this URL
        assert session.get(WebhookCursor, key).event_id == receiver.bodies()[-1]["delivery"]


def test_a_receiver_that_never_answers_holds_up_no_scheduler_tick(tmp_path, receiver):
    """The sender on its own thread, as the app runs it: while its POST waits on the receiver, the
    scheduler ticks, and cancels and starts jobs."""
    receiver.open.clear()
    settings = make_settings(tmp_path, webhook_url=receiver.url)
    with serve_on_fakes(settings) as api:
        runtime = api.app.state.runtime
        runtime.scheduler.stop()
        first = submit(api)
        assert api.post(f"/v1/jobs/{first}/cancel").status_code == 202
        wait_for(lambda: receiver.holding.is_set(), bool, what="the webhook's POST to wait on the receiver")
        second = submit(api)
        runtime.scheduler.tick()
        runtime.scheduler.tick()
        assert api.get(f"/v1/jobs/{second}").json()["status"] == "running"
        assert receiver.received == [] and receiver.holding.is_set()  # the POST still waits
        receiver.open.set()
        wait_for(receiver.bodies, lambda bodies: len(bodies) == 1, what="the held event")
        assert receiver.bodies()[0]["job"]["id"] == first
        assert "X-Zero1-Signature" not in receiver.received[0][0]  # no ZERO1_WEBHOOK_SECRET: unsigned


def test_a_sweeps_end_arrives_once_signed_with_its_trials_and_best(api, receiver):
    hook = sender(api)
    body = {
        "name": "lr <!here>",
        "base": helpers.job_body(num_gpus=1, steps=100, eval_every=10),
        "space": {"optimizer.lr": [0.001, 0.003]},
    }
    sweep = api.post("/v1/sweeps", json=body).json()
    runtime = api.app.state.runtime
    runtime.scheduler.tick()
    trials = api.get(f"/v1/sweeps/{sweep['id']}").json()["trials"]
    for trial, eval_loss in zip(trials, (2.5, 2.25), strict=True):  # each trial's attempt ends, evaluated
        end_attempt(runtime, trial["job_id"], eval_loss)
    runtime.scheduler.tick()
    runtime.scheduler.tick()
    assert api.get(f"/v1/sweeps/{sweep['id']}").json()["status"] == "succeeded"
    cancelled = api.post("/v1/sweeps", json=body | {"name": "other"}).json()
    assert api.post(f"/v1/sweeps/{cancelled['id']}/cancel").status_code == 202

    assert hook.run_once() is False
    assert hook.run_once() is False  # nothing sent twice
    received = [(headers, raw, json.loads(raw)) for headers, raw in receiver.received]
    assert [b["event"] for _, _, b in received[:2]] == ["job.succeeded", "job.succeeded"]  # the trials' ends
    ends = [(headers, body) for headers, raw, body in received if body["event"].startswith("sweep.")]
    assert [(b["sweep"]["id"], b["event"]) for _, b in ends] == [
        (sweep["id"], "sweep.succeeded"),
        (cancelled["id"], "sweep.cancelled"),
    ]
    assert all(verified(headers, raw) for headers, raw, _ in received)
    assert [headers["X-Zero1-Delivery"] for headers, _ in ends] == [b["delivery"] for _, b in ends]
    assert all(headers["X-Zero1-Event"] == b["event"] for headers, b in ends)
    first = ends[0][1]
    assert first["sweep"]["trials"] == {"succeeded": 2} and first["sweep"]["best"]["job_id"] == trials[1]["job_id"]
    assert first["reason"] == "every trial has ended: 2 of 2 succeeded"
    assert first["text"].startswith(
        f"zero1: sweep #{sweep['id']} “lr &lt;!here&gt;” succeeded (2 succeeded); best trial 1 "
        f"(job #{trials[1]['job_id']}, eval_loss 2.25): optimizer.lr=0.003"
    )
    assert ends[1][1]["sweep"]["best"] is None and ends[1][1]["reason"] == "cancelled by request"


@pytest.fixture
def notify_api(tmp_path, database_url, receiver) -> Iterator[TestClient]:
    """The app whose jobs may name a notify URL on the receiver's host:port or on `dead` (a port no one
    listens on); no ZERO1_WEBHOOK_URL; its notifier not started: the test drives it."""
    dead = free_port()
    hosts = [f"127.0.0.1:{receiver.port}", f"127.0.0.1:{dead}"]
    settings = make_settings(tmp_path, database_url=database_url, webhook_notify_hosts=hosts, webhook_secret=SECRET)
    with serve_on_fakes(settings) as client:
        client.app.state.runtime.scheduler.stop()
        client.app.state.runtime.notifier.stop()
        client.dead = f"http://127.0.0.1:{dead}/hook"
        yield client


def test_a_jobs_notify_url_must_name_a_host_the_service_allows(tmp_path, notify_api, receiver):
    other = f"http://127.0.0.1:{free_port()}/hook"
    for url, says in [
        (other, f"notify: 127.0.0.1:{other.split(':')[2].split('/')[0]} is not one of the hosts allowed"),
        (f"http://me:secret@127.0.0.1:{receiver.port}/hook", "notify: a notify URL carries no user or password"),
        (f"http://localhost:{receiver.port}/hook", "is not one of the hosts allowed (ZERO1_WEBHOOK_NOTIFY_HOSTS: "),
        ("file:///etc/passwd", "notify: String should match pattern"),
    ]:
        refused = notify_api.post("/v1/jobs", json=helpers.job_body(notify=url))
        assert refused.status_code == 422 and says in refused.json()["message"], refused.text
        assert refused.json()["detail"][0]["field"] == "notify"
    assert notify_api.post("/v1/jobs", json=helpers.job_body(notify=receiver.url)).status_code == 201

    settings = make_settings(tmp_path / "off")
    with serve_on_fakes(settings) as off:
        refused = off.post("/v1/jobs", json=helpers.job_body(notify=receiver.url))
        assert refused.status_code == 422
        assert "this service sends no job's own notifications (ZERO1_WEBHOOK_NOTIFY_HOSTS is unset)" in refused.text
        assert off.app.state.runtime.notifier is None


def test_each_jobs_own_url_gets_its_end_once_and_a_dead_one_is_passed_over_after_max_tries(notify_api, receiver):
    from service.tracking.webhooks import MAX_TRIES, Notifier

    runtime = notify_api.app.state.runtime
    notifier = Notifier(db=runtime.db, settings=runtime.settings)
    first = submit(notify_api, notify=receiver.url)
    dead = submit(notify_api, notify=notify_api.dead)
    silent = submit(notify_api)
    for job_id in (first, dead, silent):
        end(notify_api, job_id, "succeeded")
    for _ in range(MAX_TRIES - 1):  # the dead URL holds the cursor, backing off between passes
        with pytest.raises(Unreachable, match="ConnectError"):
            notifier.run_once()
    assert [b["job"]["id"] for b in receiver.bodies()] == [first]  # sent once, not at each try
    assert notifier.run_once() is False  # its last try: passed over, and the rest go on
    last = submit(notify_api, notify=receiver.url)
    end(notify_api, last, "cancelled")
    assert notifier.run_once() is False
    assert [(b["job"]["id"], b["event"]) for b in receiver.bodies()] == [
        (first, "job.succeeded"),
        (last, "job.cancelled"),
    ]
    assert all(verified(headers, body) for headers, body in receiver.received)

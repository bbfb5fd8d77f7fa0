"""Issue 27, items 4, 5 (zips) and 7: artifacts recorded by the service and served only as recorded, a
bundle whose file and directory share a path, and storage bounds (code quota, token cache, log retention).

Packages: service.store.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select, update

from service.main import create_app
from service.store.artifacts import FinalFile, read_final
from service.store.tables import Artifact, CodeBundle, Job, LogLine
from service.store.token_cache import trim
from workers.config import DatasetSpec
from workers.data.datasets import ByteTokenizer, prepare_tokens

from conftest import end_supervisors, make_settings
from figures import record
from helpers import TERMINAL, bearer, job_body, wait_for, wait_job, zip_of

ALICE, BOB, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "bob", "root"))
TOKENS = f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin"
QUOTA = 4000
ZIP = {"Content-Type": "application/zip"}


@pytest.fixture(scope="module")
def secured(ray_cluster, tmp_path_factory):
    """Three tokens, a code quota of QUOTA bytes, housekeeping only when a test calls it."""
    settings = make_settings(
        tmp_path_factory.mktemp("storage"), api_tokens=TOKENS, code_quota_bytes=QUOTA, housekeeping_interval_s=3600
    )
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            yield client
    finally:
        end_supervisors(settings.ray_namespace)


def _runtime(client: TestClient):
    return client.app.state.runtime


# --------------------------------------------------------------------------- item 5: a file that is a directory


@pytest.mark.parametrize("order", [["x", "x/y.py"], ["x/y.py", "x"], ["pkg/x", "pkg/x/sub/y.py"]])
def test_a_zip_whose_file_is_also_a_directory_is_a_422_naming_both(secured, order):
    files = {name: b"print(1)\n" for name in order}
    response = secured.post("/v1/code", content=zip_of(files), headers={**ZIP, **bearer(ALICE)})
    assert response.status_code == 422, response.text
    body = response.json()
    file, inner = sorted(order, key=len)
    assert body["error"] == "invalid_code" and f"{inner!r}" in body["message"] and f"{file!r}" in body["message"]
    assert body["detail"][0]["entry"] == inner
    record("a zip whose file is also a directory (item 5)", tried=1, refused=1)


def test_a_directory_entry_beside_its_files_is_still_fine(secured):
    files = {"x/": b"", "x/y.py": b"def build():\n    pass\n"}
    response = secured.post("/v1/code", content=zip_of(files), headers={**ZIP, **bearer(ALICE)})
    assert response.status_code in (200, 201), response.text


# --------------------------------------------------------------------------- item 7a: code quota


def _bundle(size: int, *, salt: str) -> bytes:
    """A stored (uncompressed) zip of about `size` bytes, different for each salt."""
    import zipfile

    return zip_of({"mod.py": f"# {salt}\n".encode() + b"#" * size}, compression=zipfile.ZIP_STORED)


def test_a_users_code_quota_counts_their_bundles_and_spares_bytes_already_stored(secured):
    first = _bundle(2500, salt="a1")
    second = _bundle(2500, salt="a2")
    assert secured.post("/v1/code", content=first, headers={**ZIP, **bearer(ALICE)}).status_code == 201
    over = secured.post("/v1/code", content=second, headers={**ZIP, **bearer(ALICE)})
    assert over.status_code == 413, over.text
    body = over.json()
    with _runtime(secured).db.session() as session:  # what alice recorded: this bundle, and this module's others
        used = session.scalar(select(func.sum(CodeBundle.bytes)).where(CodeBundle.uploader == "alice"))
    assert body["error"] == "code_quota_exceeded" and body["quota_bytes"] == QUOTA
    assert body["bundle_bytes"] == len(second) and body["stored_bytes"] == used >= len(first)
    assert f"past the quota of {QUOTA} bytes (ZERO1_CODE_QUOTA_BYTES)" in body["message"]
    assert f"user alice has {used} bytes of code bundles" in body["message"]
    assert f"would make {used + len(second)}" in body["message"]
    assert hashlib.sha256(second).hexdigest() not in {p.stem for p in _runtime(secured).code.root.glob("*.zip")}

    # another user has a quota of their own; bytes the store holds already cost nothing
    assert secured.post("/v1/code", content=second, headers={**ZIP, **bearer(BOB)}).status_code == 201
    again = secured.post("/v1/code", content=second, headers={**ZIP, **bearer(ALICE)})
    assert again.status_code == 200, again.text
    assert secured.post("/v1/code", content=first, headers={**ZIP, **bearer(ALICE)}).status_code == 200
    record("code bundles past a user's quota (item 7)", tried=1, refused=1)


# --------------------------------------------------------------------------- item 4: artifacts


@pytest.fixture(scope="module")
def succeeded(secured):
    """alice's 2-rank job, run to success; and its checkpoint directory."""
    response = secured.post("/v1/jobs", json=job_body(steps=2), headers=bearer(ALICE))
    assert response.status_code == 201, response.text
    job = wait_job(secured, response.json()["id"], lambda j: j["status"] in TERMINAL, headers=bearer(ALICE))
    assert job["status"] == "succeeded", job
    runtime = _runtime(secured)
    with runtime.db.session() as session:
        return job, runtime.storage.checkpoint_dir(session.get(Job, job["id"]))


def _rows(client: TestClient, job_id: int) -> dict[str, tuple[int, str]]:
    with _runtime(client).db.session() as session:
        rows = session.scalars(select(Artifact).where(Artifact.job_id == job_id))
        return {row.name: (row.bytes, row.sha256) for row in rows}


def _plant_secret(client: TestClient, final: Path) -> None:
    """What a job's code can do to final/: a link to the service's database, listed with its true digest."""
    database = Path(_runtime(client).settings.database_url.removeprefix("sqlite:///"))
    (final / "secret").symlink_to(database)
    manifest = json.loads((final / "manifest.json").read_text())
    manifest["files"].append(
        {
            "name": "secret",
            "bytes": database.stat().st_size,
            "sha256": hashlib.sha256(database.read_bytes()).hexdigest(),
        }
    )
    (final / "manifest.json").write_text(json.dumps(manifest))


def test_the_service_records_the_artifacts_when_the_job_succeeds(secured, succeeded):
    job, root = succeeded
    rows = _rows(secured, job["id"])  # read from the database before anyone listed them
    assert sorted(rows) == ["model.safetensors", "spec.json"]
    for name, (size, digest) in rows.items():
        data = (root / "final" / name).read_bytes()
        assert size == len(data) and digest == hashlib.sha256(data).hexdigest()
    listing = secured.get(f"/v1/jobs/{job['id']}/artifacts", headers=bearer(ALICE)).json()
    assert {(f["name"], f["bytes"], f["sha256"]) for f in listing["data"]} == {(n, *v) for n, v in rows.items()}


def test_a_link_planted_in_final_is_never_listed_nor_served(secured, succeeded):
    job, root = succeeded
    _plant_secret(secured, root / "final")
    try:
        names = [
            f["name"] for f in secured.get(f"/v1/jobs/{job['id']}/artifacts", headers=bearer(ALICE)).json()["data"]
        ]
        assert names == ["model.safetensors", "spec.json"]
        response = secured.get(f"/v1/jobs/{job['id']}/artifacts/secret", headers=bearer(ALICE))
        assert response.status_code == 404 and b"SQLite" not in response.content

        # a job recorded lazily (it succeeded before artifacts were recorded) gets the same checks
        with _runtime(secured).db.session() as session:
            session.execute(delete(Artifact).where(Artifact.job_id == job["id"]))
            session.execute(update(Job).where(Job.id == job["id"]).values(artifacts_recorded_at=None))
        listing = secured.get(f"/v1/jobs/{job['id']}/artifacts", headers=bearer(ALICE)).json()
        assert [f["name"] for f in listing["data"]] == ["model.safetensors", "spec.json"]
        assert sorted(_rows(secured, job["id"])) == ["model.safetensors", "spec.json"]
        assert secured.get(f"/v1/jobs/{job['id']}/artifacts/secret", headers=bearer(ALICE)).status_code == 404
    finally:
        (root / "final" / "secret").unlink()
    record("a link planted in final/ (item 4)", tried=1, refused=1)


def test_a_file_swapped_after_success_is_cut_off_or_refused(secured, succeeded, caplog):
    job, root = succeeded
    spec = root / "final" / "spec.json"
    original = spec.read_bytes()
    url = f"/v1/jobs/{job['id']}/artifacts/spec.json"
    assert secured.get(url, headers=bearer(ALICE)).content == original
    try:
        spec.write_bytes(original[:-2] + b"}}")  # same size, other bytes: noticed only by hashing
        swapped = _get_all(secured, url)
        assert swapped != original[:-2] + b"}}" and len(swapped or b"") < len(original)
        assert "artifact 'spec.json' changed while it was served" in caplog.text

        spec.write_bytes(original + b" ")  # another size: refused before a byte is sent
        response = secured.get(url, headers=bearer(ALICE))
        assert response.status_code == 409 and response.json()["error"] == "artifact_changed", response.text

        spec.unlink()
        spec.symlink_to(root / "final" / "model.safetensors")  # a link in its place
        response = secured.get(url, headers=bearer(ALICE))
        assert response.status_code == 409 and "symbolic link" in response.json()["message"]
    finally:
        spec.unlink(missing_ok=True)
        spec.write_bytes(original)
    ranged = secured.get(url, headers={**bearer(ALICE), "Range": "bytes=2-5"})
    assert ranged.status_code == 206 and ranged.content == original[2:6]
    record("an artifact swapped after success (item 4)", tried=1, refused=1)


def _get_all(client: TestClient, url: str) -> bytes | None:
    """The body as received, None when the connection broke before the end."""
    try:
        return client.get(url, headers=bearer(ALICE)).content
    except Exception:  # noqa: BLE001  (the stream is cut off: the app's exception ends the response)
        return None


def _final(tmp_path: Path, files: dict[str, bytes]) -> Path:
    """A job directory whose final/ holds `files` and a true manifest of them."""
    final = tmp_path / "job-1-abc" / "final"
    final.mkdir(parents=True)
    for name, data in files.items():
        (final / name).write_bytes(data)
    entries = [{"name": n, "bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in files.items()]
    (final / "manifest.json").write_text(json.dumps({"files": entries}))
    return final.parent


def _add_to_manifest(job_dir: Path, **entry) -> None:
    path = job_dir / "final" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"].append(entry)
    path.write_text(json.dumps(manifest))


def test_read_final_refuses_what_a_job_can_plant(tmp_path):
    job_dir = _final(tmp_path, {"model.safetensors": b"weights", "spec.json": b"{}"})
    secret = tmp_path / "service.db"
    secret.write_bytes(b"SQLite format 3\0")
    digest = hashlib.sha256(secret.read_bytes()).hexdigest()
    final = job_dir / "final"
    (final / "link").symlink_to(secret)
    os.link(secret, final / "hard")
    os.mkfifo(final / "fifo")
    (final / "liar").write_bytes(b"not what it says")
    for name in ("link", "hard", "fifo", "liar", "../service.db", "manifest.json"):
        _add_to_manifest(job_dir, name=name, bytes=secret.stat().st_size, sha256=digest)
    _add_to_manifest(job_dir, name="spec.json", bytes=2, sha256=hashlib.sha256(b"{}").hexdigest())

    files, refused = read_final(job_dir)
    assert files == [
        FinalFile("model.safetensors", 7, hashlib.sha256(b"weights").hexdigest()),
        FinalFile("spec.json", 2, hashlib.sha256(b"{}").hexdigest()),
    ]
    text = "\n".join(refused)
    assert len(refused) == 7, refused
    assert "final/link is a symbolic link" in text and "final/hard has 2 hard links" in text
    assert "final/fifo is not a regular file" in text
    assert "'liar': the manifest says 16 bytes" in text and "'../service.db' is not a plain file name" in text
    assert "listed twice" in text


@pytest.mark.parametrize("planted", ["final", "manifest.json", "job"])
def test_a_link_on_the_way_to_final_refuses_everything(tmp_path, planted):
    job_dir = _final(tmp_path / "real", {"spec.json": b"{}"})
    target = tmp_path / "other"
    target.mkdir()
    if planted == "final":
        os.rename(job_dir / "final", target / "final")
        (job_dir / "final").symlink_to(target / "final")
    elif planted == "manifest.json":
        os.rename(job_dir / "final" / "manifest.json", target / "manifest.json")
        (job_dir / "final" / "manifest.json").symlink_to(target / "manifest.json")
    else:
        os.rename(job_dir, target / "job")
        job_dir.symlink_to(target / "job")
    files, refused = read_final(job_dir)
    assert files == [] and len(refused) == 1 and "symbolic link" in refused[0]


def test_no_final_directory_is_no_artifacts_and_no_complaint(tmp_path):
    assert read_final(tmp_path / "job-9-x") == ([], [])
    (tmp_path / "job-9-x").mkdir()
    assert read_final(tmp_path / "job-9-x") == ([], [])
    # nor a checkpoint root that is gone (GET /v1/jobs/{id}/artifacts answered 500 then)
    assert read_final(tmp_path / "gone" / "job-9-x") == ([], [])


# --------------------------------------------------------------------------- item 7b: the token cache


def _entry(directory: Path, key: str, *, num_bytes: int, used_at: float) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{key}.bin").write_bytes(bytes(num_bytes))
    (directory / f"{key}.json").write_text("{}")
    for suffix in (".bin", ".json"):
        os.utime(directory / f"{key}{suffix}", (used_at, used_at))


def test_the_token_cache_drops_the_least_recently_used_first(tmp_path):
    now = time.time()
    tokens = tmp_path / "tokens"
    for number, key in enumerate(["old", "older", "oldest", "new"]):
        _entry(tokens, key, num_bytes=1000, used_at=now - {0: 300, 1: 400, 2: 500, 3: 10}[number] * 60)
    (tokens / ".x.bin.123.ab.tmp").write_bytes(bytes(10))
    os.utime(tokens / ".x.bin.123.ab.tmp", (now - 2 * 86_400, now - 2 * 86_400))  # a dead writer's

    removed = trim(tokens, max_bytes=2100, keep_since=now - 3600, keep=frozenset())
    assert removed == ["oldest", "older"]
    assert sorted(p.name for p in tokens.iterdir()) == ["new.bin", "new.json", "old.bin", "old.json"]
    # entries used since keep_since (a pending job's) stay, past the bound
    assert trim(tokens, max_bytes=0, keep_since=now - 3600, keep=frozenset({"old"})) == []


def test_housekeeping_keeps_the_entries_pending_jobs_may_need(secured, tmp_path):
    runtime = _runtime(secured)
    tokens = runtime.housekeeper.tokens_dir
    now = time.time()
    _entry(tokens, "needed", num_bytes=1000, used_at=now - 2 * 3600 + 30)  # checked just before its job was stored
    _entry(tokens, "stale", num_bytes=1000, used_at=now - 5 * 3600)
    with runtime.db.session() as session:
        queued = Job(
            name="waiting",
            status="queued",
            spec={},
            plan={},
            num_gpus=4,
            steps=1,
            owner="alice",
            created_at=datetime.now(UTC) - timedelta(hours=2),
        )
        session.add(queued)
    try:
        runtime.settings.token_cache_max_bytes = 0
        assert runtime.housekeeper.trim_token_cache() == ["stale"]
        assert (tokens / "needed.bin").exists()
        with runtime.db.session() as session:
            session.execute(update(Job).where(Job.id == queued.id).values(status="cancelled"))
        assert runtime.housekeeper.trim_token_cache() == ["needed"]
    finally:
        runtime.settings.token_cache_max_bytes = 100 << 30
        with runtime.db.session() as session:
            session.execute(delete(Job).where(Job.id == queued.id))


def test_a_rank_touches_its_entry_and_tokenizes_an_evicted_one_again(tmp_path):
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(20)))
    spec = DatasetSpec(
        format="jsonl", path=str(tmp_path / "corpus.jsonl"), tokenizer="bytes", cache_dir=str(tmp_path / "cache")
    )
    first = prepare_tokens(spec, tokenizer=ByteTokenizer())
    sidecar = Path(first.path).with_suffix(".json")
    os.utime(sidecar, (1, 1))
    again = prepare_tokens(spec, tokenizer=ByteTokenizer())
    assert not again.created and sidecar.stat().st_mtime > time.time() - 60  # a hit is a use
    assert trim(Path(first.path).parent, max_bytes=0, keep_since=time.time() + 1) == [Path(first.path).stem]
    evicted = prepare_tokens(spec, tokenizer=ByteTokenizer())
    assert evicted.created and list(evicted.tokens) == list(first.tokens)


# --------------------------------------------------------------------------- item 7c: log retention


def _lines(client: TestClient, job_id: int) -> list[dict]:
    return client.get(f"/v1/jobs/{job_id}/logs", headers=bearer(ALICE)).json()["data"]


def _add_lines(client: TestClient, job_id: int, *, num_lines: int, finished_days_ago: float) -> None:
    with _runtime(client).db.session() as session:
        session.execute(
            update(Job)
            .where(Job.id == job_id)
            .values(finished_at=datetime.now(UTC) - timedelta(days=finished_days_ago))
        )
        session.add_all(
            LogLine(job_id=job_id, attempt=0, rank=0, stream="stdout", line=f"line {n}") for n in range(num_lines)
        )


def test_log_lines_of_jobs_that_ended_long_ago_are_deleted_in_batches(secured, succeeded, monkeypatch):
    job, _ = succeeded
    recent = secured.post("/v1/jobs", json=job_body(steps=1), headers=bearer(ALICE)).json()
    wait_job(secured, recent["id"], lambda j: j["status"] in TERMINAL, headers=bearer(ALICE))
    _add_lines(secured, job["id"], num_lines=120, finished_days_ago=31)
    _add_lines(secured, recent["id"], num_lines=5, finished_days_ago=29)
    kept = len(_lines(secured, recent["id"]))
    monkeypatch.setattr("service.store.housekeeping.ROWS_PER_BATCH", 50)  # three transactions
    housekeeper = _runtime(secured).housekeeper

    assert housekeeper.expire_logs() >= 120
    lines = _lines(secured, job["id"])
    assert len(lines) == 1 and lines[0]["stream"] == "marker" and "ZERO1_LOG_RETENTION_DAYS" in lines[0]["line"]
    assert len(_lines(secured, recent["id"])) == kept  # ended 29 days ago: kept
    assert housekeeper.expire_logs() == 0  # nothing left to do: the marker stays

    housekeeper.settings.log_retention_days = 0  # keep forever
    try:
        _add_lines(secured, recent["id"], num_lines=1, finished_days_ago=10_000)
        assert housekeeper.expire_logs() == 0 and len(_lines(secured, recent["id"])) == kept + 1
    finally:
        housekeeper.settings.log_retention_days = 30


def test_the_service_expires_logs_on_its_own(ray_cluster, tmp_path):
    settings = make_settings(tmp_path, housekeeping_interval_s=0.2, log_retention_days=1)
    with TestClient(create_app(settings), raise_server_exceptions=False) as client:
        runtime = client.app.state.runtime
        with runtime.db.session() as session:
            ended = Job(
                name="old",
                status="failed",
                spec={},
                plan={},
                num_gpus=1,
                steps=1,
                finished_at=datetime.now(UTC) - timedelta(days=2),
            )
            session.add(ended)
            session.flush()
            session.add(LogLine(job_id=ended.id, attempt=0, rank=0, stream="stderr", line="Traceback"))
            job_id = ended.id

        def stored() -> int:
            with runtime.db.session() as session:
                query = select(func.count()).where(LogLine.job_id == job_id, LogLine.stream != "marker")
                return session.scalar(query)

        wait_for(stored, lambda n: n == 0, what="the housekeeper to delete the expired line", timeout_s=30)

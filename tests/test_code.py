"""Code bundles through the API: POST /v1/code and GET /v1/code/{digest}, with auth off and on, and the
check a job's admission makes (uploads.require_bundle) against the stored uploads.

Packages: service.api, service.store.code.
"""

from __future__ import annotations

import hashlib
import secrets
import zlib
from pathlib import Path

import pytest
import ray
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from service.auth import ANONYMOUS, PUBLIC, Principal
from service.errors import ServiceError
from service.store.code.stores import code_dir
from service.store.code.uploads import get_bundle, require_bundle
from service.store.tables import CodeBundle

from conftest import make_settings, serve_on_fakes
from helpers import EIGHT_MIB, deflated_zeros, one_entry_zip, symlink_zip, zip_of

ALICE, BOB, ROOT = (f"{user}-{secrets.token_urlsafe(24)}" for user in ("alice", "bob", "root"))
TOKENS = f"alice:{ALICE},bob:{BOB},root:{ROOT}:admin"
MAX_CODE_BYTES = 2 << 20  # ZERO1_MAX_CODE_BYTES here: above the 1 MiB every other route keeps
ZIP = {"Content-Type": "application/zip"}
BUNDLE = zip_of({"mymodel/": b"", "mymodel/__init__.py": b"", "mymodel/net.py": b"def build(width):\n    ...\n"})


def bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}", **ZIP}


@pytest.fixture(scope="module")
def open_app(tmp_path_factory):
    """Auth off, bundles up to MAX_CODE_BYTES; on stand-ins for Ray (the store is the API's)."""
    settings = make_settings(tmp_path_factory.mktemp("code"), max_code_bytes=MAX_CODE_BYTES)
    with serve_on_fakes(settings) as client:
        yield client


@pytest.fixture(scope="module")
def secured(tmp_path_factory):
    """alice, bob and root (an admin); on stand-ins for Ray."""
    settings = make_settings(tmp_path_factory.mktemp("code-auth"), api_tokens=TOKENS)
    with serve_on_fakes(settings) as client:
        yield client


def stored(client: TestClient) -> tuple[list[str], int]:
    """(the store's files, the code_bundles rows)."""
    runtime = client.app.state.runtime
    root = code_dir(runtime.settings.shared_dir)
    files = sorted(path.name for path in root.iterdir()) if root.exists() else []
    with runtime.db.session() as session:
        return files, session.scalar(select(func.count()).select_from(CodeBundle))


def upload(client: TestClient, data: bytes, *, headers: dict = ZIP, status: int = 201) -> dict:
    response = client.post("/v1/code", content=data, headers=headers)
    assert response.status_code == status, response.text
    return response.json()


# --------------------------------------------------------------------------- auth off


def test_a_zip_uploads_once_and_its_metadata_reads_back(open_app):
    data = zip_of({"a/": b"", "a/train.py": b"print('hi')\n", "a/b/c.txt": b"x" * 1000})
    before_files, before_rows = stored(open_app)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    assert upload(open_app, data) == {"code": digest, "bytes": len(data), "files": 2}
    assert upload(open_app, data, status=200) == {"code": digest, "bytes": len(data), "files": 2}
    assert stored(open_app) == (sorted([*before_files, digest.removeprefix("sha256:") + ".zip"]), before_rows + 1)

    got = open_app.get(f"/v1/code/{digest}").json()
    assert {key: got[key] for key in ("code", "bytes", "files", "uploaded_by")} == {
        "code": digest,
        "bytes": len(data),
        "files": 2,
        "uploaded_by": [None],  # auth off: no one's name
    }
    assert got["created_at"].endswith(("Z", "+00:00"))


REFUSED = {
    "dotdot": (zip_of({"ok.py": b"", "a/../x": b""}), "entry 'a/../x' has a '..' component"),
    "absolute": (zip_of({"/etc/passwd": b""}), "entry '/etc/passwd' is an absolute path"),
    "symlink": (symlink_zip("data", "/etc"), "entry 'data' is a symlink"),
    "not a zip": (b"#!/bin/sh\nrm -rf /\n", "not a zip file zero1 can read (File is not a zip file)"),
    "shadow": (
        zip_of({"workers/zero/optimizer.py": b""}),
        "entry 'workers/zero/optimizer.py' would shadow zero1's own package",
    ),
    "header lies": (
        one_entry_zip("x.bin", deflated_zeros(num_blocks=1), claimed_bytes=100, crc=zlib.crc32(bytes(EIGHT_MIB))),
        "entry 'x.bin' unpacks to 8388608 bytes, but its header says 100",
    ),
}


SHADOWING = {
    "sitecustomize.py": "would run as the start-up hook 'sitecustomize'",
    "usercustomize.py": "would run as the start-up hook 'usercustomize'",
    "x.pth": "is a start-up hook (a .pth file)",
    "json/__init__.py": "would shadow the standard library's module 'json'",
    "os.py": "would shadow the standard library's module 'os'",
    "_thread.cpython-311-x86_64-linux-gnu.so": "would shadow the standard library's module '_thread'",
    "torch/nn/functional.py": "would shadow the module 'torch' of the installed distribution 'torch'",
    "numpy.py": "would shadow the module 'numpy' of the installed distribution 'numpy'",
    "ray/__init__.pyc": "would shadow the module 'ray' of the installed distribution 'ray'",
    "service.py": "would shadow zero1's own package 'service'",
}
"""Top-level names that would shadow a module the interpreter, zero1 or its dependencies import."""


@pytest.mark.parametrize(("entry", "why"), SHADOWING.items(), ids=SHADOWING.keys())
def test_a_bundle_that_would_shadow_a_module_is_a_422_naming_the_entry(open_app, entry, why):
    before = stored(open_app)
    body = upload(open_app, zip_of({"mymodel.py": b"def build(**args): ...\n", entry: b"x = 1\n"}), status=422)
    assert body["error"] == "invalid_code" and body["message"].startswith(f"body: entry {entry!r} {why}"), body
    assert body["detail"][0]["entry"] == entry
    assert stored(open_app) == before


def test_modules_of_a_bundle_that_shadow_nothing_are_accepted(open_app):
    """Ordinary modules, data files named like a module (token.txt), and any name below the top."""
    files = {"mymodel.py": b"", "token.txt": b"", "json": b"", "pkg/os.py": b"", "pkg/torch/__init__.py": b""}
    assert upload(open_app, zip_of(files))["files"] == len(files)


@pytest.mark.parametrize(("data", "why"), REFUSED.values(), ids=REFUSED.keys())
def test_a_refused_bundle_is_a_422_that_stores_nothing(open_app, data, why):
    before = stored(open_app)
    body = upload(open_app, data, status=422)
    assert body["error"] == "invalid_code" and body["message"].startswith(f"body: {why}")
    assert body["detail"][0]["field"] == "body"
    assert stored(open_app) == before


def test_more_than_10000_entries_are_a_422(open_app):
    data = zip_of({f"m/{i}.py": b"" for i in range(10_001)}, compression=0)  # about 1 s to make
    body = upload(open_app, data, status=422)
    assert body["message"] == "body: the zip has 10001 entries, more than the limit of 10000"


def test_the_code_limit_is_its_own_and_counted_when_streamed(open_app):
    big = zip_of({"weights.bin": secrets.token_bytes(3 << 19)}, compression=0)  # 1.5 MiB: over 1 MiB, under 2
    assert upload(open_app, big)["files"] == 1
    over = open_app.post("/v1/code", content=b"PK" + bytes(MAX_CODE_BYTES), headers=ZIP)
    message = f"the request body is over the limit of {MAX_CODE_BYTES} bytes (ZERO1_MAX_CODE_BYTES)"
    assert (over.status_code, over.json()) == (413, {"error": "request_too_large", "message": message})

    def chunks():
        for _ in range(MAX_CODE_BYTES // (64 << 10) + 1):
            yield bytes(64 << 10)

    before = stored(open_app)
    streamed = open_app.post("/v1/code", content=chunks(), headers=ZIP)
    assert "content-length" not in streamed.request.headers
    assert (streamed.status_code, streamed.json()["message"]) == (413, message)
    assert stored(open_app) == before
    jobs = open_app.post("/v1/jobs", content=bytes(3 << 19), headers={"Content-Type": "application/json"})
    assert jobs.status_code == 413 and "(ZERO1_MAX_REQUEST_BYTES)" in jobs.json()["message"]


@pytest.mark.parametrize("content_type", ["application/json", "application/octet-stream", None])
def test_a_body_not_sent_as_a_zip_is_a_415(open_app, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    body = upload(open_app, BUNDLE, headers=headers, status=415)
    got = repr(content_type) if content_type else "none"
    assert body == {
        "error": "unsupported_media_type",
        "message": f"POST /v1/code takes a zip sent with Content-Type: application/zip; the Content-Type was {got}",
    }


def test_an_unknown_or_malformed_digest(open_app):
    missing = open_app.get("/v1/code/sha256:" + "0" * 64)
    assert (missing.status_code, missing.json()["error"]) == (404, "not_found")
    malformed = open_app.get("/v1/code/sha256:xyz")
    assert malformed.status_code == 422 and malformed.json()["detail"][0]["field"] == "digest"


# --------------------------------------------------------------------------- auth on


def test_uploading_needs_a_token(secured):
    before = stored(secured)
    response = secured.post("/v1/code", content=BUNDLE, headers=ZIP)
    assert response.status_code == 401 and response.json()["error"] == "unauthorized"
    assert secured.get("/v1/code/sha256:" + "0" * 64).status_code == 401
    assert stored(secured) == before


def test_one_stored_zip_for_two_uploaders_each_seeing_only_themselves(secured):
    data = zip_of({"shared/model.py": b"W = 1\n"})
    code = upload(secured, data, headers=bearer(ALICE))["code"]
    files, _ = stored(secured)
    assert upload(secured, data, headers=bearer(BOB), status=200)["code"] == code
    assert stored(secured)[0] == files  # the same one zip
    seen = {
        token: secured.get(f"/v1/code/{code}", headers=bearer(token)).json()["uploaded_by"] for token in (ALICE, BOB)
    }
    assert seen == {ALICE: ["alice"], BOB: ["bob"]}
    assert secured.get(f"/v1/code/{code}", headers=bearer(ROOT)).json()["uploaded_by"] == ["alice", "bob"]


def test_another_users_bundle_is_a_404_to_read_and_a_403_to_use(secured):
    code = upload(secured, zip_of({"alices/model.py": b"SECRET = 1\n"}), headers=bearer(ALICE))["code"]
    assert secured.get(f"/v1/code/{code}", headers=bearer(BOB)).status_code == 404
    alice = Principal("alice")
    bob = Principal("bob")
    root = Principal("root", admin=True)
    with secured.app.state.runtime.db.session() as session:
        assert require_bundle(session, code, principal=alice).uploader == "alice"
        assert require_bundle(session, code, principal=root).uploader == "alice"  # an admin may use any
        with pytest.raises(ServiceError) as forbidden:
            require_bundle(session, code, principal=bob)
        with pytest.raises(ServiceError) as unknown:
            require_bundle(session, "sha256:" + "1" * 64, principal=alice)
        with pytest.raises(ServiceError) as malformed:
            require_bundle(session, "sha256:" + "1" * 63, principal=alice)
        with pytest.raises(ServiceError) as hidden:
            get_bundle(session, code, principal=PUBLIC)  # ZERO1_PUBLIC_READ without a token sees no bundle
    assert (forbidden.value.status_code, forbidden.value.error) == (403, "forbidden_code")
    assert f"code {code} was uploaded by other users, not by bob" in forbidden.value.message
    assert (unknown.value.status_code, unknown.value.error) == (422, "unknown_code")
    assert unknown.value.message == f"code sha256:{'1' * 64} is not known: upload it with POST /v1/code"
    assert unknown.value.extra["detail"][0]["field"] == "code"
    assert malformed.value.status_code == 422 and malformed.value.extra["detail"][0]["field"] == "code"
    assert hidden.value.status_code == 404


def test_with_auth_off_any_stored_bundle_may_be_used(open_app):
    code = upload(open_app, zip_of({"anyones/model.py": b""}))["code"]
    with open_app.app.state.runtime.db.session() as session:
        assert require_bundle(session, code, principal=ANONYMOUS).uploader is None
        session.add(CodeBundle(digest="sha256:" + "2" * 64, uploader="alice", bytes=1, files=1))
        session.flush()
        assert require_bundle(session, "sha256:" + "2" * 64, principal=ANONYMOUS).uploader == "alice"
        session.rollback()


def test_the_store_is_code_under_the_checkpoint_uri(open_app):
    runtime = open_app.app.state.runtime
    code = upload(open_app, BUNDLE)["code"]
    path = Path(runtime.settings.checkpoint_uri).resolve() / "code" / f"{code.removeprefix('sha256:')}.zip"
    assert path.is_file() and runtime.code.uri(code) == path.as_uri() == f"file://{path}"


LOOK = b"import os, sys\nWIDTH = 7\n\n\ndef look(_):\n    return sorted(os.listdir('.')), WIDTH, sys.path[0]\n"


def test_a_child_runs_in_its_copy_of_the_stored_bundle_and_its_parent_does_not(ray_cluster, open_app):
    """The contract the workers rely on: a task given the store's URI unpacks the user's files at the
    root of its child's working directory, first on the child's sys.path and on no one else's."""
    data = zip_of({"ranked/": b"", "ranked/__init__.py": b"", "ranked/net.py": LOOK, "notes.txt": b"hi"})
    uri = open_app.app.state.runtime.code.uri(upload(open_app, data)["code"])

    @ray.remote(num_cpus=0)
    def parent(uri: str) -> tuple[list, list[str], str]:
        import os
        import sys

        from workers.runtime.sandbox import call_in_child

        return call_in_child("ranked.net:look", None, timeout_s=120, bundle=uri), sys.path, os.getcwd()

    (listed, width, path0), paths, cwd = ray.get(parent.remote(uri), timeout=120)
    assert (listed, width) == (["notes.txt", "ranked"], 7)
    assert path0.endswith("/working_dir_files/code")
    assert path0 not in paths and cwd != path0 and not Path(path0).exists()  # removed once the child is done

"""A real S3 API for the tests: moto's standalone server on loopback (HTTP, SigV4, ranged GETs,
multipart uploads), reached the way production reaches S3, through the standard AWS_* variables.

Every request it answers is logged (method, bucket/key, Range, status, body bytes each way), so a
test can count what a read cost: a resharding rank that reads its own byte range of a shard must
cost that range's bytes, not the shard's.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import unquote

BUCKET = "zero1-test"
ACCESS_KEY_ID = "zero1-test-access-key"
SECRET_ACCESS_KEY = f"zero1-test-secret-{secrets.token_hex(8)}"
"""The session's S3 secret: a needle the trust tests look for where it must never be."""
REGION = "us-east-1"


@dataclass(slots=True)
class S3Request:
    """One request the server answered. `sent_bytes` counts the response body as it is sent."""

    method: str
    path: str
    """bucket/key, unquoted, without a leading slash ("zero1-test/job-1/step-000000002/complete.json")."""
    query: str
    range: str | None
    """The Range header as sent ("bytes=100-199"), or None."""
    received_bytes: int
    """The request body's Content-Length (an upload's bytes)."""
    status: int = 0
    sent_bytes: int = 0


class RequestLog:
    """WSGI middleware that logs each request before the app answers it, and counts each chunk of
    the answer before it is written: once a client holds the whole answer, the log says so."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app = app
        self.entries: list[S3Request] = []
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterator[bytes]:
        entry = S3Request(
            method=environ["REQUEST_METHOD"],
            # WSGI's PATH_INFO is the decoded path's bytes as latin-1
            path=unquote(environ.get("PATH_INFO", "").encode("latin-1").decode("utf-8", "replace")).lstrip("/"),
            query=environ.get("QUERY_STRING", ""),
            range=environ.get("HTTP_RANGE"),
            received_bytes=int(environ.get("CONTENT_LENGTH") or 0),
        )
        with self.lock:
            self.entries.append(entry)

        def start(status: str, headers: list, exc_info: Any = None) -> Any:
            entry.status = int(status.split()[0])
            return start_response(status, headers, exc_info)

        return self._counted(self.app(environ, start), entry)

    def _counted(self, body: Iterable[bytes], entry: S3Request) -> Iterator[bytes]:
        try:
            for chunk in body:
                with self.lock:
                    entry.sent_bytes += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


@dataclass(frozen=True, slots=True)
class S3Server:
    """The running server: where it is, its bucket, and what it was asked."""

    endpoint: str
    bucket: str
    log: RequestLog

    def uri(self, prefix: str = "") -> str:
        """s3://<bucket>/<prefix>."""
        return f"s3://{self.bucket}/{prefix.strip('/')}".rstrip("/")

    def mark(self) -> int:
        """A point in the log: requests(since=mark) are those after it."""
        with self.log.lock:
            return len(self.log.entries)

    def requests(self, since: int = 0, *, key_prefix: str = "", method: str | None = None) -> list[S3Request]:
        """The requests answered since `since` (copies), those under `key_prefix` (a key in the
        bucket, or an s3:// URI) and of `method` only where given."""
        path_prefix = self._path(key_prefix)
        with self.log.lock:
            entries = [replace(entry) for entry in self.log.entries[since:]]
        return [
            entry
            for entry in entries
            if entry.path.startswith(path_prefix) and (method is None or entry.method == method)
        ]

    def bytes_served(self, key_prefix: str = "", *, since: int = 0) -> int:
        """Body bytes the GETs of objects under `key_prefix` sent back since `since` (a listing is a
        GET of the bucket itself: counted only without a prefix)."""
        return sum(entry.sent_bytes for entry in self.requests(since, key_prefix=key_prefix, method="GET"))

    def _path(self, key_prefix: str) -> str:
        """The logged path's prefix: "" (every request, listings of the bucket too) for no prefix."""
        if key_prefix.startswith("s3://"):
            return key_prefix.removeprefix("s3://")
        return f"{self.bucket}/{key_prefix.lstrip('/')}" if key_prefix else ""


def aws_environment(endpoint: str) -> dict[str, str]:
    """The standard AWS variables that point boto (and so s3fs, and every Ray node started after
    them) at `endpoint` with the test credentials."""
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET_ACCESS_KEY,
        "AWS_REGION": REGION,
        "AWS_DEFAULT_REGION": REGION,
        # a developer's ~/.aws (profiles, an endpoint_url, an addressing style) must not take part
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_EC2_METADATA_DISABLED": "true",
    }


@contextlib.contextmanager
def patched_environ(values: dict[str, str], *, drop_prefix: str) -> Iterator[None]:
    """os.environ without any variable named `drop_prefix`*, plus `values`; the names it touched are
    restored after. Any AWS_* of the caller's (a profile, a session token, AWS_ENDPOINT_URL_S3)
    would override or mix with the test's settings."""
    values = dict(values)
    # an HTTP proxy of the machine's must not be asked for loopback
    for name in ("NO_PROXY", "no_proxy"):
        values[name] = ",".join(filter(None, [os.environ.get(name, ""), "127.0.0.1", "localhost"]))
    touched = {name for name in os.environ if name.startswith(drop_prefix)} | set(values)
    saved = {name: os.environ.get(name) for name in touched}
    for name in touched:
        os.environ.pop(name, None)
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@dataclass(frozen=True, slots=True)
class S3Endpoint:
    """A loopback address held for the session's S3 server before it runs: the AWS_* variables point
    at it from the session's start, so a Ray node started before the server (the session's cluster)
    hands them to its ranks' actors as a production node does, and only the tests that use S3 start it."""

    host: str
    port: int
    holder: socket.socket
    """Bound, not listening: no other process takes the port until the server does."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


@contextlib.contextmanager
def reserved_s3_endpoint() -> Iterator[S3Endpoint]:
    """A free loopback port held (see free_port: outside the kernel's ephemeral range) and the AWS_*
    variables set in os.environ for this process and every process it starts meanwhile."""
    from helpers import free_port

    holder = socket.socket()
    holder.bind(("127.0.0.1", free_port()))
    endpoint = S3Endpoint(host="127.0.0.1", port=holder.getsockname()[1], holder=holder)
    try:
        with patched_environ(aws_environment(endpoint.url), drop_prefix="AWS_"):
            yield endpoint
    finally:
        holder.close()


@contextlib.contextmanager
def running_s3_server(endpoint: S3Endpoint, *, bucket: str = BUCKET) -> Iterator[S3Server]:
    """moto's server on `endpoint` (the AWS_* variables already point there), and `bucket` created."""
    import boto3
    from moto.server import ThreadedMotoServer

    endpoint.holder.close()  # the port is moto's from here
    moto = ThreadedMotoServer(ip_address=endpoint.host, port=endpoint.port, verbose=False)
    moto.start()
    try:
        # the WSGI server moto started calls `server.app` for each request: wrapped before any is sent
        log = RequestLog(moto._server.app)
        moto._server.app = log
        server = S3Server(endpoint=endpoint.url, bucket=bucket, log=log)
        boto3.client("s3").create_bucket(Bucket=bucket)
        yield server
    finally:
        moto.stop()

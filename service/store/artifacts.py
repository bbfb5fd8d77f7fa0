"""A succeeded job's artifacts: read back from its final/ directory by the service, recorded in the
database, and served only as recorded.

The job's own code wrote final/, and it may have planted anything there: a link to the database, a
FIFO, a hard link, a manifest that lies. So every file the service reads back is opened by a chain
of O_NOFOLLOW opens from the checkpoint root down (workers/training/confined.py: no link anywhere
below it, even one swapped in while it is walked), must be a regular file with one link, and is
hashed by the service itself; the manifest's sizes and digests are claims checked against what it
read. A download opens the file the same way and hashes all of it
as it streams, holding its last piece back until the digest and size match the record: a file
changed after it was recorded is cut off, never served whole.

Imports the models and errors only: the jobs module, the scheduler and the routes call it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.errors import ServiceError
from service.store.db import Database
from service.store.tables import Artifact, Job, utcnow
from workers.training import confined
from workers.training.storage import ObjectStore

JobDir = Path | ObjectStore
"""A job's directory, or its prefix on an object store (no link can be planted there: the job's code
never writes to it; its rank's trusted parent stores what the code wrote, regular files only)."""

log = logging.getLogger(__name__)

FINAL = "final"
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 1 << 20
MAX_ARTIFACTS = 1000
"""Files one manifest may list; the rest are refused (each costs a read of the whole file)."""
_CHUNK_BYTES = 1 << 20
_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class FinalFile:
    """One artifact as recorded (or to be): its plain name in final/, its size, the sha256 the service computed."""

    name: str
    bytes: int
    sha256: str


class Refused(Exception):
    """A file under the job's directory the service will not read: why, in words."""


# --------------------------------------------------------------------------- reading final/


def open_final_file(job_dir: Path, name: str) -> int:
    """A read-only descriptor of `job_dir`/final/`name`, walked to from the checkpoint root (the
    service's own) with no link followed on the way (workers/training/confined.py); Refused unless it
    is a regular file with one link (a hard link could be another file of the service's)."""
    try:
        job = confined.open_dir(job_dir.parent, job_dir.name)
    except OSError as error:  # the storage unreadable, or the job's directory not one: its files with it
        raise Refused(f"{job_dir.name} cannot be reached: {error.strerror or error}") from None
    try:
        return confined.open_descriptor(job, f"{FINAL}/{name}")
    except OSError as error:
        raise Refused(error.strerror or str(error)) from None
    finally:
        os.close(job)


def _open_final(job_dir: JobDir, name: str) -> BinaryIO:
    """final/`name` open to read: by open_final_file's chain in a directory, or the stored object."""
    if isinstance(job_dir, Path):
        return os.fdopen(open_final_file(job_dir, name), "rb")
    try:
        return job_dir.open(f"{FINAL}/{name}")
    except FileNotFoundError:
        raise Refused(f"{FINAL}/{name} does not exist") from None
    except OSError as error:
        raise Refused(f"{FINAL}/{name}: {error}") from None


def _size(file: BinaryIO) -> int:
    size = getattr(file, "size", None)  # an object store's file knows it
    return int(size) if isinstance(size, int) else os.fstat(file.fileno()).st_size


def _final_exists(job_dir: JobDir) -> bool:
    if isinstance(job_dir, Path):
        # only whether to report a refusal: a link on the way counts as there (read_final refuses it)
        return (job_dir / FINAL).exists() or (job_dir / FINAL).is_symlink()
    return job_dir.exists(FINAL)


def read_final(job_dir: JobDir) -> tuple[list[FinalFile], list[str]]:
    """The files final/manifest.json lists that pass every check, each hashed here; and why each
    other one was refused (nothing and nothing when the job wrote no final/)."""
    try:
        manifest = _read_manifest(job_dir)
    except Refused as refusal:
        return [], [str(refusal)] if _final_exists(job_dir) else []
    files = []
    refused = []
    seen = set()
    for number, entry in enumerate(manifest):
        try:
            claim = _claim(entry, number=number, seen=seen)
            files.append(_checked(job_dir, claim))
        except Refused as refusal:
            refused.append(str(refusal))
    return files, refused


def _read_manifest(job_dir: JobDir) -> list:
    with _open_final(job_dir, MANIFEST) as file:
        data = file.read(MAX_MANIFEST_BYTES + 1)
    if len(data) > MAX_MANIFEST_BYTES:
        raise Refused(f"{FINAL}/{MANIFEST} is larger than {MAX_MANIFEST_BYTES} bytes")
    try:
        files = json.loads(data)["files"]
    except (ValueError, KeyError, TypeError):
        raise Refused(f'{FINAL}/{MANIFEST} is not JSON with a "files" list') from None
    if not isinstance(files, list):
        raise Refused(f'{FINAL}/{MANIFEST}: its "files" is not a list')
    return files


def _claim(entry: object, *, number: int, seen: set[str]) -> FinalFile:
    """The manifest's entry as a claim to check: a plain name (listed once), a size and a sha256."""
    if not isinstance(entry, dict):
        raise Refused(f"entry {number} is not an object")
    name = entry.get("name")
    size = entry.get("bytes")
    digest = entry.get("sha256")
    if not isinstance(name, str) or not is_plain_name(name):
        raise Refused(f"entry {number}: {str(name)[:80]!r} is not a plain file name")
    if name in seen or len(seen) >= MAX_ARTIFACTS:
        raise Refused(f"{name!r}: listed twice, or past the limit of {MAX_ARTIFACTS} files")
    seen.add(name)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise Refused(f"{name!r}: bytes {size!r} is not a size")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise Refused(f"{name!r}: sha256 {str(digest)[:80]!r} is not 64 lowercase hex digits")
    return FinalFile(name=name, bytes=size, sha256=digest)


def is_plain_name(name: str) -> bool:
    """A name final/ may hold as an artifact: one printable path component, not the manifest."""
    return 0 < len(name) <= 255 and name not in (".", "..", MANIFEST) and "/" not in name and name.isprintable()


def _checked(job_dir: JobDir, claim: FinalFile) -> FinalFile:
    """The file as the service reads it; Refused when it is not what the manifest claims."""
    with _open_final(job_dir, claim.name) as file:
        size = 0
        digest = hashlib.sha256()
        while chunk := file.read(min(_CHUNK_BYTES, claim.bytes + 1 - size)):  # one byte past: a larger file
            size += len(chunk)
            digest.update(chunk)
            if size > claim.bytes:
                break
    if size != claim.bytes or digest.hexdigest() != claim.sha256:
        raise Refused(
            f"{claim.name!r}: the manifest says {claim.bytes} bytes, sha256 {claim.sha256}; the file has "
            f"{size}{'+' if size > claim.bytes else ''} bytes, sha256 {digest.hexdigest()}"
        )
    return claim


# --------------------------------------------------------------------------- recording


def record_final(db: Database, job: Job, *, job_dir: JobDir) -> None:
    """Record the job's artifacts, once, in a transaction of its own: the scheduler calls it when the
    job's ranks report success, before the transaction that ends the job (the files are read and
    hashed with no transaction open)."""
    with db.session() as session:
        if session.get(Job, job.id).artifacts_recorded_at is not None:
            return
    files = _read_logged(job, job_dir)
    with db.session() as session:
        fresh = session.get(Job, job.id)
        if fresh.artifacts_recorded_at is None:
            _store(session, fresh, files)


def recorded_artifacts(session: Session, job: Job, *, job_dir: JobDir) -> list[FinalFile]:
    """The succeeded job's recorded artifacts, by name; a job that succeeded before they were recorded
    has its final/ read, checked and recorded now (the request commits it)."""
    if job.artifacts_recorded_at is None:
        _store(session, job, _read_logged(job, job_dir))
        session.flush()
    rows = session.scalars(select(Artifact).where(Artifact.job_id == job.id).order_by(Artifact.name))
    return [FinalFile(name=row.name, bytes=row.bytes, sha256=row.sha256) for row in rows]


def _read_logged(job: Job, job_dir: JobDir) -> list[FinalFile]:
    files, refused = read_final(job_dir)
    for why in refused:
        log.warning("job %s: an artifact in final/ is refused: %s", job.id, why)
    return files


def _store(session: Session, job: Job, files: list[FinalFile]) -> None:
    session.add_all(Artifact(job_id=job.id, name=f.name, bytes=f.bytes, sha256=f.sha256) for f in files)
    job.artifacts_recorded_at = utcnow()


# --------------------------------------------------------------------------- serving


def check_artifact(job: Job, job_dir: JobDir, artifact: FinalFile) -> None:
    """Before a download starts: the file is still a regular file of the recorded size; a 409 otherwise."""
    try:
        with _open_final(job_dir, artifact.name) as file:
            size = _size(file)
    except Refused as refusal:
        raise _changed(job, artifact, str(refusal)) from None
    if size != artifact.bytes:
        raise _changed(job, artifact, f"it has {size} bytes, {artifact.bytes} were recorded")


def _changed(job: Job, artifact: FinalFile, why: str) -> ServiceError:
    log.error("job %s: artifact %r is not as recorded, not served: %s", job.id, artifact.name, why)
    return ServiceError(
        f"job {job.id}'s artifact {artifact.name!r} changed since it was recorded ({why}): it is not served",
        status_code=409,
        error="artifact_changed",
    )


class ArtifactChanged(Exception):
    """A file whose bytes differ from its record, found while it streamed: the response is cut off."""


def stream_artifact(job_id: int, job_dir: JobDir, artifact: FinalFile, *, first: int, last: int) -> Iterator[bytes]:
    """Bytes first..last (inclusive) of the artifact, from a fresh open; the whole file is read and
    hashed, and the last piece is yielded only once the digest and size match the record
    (ArtifactChanged, logged, otherwise: the client never gets the file whole). On an object store
    the service streams it the same way (no presigned redirect: the digest check is the service's)."""
    with _open_final(job_dir, artifact.name) as file:
        size = 0
        digest = hashlib.sha256()
        held = b""
        while chunk := file.read(min(_CHUNK_BYTES, artifact.bytes + 1 - size)):  # one byte past: a larger file
            digest.update(chunk)
            piece = chunk[max(first - size, 0) : max(last + 1 - size, 0)]
            size += len(chunk)
            if piece:
                if held:
                    yield held
                held = piece
            if size > artifact.bytes:
                break
        if size != artifact.bytes or digest.hexdigest() != artifact.sha256:
            log.error(
                "job %s: artifact %r changed while it was served (%d bytes, sha256 %s; recorded %d, %s): cut off",
                job_id,
                artifact.name,
                size,
                digest.hexdigest(),
                artifact.bytes,
                artifact.sha256,
            )
            raise ArtifactChanged(f"job {job_id}: artifact {artifact.name!r} changed since it was recorded")
        if held:
            yield held

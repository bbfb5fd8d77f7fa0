"""A job's checkpoints as the service serves them for download: the complete ones its storage
(a directory or an object store) holds now, their files, and one file's bytes. What it reads was
written by the job's code, which may swap any directory on the way for a link at any moment: only
regular files with one link in real step directories, each walked to from the job's directory
with no link followed anywhere on the way (workers/training/storage.py's DirectoryStore, through
workers/training/confined.py), so a listing and the open that follows it never land in another
job's directory."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from service.errors import ServiceError
from workers.training.checkpoints import checkpoint_file_size, complete_checkpoints
from workers.training.storage import Store

CHUNK_BYTES = 1 << 20


def stored_checkpoints(store: Store) -> list[tuple[int, list[tuple[str, int]]]]:
    """(step, [(name, bytes)]) of each complete checkpoint, oldest first; a 503 naming the storage
    when it cannot be listed (an object store down, its credentials refused)."""
    try:
        return complete_checkpoints(store)
    except Exception as exc:  # noqa: BLE001 - botocore's errors are not OSErrors: any the store's client raised
        why = f"the job's storage {store.uri} could not be listed: {type(exc).__name__}: {exc}"
        raise ServiceError(why, status_code=503, error="storage_unreachable") from None


def open_checkpoint_file(store: Store, job_id: int, step: int, name: str) -> tuple[Any, int]:
    """The open file and its listed size; a 404 for a name the listing does not give (a path
    included), a checkpoint pruned or never complete, or a file that cannot be opened as a plain one."""
    try:
        listed = checkpoint_file_size(store, step, name)
    except Exception as exc:  # noqa: BLE001 - botocore's errors are not OSErrors: any the store's client raised
        why = f"the job's storage {store.uri} could not be read: {type(exc).__name__}: {exc}"
        raise ServiceError(why, status_code=503, error="storage_unreachable") from None
    if listed is None:
        raise ServiceError(
            f"job {job_id} has no checkpoint file {name!r} at step {step}", status_code=404, error="not_found"
        )
    try:
        return store.open(f"step-{step:09d}/{name}"), listed
    except OSError as exc:  # pruned since it was listed, or not a file the service reads
        why = f"job {job_id}'s checkpoint file {name!r} at step {step} cannot be read: {exc.strerror or exc}"
        raise ServiceError(why, status_code=404, error="not_found") from None
    except Exception as exc:  # noqa: BLE001 - an object store's client raises its own errors
        why = f"job {job_id}'s checkpoint file {name!r} at step {step} could not be read: {type(exc).__name__}: {exc}"
        raise ServiceError(why, status_code=503, error="storage_unreachable") from None


def stream_file(file: Any, *, first: int, last: int) -> Iterator[bytes]:
    """Bytes first..last of the open file, then it is closed; a file cut short ends the body early
    (the client gets fewer bytes than Content-Length said, and knows)."""
    with file:
        file.seek(first)
        left = last + 1 - first
        while left > 0 and (chunk := file.read(min(CHUNK_BYTES, left))):
            left -= len(chunk)
            yield chunk

"""Code bundles' stores: the checked bundles kept content-addressed, once per digest, for the jobs'
children: a directory every worker reads (code_dir), or code/ under an object store's prefix.
What a bundle may hold is service/store/code/checks.py's.
"""

from __future__ import annotations

import os
import tempfile
import zipfile
from pathlib import Path

from service.errors import ServiceError
from service.store.code.checks import (
    MAX_ENTRIES,
    MAX_UNCOMPRESSED_BYTES,
    BundleInfo,
    check_bundle,
    check_digest,
    digest_of,
    unpack,
)
from workers.training.storage import ObjectStore, open_store
from workers.uris import is_remote, join_uri


def code_dir(shared_dir: str) -> Path:
    """Where bundles are stored: code/ in Settings.shared_dir (ZERO1_CHECKPOINT_URI when it is a
    directory, else ZERO1_LOCAL_DIR), which every worker reads."""
    return Path(shared_dir).resolve() / "code"


class BundleStore:
    """Bundles named by the digest of the bytes uploaded, each re-packed under bundle/ from the checked
    entries. put() checks and packs one; a subclass says where it is kept."""

    root: Path | str
    """Where the bundles are, as errors name it."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES, max_uncompressed_bytes: int = MAX_UNCOMPRESSED_BYTES):
        self.max_entries = max_entries
        self.max_uncompressed_bytes = max_uncompressed_bytes

    def uri(self, digest: str) -> str:
        """The stored zip's URI, which a rank's actor or a trace's task unpacks for its child."""
        raise NotImplementedError

    def exists(self, digest: str) -> bool:
        raise NotImplementedError

    def _staging(self) -> Path:
        """The directory a bundle is packed in before it is published."""
        raise NotImplementedError

    def _publish(self, temp: Path, digest: str) -> None:
        """The packed zip `temp` becomes the bundle `digest`, whole or not at all."""
        raise NotImplementedError

    def put(self, data: bytes) -> tuple[BundleInfo, bool]:
        """Check `data` and store it unless it is already; (its info, whether it was new to the store)."""
        limits = {"max_entries": self.max_entries, "max_uncompressed_bytes": self.max_uncompressed_bytes}
        digest = digest_of(data)
        if self.exists(digest):
            return check_bundle(data, **limits), False
        try:
            handle, temp = tempfile.mkstemp(dir=self._staging(), prefix=".upload-", suffix=".zip")
        except OSError as error:
            raise _unwritable(self.root, error) from None
        try:
            with os.fdopen(handle, "wb") as file:
                with zipfile.ZipFile(file, "w", compression=zipfile.ZIP_DEFLATED) as into:
                    info = unpack(data, into=into, **limits)
                file.flush()
                os.fsync(file.fileno())
            self._publish(Path(temp), digest)
        except OSError as error:
            raise _unwritable(self.root, error) from None
        finally:
            Path(temp).unlink(missing_ok=True)
        return info, True


class CodeStore(BundleStore):
    """Bundles as <root>/<64 hex>.zip in a directory every worker reads."""

    def __init__(self, root: Path, **limits: int) -> None:
        super().__init__(**limits)
        self.root = root

    def path(self, digest: str) -> Path:
        return self.root / f"{check_digest(digest)}.zip"

    def uri(self, digest: str) -> str:
        """file://<path>."""
        return self.path(digest).as_uri()

    def exists(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def _publish(self, temp: Path, digest: str) -> None:
        os.chmod(temp, 0o644)  # mkstemp's 0o600 would keep out workers that run as another user
        os.replace(temp, self.path(digest))  # atomic: a reader sees the whole zip or none
        _fsync_dir(self.root)

    def _staging(self) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        # searchable, not listable: a worker opens a bundle by its digest; no job's code can list them
        os.chmod(self.root, 0o711)
        return self.root


class ObjectCodeStore(BundleStore):
    """Bundles as objects <prefix>/code/<64 hex>.zip on an object store (ZERO1_CHECKPOINT_URI=s3://…),
    packed in a local temporary directory first; a rank's actor or a task fetches one with its own credentials."""

    def __init__(self, store: ObjectStore, **limits: int) -> None:
        super().__init__(**limits)
        self.store = store
        self.root = store.uri

    def uri(self, digest: str) -> str:
        return f"{self.store.uri}/{check_digest(digest)}.zip"

    def exists(self, digest: str) -> bool:
        return self.store.exists(f"{check_digest(digest)}.zip")

    def _staging(self) -> Path:
        return Path(tempfile.gettempdir())

    def _publish(self, temp: Path, digest: str) -> None:
        try:
            self.store.put_file(temp, f"{check_digest(digest)}.zip")
        except OSError:
            raise
        except Exception as error:  # noqa: BLE001 - the object store's client raises its own errors
            raise OSError(f"{type(error).__name__}: {error}") from None


def code_store(checkpoint_uri: str, shared_dir: str) -> BundleStore:
    """Bundles beside the checkpoints: code/ under an object store's prefix, or code_dir(shared_dir)."""
    if is_remote(checkpoint_uri):
        return ObjectCodeStore(open_store(join_uri(checkpoint_uri, "code")))
    return CodeStore(code_dir(shared_dir))


def _fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    handle = os.open(path, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _unwritable(root: Path | str, error: OSError) -> ServiceError:
    return ServiceError(
        f"code storage under ZERO1_CHECKPOINT_URI ({root}) is not writable: {error.strerror or error}",
        status_code=503,
        error="code_storage_unwritable",
    )

"""Who uploaded which code bundle: an upload's record, a bundle's metadata, and the check that admits a
job's `code` only for its uploaders (and admins).

The bytes live in service.store.code.stores's store, once per digest; these rows say who may use them.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.auth import Principal
from service.errors import ServiceError
from service.schemas.responses import CodeBundleDetailPublic
from service.store.code.checks import BundleInfo, check_digest
from service.store.code.stores import BundleStore
from service.store.tables import CodeBundle


def record_upload(session: Session, *, info: BundleInfo, uploader: str | None) -> CodeBundle:
    """The uploader's row of the bundle, added if it is new (the same bytes from another user are another row)."""
    existing = _uploaded_by(session, info.digest, uploader=uploader)
    if existing is not None:
        return existing
    row = CodeBundle(digest=info.digest, uploader=uploader, bytes=info.bytes, files=info.files)
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:  # the same user's concurrent upload of the same bytes won the race
        return _uploaded_by(session, info.digest, uploader=uploader)
    return row


def check_quota(session: Session, *, digest: str, num_bytes: int, uploader: str | None, quota_bytes: int) -> None:
    """A 413 when recording `num_bytes` more for `uploader` would pass ZERO1_CODE_QUOTA_BYTES. The caller
    skips it for bytes the store holds already: they cost no storage. Checked before the write:
    concurrent uploads of one user may pass the quota by those in flight."""
    mine = CodeBundle.uploader.is_(None) if uploader is None else CodeBundle.uploader == uploader
    query = select(func.coalesce(func.sum(CodeBundle.bytes), 0)).where(mine, CodeBundle.digest != digest)
    stored = session.scalar(query)
    if stored + num_bytes <= quota_bytes:
        return
    who = "the anonymous user (auth is off)" if uploader is None else f"user {uploader}"
    raise ServiceError(
        f"{who} has {stored} bytes of code bundles recorded; this bundle's {num_bytes} bytes would make "
        f"{stored + num_bytes}, past the quota of {quota_bytes} bytes (ZERO1_CODE_QUOTA_BYTES)",
        status_code=413,
        error="code_quota_exceeded",
        stored_bytes=stored,
        bundle_bytes=num_bytes,
        quota_bytes=quota_bytes,
    )


def _uploaded_by(session: Session, digest: str, *, uploader: str | None) -> CodeBundle | None:
    # NULLs are distinct in a unique index: auth-off uploads are found with IS NULL, not stopped by the index
    mine = CodeBundle.uploader.is_(None) if uploader is None else CodeBundle.uploader == uploader
    return session.scalars(select(CodeBundle).where(CodeBundle.digest == digest, mine).limit(1)).first()


def _visible(session: Session, digest: str, *, principal: Principal) -> tuple[list[CodeBundle], bool]:
    """(the rows `principal` may see, whether there are any rows at all): all to an admin (anyone while
    auth is off), a user's own, none to a reader without a token."""
    rows = list(session.scalars(select(CodeBundle).where(CodeBundle.digest == digest).order_by(CodeBundle.id)))
    if principal.admin:
        return rows, bool(rows)
    return [row for row in rows if principal.user is not None and row.uploader == principal.user], bool(rows)


def get_bundle(session: Session, digest: str, *, principal: Principal) -> CodeBundleDetailPublic:
    """A bundle's metadata, to its uploaders and admins; to anyone else a 404, as if it did not exist."""
    check_digest(digest, field="digest")
    rows, _ = _visible(session, digest, principal=principal)
    if not rows:
        raise ServiceError(f"no code bundle {digest}", status_code=404, error="not_found")
    return CodeBundleDetailPublic(
        code=digest,
        bytes=rows[0].bytes,
        files=rows[0].files,
        uploaded_by=[row.uploader for row in rows],
        created_at=min(row.created_at for row in rows),
    )


def require_bundle(
    session: Session, digest: str, *, principal: Principal, store: BundleStore | None = None
) -> CodeBundle:
    """The bundle a job (or plan) of `principal` names as its `code`: a 422 when no one uploaded it, or
    when `store` no longer holds its zip; a 403 when only others did (an admin may use any; with auth
    off anyone may)."""
    check_digest(digest, field="code")
    rows, known = _visible(session, digest, principal=principal)
    if not known:
        raise ServiceError(
            f"code {digest} is not known: upload it with POST /v1/code",
            status_code=422,
            error="unknown_code",
            detail=[{"field": "code", "message": f"code {digest} is not known", "type": "value_error"}],
        )
    if not rows:
        raise ServiceError(
            f"code {digest} was uploaded by other users, not by {principal.user}: a job may use a bundle its "
            "submitter uploaded; upload the same zip with POST /v1/code (it is stored once)",
            status_code=403,
            error="forbidden_code",
        )
    if store is not None and not store.exists(digest):
        raise ServiceError(
            f"code {digest} is recorded but its zip is not in the code store ({store.root}): upload it again",
            status_code=422,
            error="unknown_code",
            detail=[{"field": "code", "message": f"code {digest} is not in the store", "type": "value_error"}],
        )
    return rows[0]

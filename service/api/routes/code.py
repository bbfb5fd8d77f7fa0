"""The code bundles API: upload a zip of Python code (checked, stored once per digest), read a bundle's metadata."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from service.api.deps import AppStateDep, PrincipalDep, ReaderDep, SessionDep, SettingsDep, errors, json_response
from service.errors import ServiceError
from service.schemas.responses import CodeBundleDetailPublic, CodeBundlePublic, ErrorPublic
from service.store.code import uploads as code_uploads
from service.store.code.checks import digest_of

router = APIRouter(prefix="/code", tags=["code"])
_ERRORS = errors(401, 403, 404, 413, 415, 422)
ZIP = "application/zip"
_ZIP_BODY = {"required": True, "content": {ZIP: {"schema": {"type": "string", "format": "binary"}}}}


def _check_zip_type(content_type: str | None) -> None:
    """A 415 unless the body is declared a zip."""
    if (content_type or "").partition(";")[0].strip().lower() != ZIP:
        got = repr(content_type) if content_type else "none"
        raise ServiceError(
            f"POST /v1/code takes a zip sent with Content-Type: {ZIP}; the Content-Type was {got}",
            status_code=415,
            error="unsupported_media_type",
        )


async def _read_body(request: Request) -> bytes:
    """The body as it streams in; BodySizeLimit stops it past ZERO1_MAX_CODE_BYTES (a 413)."""
    chunks = [chunk async for chunk in request.stream()]
    return b"".join(chunks)


@router.post(
    "",
    status_code=201,
    response_model=CodeBundlePublic,
    responses={
        200: {"model": CodeBundlePublic, "description": "The store held these bytes already"},
        **_ERRORS,
        503: {"model": ErrorPublic},
    },
    openapi_extra={"requestBody": _ZIP_BODY},
)
async def upload_code(
    request: Request, session: SessionDep, principal: PrincipalDep, runtime: AppStateDep, settings: SettingsDep
) -> Response:
    """Check a zip of Python code and store it; a job names it by the `code` answered. 201 when the bytes
    are new to the store, 200 when it held them already (this uploader is recorded either way). 413 when
    new bytes would pass the uploader's ZERO1_CODE_QUOTA_BYTES."""
    _check_zip_type(request.headers.get("content-type"))
    data = await _read_body(request)
    digest = digest_of(data)
    if not runtime.code.exists(digest):  # bytes the store holds already cost nothing
        await run_in_threadpool(
            code_uploads.check_quota,
            session,
            digest=digest,
            num_bytes=len(data),
            uploader=principal.user,
            quota_bytes=settings.code_quota_bytes,
        )
    # decompressing up to 1 GiB and writing the store's zip is work for a thread, not the event loop
    info, created = await run_in_threadpool(runtime.code.put, data)
    await run_in_threadpool(code_uploads.record_upload, session, info=info, uploader=principal.user)
    return json_response(
        CodeBundlePublic(code=info.digest, bytes=info.bytes, files=info.files), status_code=201 if created else 200
    )


@router.get("/{digest}", response_model=CodeBundleDetailPublic, responses=_ERRORS)
def get_code(
    digest: Annotated[str, Path(description="sha256:<64 hex>, as the upload answered")],
    session: SessionDep,
    principal: ReaderDep,
) -> Response:
    """A bundle's size and uploaders; its uploaders' and admins' only (a 404 to others, as for a job's metrics)."""
    return json_response(code_uploads.get_bundle(session, digest, principal=principal))

"""What a download answers besides its bytes: the Range a client asked for (RFC 9110, one range)
and the Content-Disposition that names the file. Shared by a job's artifacts and checkpoints."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any
from urllib.parse import quote

from fastapi import Header, Path
from fastapi.responses import StreamingResponse

from service.errors import ServiceError
from service.schemas.responses import ErrorPublic

RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"application/octet-stream": {}}, "description": "The file's bytes"},
    206: {"description": "The bytes a Range header asked for"},
    416: {"model": ErrorPublic},
}
"""What a download route answers besides its errors, for the OpenAPI document."""

FileName = Annotated[str, Path(min_length=1, max_length=255)]
"""A file's name in a download's path."""
RangeHeader = Annotated[str | None, Header(alias="range", max_length=200)]
"""A download's `Range` header: `bytes=a-b`, `bytes=a-` or `bytes=-n`."""


def download(
    body: Callable[[int, int], Iterator[bytes]], *, filename: str, size: int, range_header: str | None
) -> StreamingResponse:
    """The file's bytes, or the range `range_header` asks for (206), from body(first, last): its
    Content-Length, Accept-Ranges and Content-Disposition (a 416 past the end, before body is called)."""
    span = byte_range(range_header, size=size)
    first, last = span or (0, size - 1)
    headers = {
        "Accept-Ranges": "bytes",
        "Content-Length": str(max(last + 1 - first, 0)),
        "Content-Disposition": attachment(filename),
    }
    if span is not None:
        headers["Content-Range"] = f"bytes {first}-{last}/{size}"
    return StreamingResponse(
        body(first, last),
        status_code=206 if span is not None else 200,
        media_type="application/octet-stream",
        headers=headers,
    )


_RANGE = re.compile(r"bytes=(\d{0,19})-(\d{0,19})")


def byte_range(header: str | None, *, size: int) -> tuple[int, int] | None:
    """(first, last) of a single `bytes=a-b`, `bytes=a-` or `bytes=-n` range; None for no header or one
    this does not serve as a range (several ranges, another unit: the whole file, as RFC 9110 allows);
    a 416 when it starts past the end."""
    found = None if header is None else _RANGE.fullmatch(header.strip())
    if found is None or found[1] == found[2] == "":
        return None
    if found[1] == "":  # the last n bytes
        first = max(size - int(found[2]), 0)
        last = size - 1
        if int(found[2]) == 0 or size == 0:
            raise unsatisfiable(header, size=size)
        return first, last
    first = int(found[1])
    last = size - 1 if found[2] == "" else min(int(found[2]), size - 1)
    if found[2] != "" and int(found[2]) < first:
        return None  # an invalid range is ignored
    if first >= size:
        raise unsatisfiable(header, size=size)
    return first, last


def unsatisfiable(header: str, *, size: int) -> ServiceError:
    return ServiceError(
        f"Range: {header!r} starts past the end of the file ({size} bytes)",
        status_code=416,
        error="range_not_satisfiable",
        headers={"Content-Range": f"bytes */{size}"},
    )


def attachment(name: str) -> str:
    """Content-Disposition for `name`, as Starlette's FileResponse writes it."""
    quoted = quote(name)
    return f'attachment; filename="{name}"' if quoted == name else f"attachment; filename*=utf-8''{quoted}"

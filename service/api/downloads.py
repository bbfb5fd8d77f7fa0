"""What a download answers besides its bytes: the Range a client asked for (RFC 9110, one range)
and the Content-Disposition that names the file. Shared by a job's artifacts and checkpoints."""

from __future__ import annotations

import re
from urllib.parse import quote

from service.errors import ServiceError

_RANGE = re.compile(r"bytes=(\d{0,19})-(\d{0,19})")


def byte_range(header: str | None, *, size: int) -> tuple[int, int] | None:
    """(first, last) of a single `bytes=a-b`, `bytes=a-` or `bytes=-n` range; None for no header or one
    this does not serve as a range (several ranges, another unit: the whole file, as RFC 9110 allows);
    a 416 when it starts past the end."""
    found = None if header is None else _RANGE.fullmatch(header.strip())
    if found is None or found[1] == found[2] == "":
        return None
    if found[1] == "":  # the last n bytes
        first, last = max(size - int(found[2]), 0), size - 1
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

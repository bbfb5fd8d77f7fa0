"""The request body limits, counted on the bytes as they stream in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


@dataclass(frozen=True, slots=True)
class BodyLimit:
    max_bytes: int
    setting: str
    """The environment variable that sets it, which the 413 names."""

    def message(self) -> str:
        return f"the request body is over the limit of {self.max_bytes} bytes ({self.setting})"


class BodySizeLimit:
    """413 for a body over its path's limit: at once by its Content-Length, else when the streamed bytes pass it.

    A chunked body has no Content-Length, so counting what `receive` yields is the only
    bound that holds for every client. Every path has `default` but those in `by_path`
    (a code bundle's upload may be larger than a job's JSON).
    """

    def __init__(self, app: ASGIApp, *, default: BodyLimit, by_path: Mapping[str, BodyLimit] | None = None):
        self.app = app
        self.default = default
        self.by_path = dict(by_path or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.by_path.get(scope["path"], self.default)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > limit.max_bytes:
            body = {"error": "request_too_large", "message": limit.message()}  # as the error handler renders it
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        received_bytes = 0

        async def limited() -> Message:
            nonlocal received_bytes
            message = await receive()
            if message["type"] == "http.request":
                received_bytes += len(message.get("body", b""))
                if received_bytes > limit.max_bytes:
                    # FastAPI re-raises an HTTPException from reading the body; the JSON error handler renders it
                    raise HTTPException(413, detail=limit.message())
            return message

        await self.app(scope, limited, send)

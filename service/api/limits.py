"""The request body limit, counted on the bytes as they stream in."""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """413 for a body over `max_bytes`: at once by its Content-Length, else when the streamed bytes pass it.

    A chunked body has no Content-Length, so counting what `receive` yields is the only
    bound that holds for every client.
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _message(self) -> str:
        return f"the request body is over the limit of {self.max_bytes} bytes (ZERO1_MAX_REQUEST_BYTES)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = {"error": "request_too_large", "message": self._message()}  # as the error handler renders it
            return await JSONResponse(body, status_code=413)(scope, receive, send)
        received_bytes = 0

        async def limited() -> Message:
            nonlocal received_bytes
            message = await receive()
            if message["type"] == "http.request":
                received_bytes += len(message.get("body", b""))
                if received_bytes > self.max_bytes:
                    # FastAPI re-raises an HTTPException from reading the body; the JSON error handler renders it
                    raise HTTPException(413, detail=self._message())
            return message

        await self.app(scope, limited, send)

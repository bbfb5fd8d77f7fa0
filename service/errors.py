"""Typed service errors and the handlers that render every error as JSON.

Each error body is {"error": code, "message": text naming the field and the
numbers, "detail": [...]?}; an expected failure is a 4xx, never a 500.

May import: service.schemas, workers.config.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from service.schemas.data_specs import DATA_KINDS
from service.schemas.model_specs import MODEL_KINDS
from workers.config import FieldError

log = logging.getLogger(__name__)

_MAX_ECHO_CHARS = 80
_UNION_TAGS = {"model": MODEL_KINDS, "data": DATA_KINDS}  # pydantic names the member of a tagged union


class ServiceError(Exception):
    """An expected failure with its HTTP status and a machine-readable code."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 400,
        error: str = "bad_request",
        headers: dict[str, str] | None = None,
        **extra: Any,
    ):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.error = error
        self.extra = extra
        self.headers = headers


def storage_unreachable(field: str, error: Exception) -> ServiceError:
    """A 503 for an object store that could not be read where `field` points (its endpoint, its
    credentials): botocore's errors are not OSErrors, so any the store's client raised."""
    return ServiceError(
        f"{field}: the object store could not be read: {type(error).__name__}: {error}",
        status_code=503,
        error="storage_unreachable",
    )


def _field_path(loc: tuple[Any, ...]) -> str:
    """('body', 'model', 'gpt', 'n_embd') -> 'model.n_embd', ('body', 'data', 'text', 'path') -> 'data.path'
    (drops the source and union tags)."""
    parts = [str(p) for i, p in enumerate(loc) if not (i == 0 and p in ("body", "query", "path", "header"))]
    parts = [p for i, p in enumerate(parts) if not (i > 0 and p in _UNION_TAGS.get(parts[i - 1], ()))]
    return ".".join(parts) or "body"


def _echo(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_ECHO_CHARS else text[: _MAX_ECHO_CHARS - 3] + "..."


def describe_validation_errors(errors: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """One readable message plus a JSON-safe list of {field, message, type}."""
    detail = []
    lines = []
    for err in errors:
        field = _field_path(tuple(err.get("loc", ())))
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        kind = err.get("type", "value_error")
        named = err.get("ctx", {}).get("error")
        if isinstance(named, FieldError):  # a check across fields names the one to change, under its model's path
            field = named.field if field == "body" else f"{field}.{named.field}"
            msg = named.reason
        elif kind == "json_invalid":  # loc is ("body", character position)
            position = err["loc"][-1] if len(err.get("loc", ())) > 1 else 0
            field = "body"
            msg = f"invalid JSON at character {position} ({err.get('ctx', {}).get('error')})"
        elif isinstance(err.get("input"), bytes):  # the body was not parsed as JSON
            msg = "expected a JSON object; send it with Content-Type: application/json"
        elif kind not in ("missing", "value_error") and "input" in err and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {_echo(err['input'])})"
        lines.append(f"{field}: {msg}")
        detail.append({"field": field, "message": msg, "type": kind})
    return "; ".join(lines), detail


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    message, detail = describe_validation_errors(list(exc.errors()))
    return JSONResponse({"error": "invalid_request", "message": message, "detail": detail}, status_code=422)


async def _service_error(_: Request, exc: ServiceError) -> JSONResponse:
    return JSONResponse(
        {"error": exc.error, "message": exc.message, **exc.extra}, status_code=exc.status_code, headers=exc.headers
    )


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's 400 for a JSON body that is not UTF-8
        return _invalid_json(f"not UTF-8 ({exc.__cause__.reason} at byte {exc.__cause__.start})")
    if isinstance(exc.__cause__, ValueError):
        # the other ValueError json.loads raises besides JSONDecodeError (a 422 already): an integer
        # literal longer than Python converts (https://docs.python.org/3/library/stdtypes.html#int-max-str-digits)
        return _invalid_json(f"an integer of more than {sys.get_int_max_str_digits()} digits")
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code, "http_error")
    return JSONResponse({"error": code, "message": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)


def _invalid_json(reason: str) -> JSONResponse:
    """A 422 like any other body that is not JSON (FastAPI's own is a 400 with no reason)."""
    message = f"invalid JSON: {reason}"
    detail = [{"field": "body", "message": message, "type": "json_invalid"}]
    return JSONResponse({"error": "invalid_request", "message": f"body: {message}", "detail": detail}, status_code=422)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return JSONResponse({"error": "internal", "message": "internal server error"}, status_code=500)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)

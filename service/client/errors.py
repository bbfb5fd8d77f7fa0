"""The client's errors: `ApiError`, an answer of the API that is not a success, and `StreamError`, a
log stream that broke off and did not come back."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import httpx


class ApiError(Exception):
    """The API answered with an error: `status` (the HTTP code), `error` (its code, e.g.
    "does_not_fit"), `message` (what a person reads), `detail` (the fields at fault, for a 422), and
    `body` (the whole JSON answer: a does_not_fit's carries the plan)."""

    def __init__(self, status: int, error: str, message: str, detail: list[dict] | None = None, body=None) -> None:
        super().__init__(f"{status} {error}: {message}")
        self.status = status
        self.error = error
        self.message = message
        self.detail = detail
        self.body = body if body is not None else {}

    @classmethod
    def of(cls, response: httpx.Response) -> ApiError:
        response.read()  # a streamed response's body is not read yet
        try:
            body = response.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):  # not the API's JSON: a proxy's page, say
            return cls(response.status_code, "http_error", response.text or response.reason_phrase)
        message = body.get("message")
        return cls(
            response.status_code,
            str(body.get("error", "http_error")),
            str(message if message is not None else body),
            body.get("detail"),
            body,
        )


def raise_for(response: httpx.Response) -> httpx.Response:
    """The response, if it is a success; else its ApiError raised."""
    if not response.is_success:
        raise ApiError.of(response)
    return response


class StreamError(ConnectionError):
    """A job's log stream broke off before the job ended, and every new try failed."""

"""Logging in to the dashboard: a form that puts the API token in an HttpOnly cookie.

A page without a token while reads need one redirects here; the cookie then authenticates
the page and dashboard.js's calls to /v1 (which add X-Zero1-CSRF for cancelling).
"""

from __future__ import annotations

import math
from typing import Annotated
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse

from service.api.deps import AuthenticatorDep
from service.auth import TOKEN_COOKIE, Principal, credential
from service.dashboard.routes import templates
from service.errors import ServiceError
from service.lockout import LoginLockout, client_key

router = APIRouter(include_in_schema=False)
MAX_FORM_BYTES = 4096


class LoginRequired(Exception):
    """A dashboard page was asked for without a valid token: the browser goes to /login and comes back."""

    def __init__(self, next_path: str):
        super().__init__(next_path)
        self.next_path = next_path


def require_page_reader(request: Request, authenticator: AuthenticatorDep) -> Principal:
    """The dashboard's pages read like GET /v1/*, but a browser without a token is sent to log in."""
    try:
        principal = authenticator.reader(request)
    except ServiceError as error:
        if error.status_code != 401:
            raise
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise LoginRequired(path) from None
    request.state.principal = principal  # base.html shows who is logged in
    return principal


async def _to_login(_: Request, exc: LoginRequired) -> RedirectResponse:
    return RedirectResponse(f"/login?next={quote(exc.next_path, safe='')}", status_code=303)


def install_login(app: FastAPI) -> None:
    """The login routes, counting wrong tokens in the authenticator's lockout: the API's and the form's together."""
    app.state.login_lockout = app.state.authenticator.lockout
    app.add_exception_handler(LoginRequired, _to_login)
    app.include_router(router)


def get_lockout(request: Request) -> LoginLockout:
    return request.app.state.login_lockout


LockoutDep = Annotated[LoginLockout, Depends(get_lockout)]


def _local(path: str | None) -> str:
    """Only a path on this site: never //host or /\\host, which a browser reads as another site."""
    if not path or not path.startswith("/") or path.startswith(("//", "/\\")):
        return "/"
    return path


def _form(
    request: Request, *, next_path: str, error: str | None, status_code: int = 200, headers: dict | None = None
) -> HTMLResponse:
    context = {"page": "login", "next": _local(next_path), "error": error}
    return templates.TemplateResponse(request, "login.html", context, status_code=status_code, headers=headers)


def _locked_out(request: Request, *, next_path: str, lockout: LoginLockout, wait_s: float) -> HTMLResponse:
    seconds = math.ceil(wait_s)
    error = (
        f"{lockout.max_failures} wrong tokens within {lockout.window_s:g} s: try again in {seconds} s. "
        "Until then no token is checked from this address."
    )
    return _form(request, next_path=next_path, error=error, status_code=429, headers={"Retry-After": str(seconds)})


@router.get("/login", response_class=HTMLResponse)
def login_page(request: Request, authenticator: AuthenticatorDep, next: str = "/"):
    if not authenticator.tokens.enabled:  # auth is off: nothing to log in to
        return RedirectResponse(_local(next), status_code=303)
    return _form(request, next_path=next, error=None)


@router.post("/login", response_class=HTMLResponse)
async def login(request: Request, authenticator: AuthenticatorDep, lockout: LockoutDep):
    """Check the token; set it as an HttpOnly, SameSite=Strict cookie and go where the user was going.

    A client with too many recent failures gets a 429 without its token being checked, a valid one
    included (else a guesser would go on at full speed, only reading the answers later), but for a
    token that already succeeded from that address (service/lockout.py)."""
    form = parse_qs((await request.body())[:MAX_FORM_BYTES].decode(errors="replace"))
    token = form.get("token", [""])[0].strip()
    next_path = _local(form.get("next", ["/"])[0])
    if not authenticator.tokens.enabled:
        return RedirectResponse(next_path, status_code=303)
    client = client_key(request.client.host if request.client else None)
    if (wait_s := lockout.retry_after_s(client, credential=credential(token))) > 0:
        return _locked_out(request, next_path=next_path, lockout=lockout, wait_s=wait_s)
    principal = authenticator.tokens.lookup(token) if token else None
    if principal is None:  # the form is drawn again empty: the token typed is never echoed
        lockout.record_failure(client)
        return _form(request, next_path=next_path, error="That token is not valid.", status_code=401)
    lockout.record_success(client, credential(token))
    response = RedirectResponse(next_path, status_code=303)
    response.set_cookie(
        TOKEN_COOKIE, token, httponly=True, samesite="strict", secure=request.url.scheme == "https", path="/"
    )
    return response


@router.post("/logout")
def logout() -> RedirectResponse:
    response = RedirectResponse("/login", status_code=303)
    response.delete_cookie(TOKEN_COOKIE, path="/")
    return response

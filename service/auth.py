"""API tokens: who is calling, and what they may do.

With no tokens configured auth is off: every request is one anonymous user who may do
anything, which is safe only on loopback (`zero1 serve` refuses any other address). With
tokens, a request names its user by `Authorization: Bearer <token>`, or by the dashboard's
`zero1_token` cookie; a mutating request authenticated by the cookie must also send
`X-Zero1-CSRF: 1`, a header no cross-site form can set. Every wrong token counts against its
client in the app's one lockout (service/lockout.py), as a wrong one at /login does; a locked-out
client's valid token passes only if it already succeeded from that address.

May import: service.settings, service.placeholders, service.errors, service.lockout.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import re
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from service.errors import ServiceError
from service.lockout import LoginLockout, client_key
from service.placeholders import PLACEHOLDER_RULE, is_placeholder
from service.settings import Settings

TOKEN_COOKIE = "zero1_token"
CSRF_HEADER = "X-Zero1-CSRF"
MIN_TOKEN_CHARS = 16
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,199}")  # fits Job.owner (200 characters)
_CHALLENGE = {"WWW-Authenticate": "Bearer"}
MAKE_ONE = "make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))'"


@dataclass(frozen=True, slots=True)
class Principal:
    """The caller: `user` is None for the anonymous user (auth off) and for public reads."""

    user: str | None
    admin: bool = False


ANONYMOUS = Principal(user=None, admin=True)
"""Every caller while auth is off: as before tokens existed, anyone may cancel anything."""
PUBLIC = Principal(user=None, admin=False)
"""A caller without a token on a read that ZERO1_PUBLIC_READ opened: it sees the jobs, not their details."""


@dataclass(frozen=True, slots=True)
class _Entry:
    digest: bytes  # sha256 of the token: every comparison is of 32 bytes, so lengths leak nothing
    principal: Principal


class TokenTable:
    """The configured tokens, parsed once; `lookup` compares against every one in constant time."""

    def __init__(self, entries: list[_Entry]):
        self._entries = tuple(entries)

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def users(self) -> frozenset[str]:
        """The users that have a token."""
        return frozenset(entry.principal.user for entry in self._entries if entry.principal.user)

    def __repr__(self) -> str:  # never the tokens, not even their digests
        return f"TokenTable({len(self)} tokens)"

    def lookup(self, token: str) -> Principal | None:
        """The token's principal, or None; no early exit, so the time says nothing about which matched."""
        digest = hashlib.sha256(token.encode()).digest()
        found = None
        for entry in self._entries:
            if hmac.compare_digest(entry.digest, digest) and found is None:
                found = entry.principal
        return found


# --------------------------------------------------------------------------- parsing


def parse_entry(text: str, *, where: str) -> _Entry:
    """'user:token' or 'user:token:admin'; an error names `where` and the user, never the token.

    A token of .env.example (see config.PLACEHOLDER) is refused: `cp .env.example .env` would otherwise
    serve with an admin token everyone knows."""
    fields = text.split(":")
    if len(fields) not in (2, 3):
        raise ValueError(f"{where}: expected user:token or user:token:admin, got {len(fields)} ':'-separated fields")
    user = fields[0].strip()
    token = fields[1].strip()
    if len(fields) == 3 and fields[2].strip() != "admin":
        raise ValueError(f"{where}: the third field of user:token:admin must be 'admin'")
    if not _USER.fullmatch(user):
        raise ValueError(f"{where}: the user must be 1-200 of A-Z a-z 0-9 _ . @ - (starting with a letter or digit)")
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"{where} (user {user}): the token has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}; {MAKE_ONE}"
        )
    if is_placeholder(token):
        raise ValueError(f"{where} (user {user}): the token is a placeholder ({PLACEHOLDER_RULE}); {MAKE_ONE}")
    principal = Principal(user=user, admin=len(fields) == 3)
    return _Entry(digest=hashlib.sha256(token.encode()).digest(), principal=principal)


def _token_lines(settings: Settings) -> list[tuple[str, str]]:
    """(where, text) of every configured entry: ZERO1_API_TOKENS, then the file's lines."""
    lines = []
    if settings.api_tokens is not None:
        parts = settings.api_tokens.get_secret_value().split(",")
        lines += [(f"ZERO1_API_TOKENS entry {i}", part.strip()) for i, part in enumerate(parts, 1) if part.strip()]
    if settings.api_tokens_file:
        path = Path(settings.api_tokens_file)
        try:
            text = path.read_text()
        except OSError as error:
            raise ValueError(f"ZERO1_API_TOKENS_FILE: cannot read {path}: {error.strerror}") from None
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip() and not line.strip().startswith("#"):
                lines.append((f"ZERO1_API_TOKENS_FILE {path} line {number}", line.strip()))
    return lines


def load_tokens(settings: Settings) -> TokenTable:
    """The token table of ZERO1_API_TOKENS and ZERO1_API_TOKENS_FILE; a malformed entry is a ValueError."""
    entries: list[_Entry] = []
    for where, text in _token_lines(settings):
        entry = parse_entry(text, where=where)
        if any(hmac.compare_digest(entry.digest, seen.digest) for seen in entries):
            raise ValueError(f"{where} (user {entry.principal.user}): the token repeats an earlier entry's")
        entries.append(entry)
    return TokenTable(entries)


# --------------------------------------------------------------------------- binding


def is_loopback(host: str) -> bool:
    """127.0.0.0/8, ::1 and localhost; any other name may resolve to a public address."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, *, tokens: TokenTable) -> None:
    """Refuse to serve beyond loopback without tokens: anyone who reached it could run code on the cluster."""
    if not tokens.enabled and not is_loopback(host):
        raise ValueError(
            f"refusing to bind {host!r} without API tokens: anyone who can reach it could submit and cancel "
            "jobs. Set ZERO1_API_TOKENS (user:token[:admin],...) or ZERO1_API_TOKENS_FILE, "
            "or bind 127.0.0.1"
        )


# --------------------------------------------------------------------------- requests


def _unauthorized(message: str) -> ServiceError:
    return ServiceError(message, status_code=401, error="unauthorized", headers=_CHALLENGE)


def credentials(request: Request) -> tuple[str | None, bool]:
    """(token, from_cookie): the Authorization header wins over the cookie."""
    header = request.headers.get("authorization")
    if header is not None:
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("the Authorization header must be 'Bearer <token>'")
        return token.strip(), False
    cookie = request.cookies.get(TOKEN_COOKIE)
    return (cookie, True) if cookie else (None, False)


def credential(token: str) -> bytes:
    """What the lockout remembers of a token that succeeded from an address: its digest, never the token."""
    return hashlib.sha256(token.encode()).digest()


def lockout_of(settings: Settings) -> LoginLockout:
    """The app's lockout: ZERO1_AUTH_MAX_FAILURES wrong tokens within ZERO1_AUTH_FAILURE_WINDOW_S."""
    return LoginLockout(max_failures=settings.auth_max_failures, window_s=settings.auth_failure_window_s)


def locked_out(lockout: LoginLockout, *, wait_s: float) -> ServiceError:
    """The 429 of a client that sent too many wrong tokens: when it may try again, in the message and Retry-After."""
    seconds = math.ceil(wait_s)
    return ServiceError(
        f"{lockout.max_failures} wrong tokens within {lockout.window_s:g} s from this address: try again in "
        f"{seconds} s (until then no token it sends is checked)",
        status_code=429,
        error="too_many_failures",
        headers={"Retry-After": str(seconds)},
    )


class Authenticator:
    """Decides, for every request, who calls and whether they may; the routes' dependencies ask it.

    `lockout` counts the wrong tokens of each client, by header or cookie; a client past its bound gets a
    429 before its token is looked up, a valid one included (else a guesser would go on at full speed),
    but for a token that already succeeded from that address (its user is not locked out by another's
    guessing behind the same address)."""

    def __init__(self, tokens: TokenTable, *, public_read: bool, lockout: LoginLockout | None = None):
        self.tokens = tokens
        self.public_read = public_read
        self.lockout = LoginLockout() if lockout is None else lockout

    def _identify(self, request: Request) -> tuple[Principal, bool]:
        token, from_cookie = credentials(request)
        if token is None:
            raise _unauthorized(
                "this endpoint needs an API token: send Authorization: Bearer <token> (or log in at /login)"
            )
        client = client_key(request.client.host if request.client else None)
        if (wait_s := self.lockout.retry_after_s(client, credential=credential(token))) > 0:
            raise locked_out(self.lockout, wait_s=wait_s)
        principal = self.tokens.lookup(token)
        if principal is None:
            self.lockout.record_failure(client)
            raise _unauthorized(
                "the API token is not valid: send Authorization: Bearer <token> with a configured token"
            )
        self.lockout.record_success(client, credential(token))
        return principal, from_cookie

    def reader(self, request: Request) -> Principal:
        """Who may read: anyone while auth is off; with ZERO1_PUBLIC_READ, a caller without a token too (as
        PUBLIC, who sees no job's details); else a token's user. A token sent is always checked."""
        if not self.tokens.enabled:
            return ANONYMOUS
        if self.public_read and credentials(request)[0] is None:
            return PUBLIC
        return self._identify(request)[0]

    def writer(self, request: Request) -> Principal:
        """Who may change something: a token's user; by cookie only with the CSRF header."""
        if not self.tokens.enabled:
            return ANONYMOUS
        principal, from_cookie = self._identify(request)
        if from_cookie and request.headers.get(CSRF_HEADER) != "1":
            raise ServiceError(
                f"a request authenticated by the {TOKEN_COOKIE} cookie must send the header {CSRF_HEADER}: 1 "
                "(the dashboard does); other clients send Authorization: Bearer <token>",
                status_code=403,
                error="csrf",
            )
        return principal


def check_can_steer(principal: Principal, *, job_id: int, owner: str | None, action: str = "cancel") -> None:
    """A job's owner and admins may cancel it, suspend or resume it, change its priority (`action`);
    anyone else gets a 403 naming the owner and the action."""
    if principal.admin or (owner is not None and principal.user == owner):
        return
    whose = f"belongs to {owner}" if owner is not None else "has no owner (submitted while auth was off)"
    raise ServiceError(
        f"job {job_id} {whose}; only {owner or 'an admin'}{' or an admin' if owner else ''} may {action} it, "
        f"not {principal.user}",
        status_code=403,
        error="forbidden",
        owner=owner,
    )

"""How many wrong tokens one client may try: a bound on guessing, kept in bounded memory.

Every token the service checks counts, however it came: POST /login's form, the API's
Authorization header, the dashboard's cookie. One lockout per app holds them all (the
Authenticator's), so a guesser cannot spend its failures once per way in.

The client is the address the connection came from (a proxy's X-Forwarded-For only when the proxy is
one of ZERO1_TRUSTED_PROXIES: uvicorn rewrites it, service/cli/server.py). A locked-out address gets a
429 for every token it sends without it being checked, but one: a token that already succeeded from
that address within KNOWN_S (as a site that knows your device lets you in while it locks out the
guesser's). So a guesser behind the same address (a NAT, a tunnel, Compose's bridge) cannot lock out
the users already working there, and still learns nothing of any token it guesses but those.

May import: the standard library only.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

MAX_FAILURES = 10
"""Wrong tokens one client may send within WINDOW_S; its next try is a 429 until the oldest is WINDOW_S old."""
WINDOW_S = 60.0
MAX_CLIENTS = 10_000
"""Clients remembered at once; past it the one whose last failure is oldest is forgotten, so a flood of
addresses costs at most MAX_CLIENTS x MAX_FAILURES timestamps."""
KNOWN_S = 86_400.0
"""How long a token that succeeded from an address stays known there (each success renews it)."""
MAX_KNOWN = 10_000
"""(address, token) pairs known at once; past it the one that last succeeded longest ago is forgotten."""


def client_key(host: str | None) -> str:
    """The client a limit applies to: its IPv4 address, or its IPv6 /64 (a host usually holds the whole /64)."""
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return host or "unknown"
    if address.version == 6:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address)


class LoginLockout:
    """Each client's failed token checks within the last `window_s`; `max_failures` of them lock it out.

    Asked from the login route (the event loop's thread) and from the API's dependencies (the threadpool's):
    a lock keeps each call whole.
    """

    def __init__(
        self,
        *,
        max_failures: int = MAX_FAILURES,
        window_s: float = WINDOW_S,
        max_clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self.clock = clock
        # client -> times of its failures within the window, oldest first; clients in order of their last failure
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        # (client, a token's digest) -> the time it last succeeded from there; in that order
        self._known: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._failures)

    def retry_after_s(self, client: str, *, credential: bytes | None = None) -> float:
        """Seconds until `client` may try again: 0 unless it has `max_failures` failures within the window,
        and 0 for a `credential` (a token's digest) that succeeded from `client` within KNOWN_S."""
        with self._lock:
            if credential is not None and self._is_known(client, credential):
                return 0.0
            times = self._recent(client)
            if len(times) < self.max_failures:
                return 0.0
            return times[0] + self.window_s - self.clock()

    def record_failure(self, client: str) -> None:
        with self._lock:
            times = self._recent(client)
            times.append(self.clock())
            self._failures.pop(client, None)
            self._failures[client] = times  # last: the most recent failure
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)

    def record_success(self, client: str, credential: bytes) -> None:
        """`credential` (a token's digest) was valid from `client`: a lockout there will not refuse it."""
        with self._lock:
            self._known.pop((client, credential), None)
            self._known[(client, credential)] = self.clock()
            while len(self._known) > MAX_KNOWN:
                self._known.popitem(last=False)

    def _is_known(self, client: str, credential: bytes) -> bool:
        at = self._known.get((client, credential))
        return at is not None and self.clock() - at < KNOWN_S

    def _recent(self, client: str) -> deque[float]:
        """`client`'s failures within the window; a client with none left is forgotten."""
        times = self._failures.get(client, deque(maxlen=self.max_failures))
        horizon = self.clock() - self.window_s
        while times and times[0] <= horizon:
            times.popleft()
        if not times:
            self._failures.pop(client, None)
        return times

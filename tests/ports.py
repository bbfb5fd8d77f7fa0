"""Loopback ports for the servers the tests start."""

from __future__ import annotations

import random
import socket

_LOWEST = 20_000  # above Ray's worker ports (10002-19999) and its fixed ones (6379, 8265, 10001)


def _ephemeral_range() -> tuple[int, int]:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = map(int, f.read().split())
    except (OSError, ValueError):
        low, high = 32_768, 60_999  # Linux's default
    return low, high


def free_port() -> int:
    """A loopback port that is free now and outside the kernel's ephemeral range.

    bind(0) hands out a port inside that range, where any outgoing connection, or Ray's own
    bind(0) while a service starts its embedded cluster, can take it before the server binds
    it (seen in CI: a restarted `zero1 serve` failed with "address already in use")."""
    low, high = _ephemeral_range()
    candidates = [port for port in range(_LOWEST, 65_536) if not low <= port <= high]
    rng = random.Random()  # not the global one, which a test may have seeded
    for _ in range(200):
        port = rng.choice(candidates)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {_LOWEST}-65535 outside the ephemeral range {low}-{high}")

"""Waiting for a condition another process makes true: poll with a deadline, never a bare sleep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_for(read: Callable[[], T], predicate: Callable[[T], bool], *, what: str, timeout_s: float = 180,
             interval_s: float = 0.05) -> T:  # fmt: skip
    """Poll read() until predicate holds; fail naming `what` and the last value at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = read()
        if predicate(value):
            return value
        assert time.monotonic() < deadline, f"waited {timeout_s:g} s for {what}; last: {value}"
        time.sleep(interval_s)

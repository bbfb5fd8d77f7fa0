"""The loop of a background sender (the MLflow exporter, the webhook): a pass, then the next at once
while work is left, else after `interval_s`; a pass that finds the receiver unreachable waits,
doubling from `interval_s` to `max_backoff_s`, and tries again."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable


class Unreachable(Exception):
    """The receiver did not answer: the pass stops, and the sender backs off."""


def run_until_stopped(
    stop: threading.Event,
    run_once: Callable[[], bool],
    *,
    interval_s: float,
    max_backoff_s: float,
    log: logging.Logger,
    what: str,
    said: Callable[[BaseException], str] = str,
) -> None:
    """Call run_once (whether work is left) until `stop` is set, backing off while it raises Unreachable;
    any other exception (the database, most likely: the scheduler's problem too) is logged and the
    next pass comes after interval_s."""
    delay = 0.0
    backoff_s = interval_s
    while not stop.wait(delay):
        try:
            more = run_once()
        except Unreachable as error:
            log.warning("%s: %s; trying again in %.3g s", what, said(error), backoff_s)
            delay = backoff_s
            backoff_s = min(2 * backoff_s, max_backoff_s)
            continue
        except Exception:
            log.exception("%s: the pass failed", what)
            more = False
        backoff_s = interval_s
        delay = 0.0 if more else interval_s

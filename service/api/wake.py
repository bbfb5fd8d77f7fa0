"""Waking the scheduler when a request may have changed a job."""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

READS = frozenset({"GET", "HEAD", "OPTIONS"})


class WakeScheduler:
    """ASGI middleware: once a request that may change a job has been answered (any method but a
    read's), the scheduler ticks at once rather than at the end of its idle wait
    (ZERO1_SCHEDULER_IDLE_INTERVAL_S): a job submitted to an idle service starts as soon as it
    would to a busy one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        finally:
            if scope["type"] == "http" and scope["method"] not in READS:
                runtime = getattr(scope["app"].state, "runtime", None)  # None until the app has started
                if runtime is not None:
                    runtime.scheduler.wake()

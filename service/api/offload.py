"""How routes wait without holding a request thread.

FastAPI runs sync routes and dependencies in anyio's pool of 40 threads, which every request
shares, /healthz included. A route that waits for minutes (a trace, a dataset's tokenizing) is
async and awaits its Ray task (service/planning/tasks.py); what it must still do in a thread is done here:
reading users' files (a model directory hashed, a dataset's globs) in a small pool of its own,
however many requests do it, and the short database reads in a session of their own, closed
before any task starts, so that no connection is held while a task runs.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from starlette.concurrency import run_in_threadpool

from service.app_state import AppState
from service.auth import Principal
from service.store.code.uploads import require_bundle

T = TypeVar("T")
FILE_THREADS = 4
"""Threads that read users' files for requests: a first plan of a 14 GB model hashes it (tens of
seconds), and more such requests queue here, not in the request threads."""
_FILES = ThreadPoolExecutor(max_workers=FILE_THREADS, thread_name_prefix="zero1-files")


async def in_file_thread(fn: Callable[..., T], /, *args, **kwargs) -> T:
    """fn(*args, **kwargs) in the pool that reads users' files."""
    return await asyncio.get_running_loop().run_in_executor(_FILES, functools.partial(fn, *args, **kwargs))


async def require_code(runtime: AppState, digest: str, *, principal: Principal) -> None:
    """service.store.code.uploads.require_bundle (422 unknown, 403 someone else's) in a session of its own."""

    def check() -> None:
        with runtime.db.session() as session:
            require_bundle(session, digest, principal=principal, store=runtime.code)

    await run_in_threadpool(check)

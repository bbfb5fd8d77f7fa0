"""The child's end of its socket to the parent (workers/runtime/sandbox.py holds the other end):
pickled messages in, JSON out, and an exception put the way the parent receives it. Shared by the
child's two modes (workers/runtime/child.py's `call`, workers/runtime/rank_child.py's `rank`)."""

from __future__ import annotations

import json
import pickle
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from workers.records import DivergenceError


class ParentLink:
    """The child's end of the socket: pickled messages in, JSON out, one writer at a time."""

    def __init__(self, fd: int) -> None:
        self.conn = Connection(fd)
        self._lock = threading.Lock()

    def receive(self) -> Any:
        return pickle.loads(self.conn.recv_bytes())

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message).encode()
        with self._lock:
            self.conn.send_bytes(data)


def error_of(exc: BaseException) -> dict[str, Any]:
    """An exception as the parent receives it: type, first line, the request field it names, the
    last lines of its traceback, and a DivergenceError's record."""
    lines = str(exc).strip().splitlines()
    reason = getattr(exc, "reason", None)
    return {
        "divergence": exc.divergence.to_json() if isinstance(exc, DivergenceError) else None,
        "exception": type(exc).__name__,
        "message": (reason if isinstance(reason, str) else lines[0] if lines else type(exc).__name__)[:2000],
        "field": getattr(exc, "field", None) if isinstance(getattr(exc, "field", None), str) else None,
        "value_error": isinstance(exc, ValueError),
        "traceback": [line.rstrip()[:500] for line in traceback.format_exception(exc)][-12:],
    }

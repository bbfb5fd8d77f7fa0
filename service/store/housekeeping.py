"""The service's periodic storage work, on a thread of its own: finished jobs' log lines deleted past
ZERO1_LOG_RETENTION_DAYS (in batches, a commit each), and the dataset token cache trimmed to
ZERO1_TOKEN_CACHE_MAX_BYTES (service.store.token_cache), also right after a submit's check used an entry.

Separate from the scheduler: a slow delete never delays a job's start or its metrics.
"""

from __future__ import annotations

import logging
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

from sqlalchemy import func, select

from service.settings import Settings
from service.store import token_cache
from service.store.db import Database
from service.store.log_lines import expire_logs
from service.store.tables import Job

log = logging.getLogger(__name__)

ROWS_PER_BATCH = 5000
"""Log rows one transaction deletes: a batch keeps SQLite's write lock short."""
JOBS_PER_BATCH = 100
_PENDING = ("queued", "starting", "running", "restarting")


class Housekeeper:
    def __init__(self, *, db: Database, settings: Settings, cache_dir: Path) -> None:
        self.db = db
        self.settings = settings
        self.tokens_dir = token_cache.tokens_dir(cache_dir)
        self._lock = threading.Lock()  # one trim at a time: the thread's and a submit's
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="zero1-housekeeping", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.housekeeping_interval_s):
            self.run_once()

    def run_once(self) -> None:
        """Expire logs, then trim the token cache; each logged, not raised, when it fails."""
        try:
            self.expire_logs()
        except Exception:
            log.exception("housekeeping: could not delete expired log lines")
        try:
            self.trim_token_cache()
        except Exception:
            log.exception("housekeeping: could not trim the token cache")

    def expire_logs(self, *, now: datetime | None = None) -> int:
        """Delete the log lines of jobs that ended more than ZERO1_LOG_RETENTION_DAYS ago (0: none);
        the rows deleted."""
        days = self.settings.log_retention_days
        if days == 0:
            return 0
        before = (now or datetime.now(UTC)) - timedelta(days=days)
        total = 0
        while not self._stop.is_set():
            with self.db.session() as session:
                jobs, rows = expire_logs(
                    session, finished_before=before, max_jobs=JOBS_PER_BATCH, max_rows=ROWS_PER_BATCH
                )
            total += rows
            if jobs == 0 and rows < ROWS_PER_BATCH:  # the last batch emptied nothing and was not full
                break
        if total:
            log.info("housekeeping: deleted %d log lines of jobs that ended before %s", total, before.isoformat())
        return total

    def token_file_used(self, token_file: str | None) -> None:
        """A submit's check used this entry: mark it used and trim the cache, keeping it."""
        if token_file is None:
            return
        token_cache.mark_used(token_file)
        try:
            self.trim_token_cache(keep=frozenset({Path(token_file).stem}))
        except Exception:  # a submit never fails on the cache's bound
            log.exception("token cache: could not trim it")

    def trim_token_cache(self, *, keep: frozenset[str] = frozenset()) -> list[str]:
        """Trim to ZERO1_TOKEN_CACHE_MAX_BYTES, keeping what queued and active jobs may need; the keys deleted."""
        with self.db.session() as session:
            oldest = session.scalar(select(func.min(Job.created_at)).where(Job.status.in_(_PENDING)))
        since = (oldest or datetime.now(UTC)).timestamp() - token_cache.KEEP_MARGIN_S
        with self._lock:
            removed = token_cache.trim(
                self.tokens_dir, max_bytes=self.settings.token_cache_max_bytes, keep_since=since, keep=keep
            )
        if removed:
            log.info("token cache: deleted %d least recently used entries: %s", len(removed), ", ".join(removed))
        return removed

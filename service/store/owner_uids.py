"""Each owner's uid (ZERO1_RUN_AS): a named owner's entry, else a uid of its own from the `*=LO-HI`
range, taken on its first use and kept in owner_uids, so that it is the same after a restart and no
other owner ever gets it.

Two services (or two threads) that take a uid at once are kept apart by the table's keys: the owner
is the primary key and the uid unique, so the later insert fails and is tried again with what the
earlier one wrote.
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from service.errors import ServiceError
from service.run_as import RunAsTable
from service.store.db import Database
from service.store.tables import OwnerUid
from workers.records import RunAs

log = logging.getLogger(__name__)

MAX_TRIES = 20
"""Inserts that lose a race before the allocation gives up (each loss means another owner got a uid)."""


class UidRangeFull(ServiceError):
    """Every uid of the range is some other owner's: the owner's work cannot run (503, the job failed)."""

    def __init__(self, table: RunAsTable, owner: str) -> None:
        super().__init__(
            f"ZERO1_RUN_AS: every uid of {table.star} ({len(table.pool)}) is another owner's, none is left for "
            f"{repr(owner) if owner else 'the anonymous owner'}: widen the range (the owners given one keep it)",
            status_code=503,
            error="uid_range_full",
        )


class OwnerUids:
    """owner -> the RunAs its children run under; None where ZERO1_RUN_AS is unset. Called where
    a child is started for an owner (a rank's launch, a trace, a dataset check)."""

    def __init__(self, db: Database, *, table: RunAsTable | None) -> None:
        self.db = db
        self.table = table
        self._known: dict[str, RunAs] = {}
        """Owners already given a uid by this process: a uid, once taken, is never given back."""
        self._lock = threading.Lock()

    def __call__(self, owner: str | None) -> RunAs | None:
        if self.table is None:
            return None
        key = owner or ""  # auth off: every job is the one anonymous owner's
        if (named := self.table.named.get(key)) is not None:
            return named
        with self._lock:
            if key not in self._known:
                uid = self._allocate(key)
                self._known[key] = RunAs(uid, uid)
            return self._known[key]

    def _allocate(self, owner: str) -> int:
        assert self.table is not None
        for _ in range(MAX_TRIES):
            try:
                with self.db.session() as session:
                    return self._take(session, owner)
            except IntegrityError:  # another process took that uid (or gave this owner one) first: read again
                continue
        raise RuntimeError(f"ZERO1_RUN_AS: no uid taken for {owner!r} after {MAX_TRIES} tries that lost a race")

    def _take(self, session: Session, owner: str) -> int:
        """The owner's uid in the range: the one it has, else the first free one, recorded."""
        assert self.table is not None
        pool = self.table.pool
        row = session.get(OwnerUid, owner)
        if row is not None and row.uid in pool:
            return row.uid
        taken = set(session.scalars(select(OwnerUid.uid).where(OwnerUid.uid.between(pool.start, pool.stop - 1))))
        top = max(taken, default=pool.start - 1)
        free = top + 1 if top + 1 in pool else next((uid for uid in pool if uid not in taken), None)
        if free is None:
            raise UidRangeFull(self.table, owner)
        if row is None:
            session.add(OwnerUid(owner=owner, uid=free))
        else:  # the range was changed and no longer holds its uid: its older jobs' files stay the old uid's
            log.warning(
                "ZERO1_RUN_AS: %r had uid %d, outside %s: it now runs as %d", owner, row.uid, self.table.star, free
            )
            row.uid = free
        session.flush()
        return free

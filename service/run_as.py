"""ZERO1_RUN_AS read: the uid:gid of each owner it names, and the range of uids from which every other
owner gets one of its own (service/store/owner_uids.py allocates them once and keeps them).

One uid per owner, as Determined links each user to a uid: two owners under one uid read each other's
job directories, checkpoints and final weights, so a uid named for two owners, a range holding a named
uid, and the old `*=uid:gid` (every unmapped owner under that one uid) are refused at start.

May import: workers.records.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from workers.records import RunAs

MAX_UID = 2**31 - 1
"""The highest uid a range may hold: the owner_uids column is a 32-bit signed integer."""
_IDS = re.compile(r"(\d+):(\d+)")
_RANGE = re.compile(r"(\d+)-(\d+)")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunAsTable:
    """ZERO1_RUN_AS parsed."""

    named: Mapping[str, RunAs]
    """The owners it names, each with its uid and gid."""
    first_uid: int
    last_uid: int
    """The `*=LO-HI` range (both included): every other owner gets a uid of its own from it, and the gid
    of the same number."""

    @property
    def pool(self) -> range:
        return range(self.first_uid, self.last_uid + 1)

    @property
    def star(self) -> str:
        """The range as ZERO1_RUN_AS writes it, for messages: `*=30000-39999`."""
        return f"*={self.first_uid}-{self.last_uid}"

    def checked_at_start(self) -> list[RunAs]:
        """The identities the service tries a child under before it starts: every named one and the
        range's first uid (each uid of the range reaches the same files: none is named anywhere)."""
        first = RunAs(self.first_uid, self.first_uid)
        return sorted({*self.named.values(), first}, key=lambda r: (r.uid, r.gid))


def parse_run_as(text: str) -> RunAsTable | None:
    """'a=2001:2001,*=30000-39999' -> its table; None for an empty one. ValueError naming the entry
    (or the two owners) for anything that would put two owners under one uid or a child under root."""
    named: dict[str, RunAs] = {}
    pool: range | None = None
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        owner, _, ids = (side.strip() for side in entry.partition("="))
        if owner in named or (owner == "*" and pool is not None):
            raise ValueError(f"ZERO1_RUN_AS: owner {owner!r} is named twice (entry {entry!r})")
        if owner == "*":
            pool = _range_of(entry, ids)
        else:
            named[owner] = _ids_of(entry, owner, ids)
    if not named and pool is None:
        return None
    if pool is None:
        raise ValueError(
            "ZERO1_RUN_AS needs a '*=LO-HI' entry: the range of uids from which every owner it does not name "
            "gets one of its own (e.g. *=30000-39999)"
        )
    _check_one_uid_per_owner(named, pool)
    return RunAsTable(named=named, first_uid=pool.start, last_uid=pool.stop - 1)


def _ids_of(entry: str, owner: str, ids: str) -> RunAs:
    match = _IDS.fullmatch(ids)
    if not owner or match is None:
        raise ValueError(f"ZERO1_RUN_AS: entry {entry!r} is not owner=uid:gid (e.g. team-a=2001:2001)")
    uid = int(match.group(1))
    gid = int(match.group(2))
    if uid == 0 or gid == 0:
        raise ValueError(f"ZERO1_RUN_AS: entry {entry!r} maps to root (uid or gid 0): that isolates nothing")
    if uid > MAX_UID or gid > MAX_UID:
        raise ValueError(f"ZERO1_RUN_AS: entry {entry!r}: a uid or gid above {MAX_UID}")
    return RunAs(uid, gid)


def _range_of(entry: str, ids: str) -> range:
    if _IDS.fullmatch(ids):
        raise ValueError(
            f"ZERO1_RUN_AS: entry {entry!r} runs every owner it does not name as one uid, so each reads the "
            "others' job directories, checkpoints and final weights: give '*' a range instead, from which "
            "each owner gets a uid of its own, kept (e.g. *=30000-39999)"
        )
    match = _RANGE.fullmatch(ids)
    if match is None:
        raise ValueError(f"ZERO1_RUN_AS: entry {entry!r} is not *=LO-HI, a range of uids (e.g. *=30000-39999)")
    low = int(match.group(1))
    high = int(match.group(2))
    if low == 0:
        raise ValueError(f"ZERO1_RUN_AS: the range {entry!r} holds uid 0, root: that isolates nothing")
    if low > high or high > MAX_UID:
        raise ValueError(f"ZERO1_RUN_AS: the range {entry!r} is not LO-HI with 1 <= LO <= HI <= {MAX_UID}")
    return range(low, high + 1)


def _check_one_uid_per_owner(named: Mapping[str, RunAs], pool: range) -> None:
    """No uid for two named owners; no named uid or gid inside the range (an owner given uid N from
    it runs with gid N too)."""
    owners_of: dict[int, list[str]] = {}
    for owner, ids in named.items():
        owners_of.setdefault(ids.uid, []).append(owner)
        if ids.uid in pool or ids.gid in pool:
            number, what = (ids.uid, "uid") if ids.uid in pool else (ids.gid, "gid")
            raise ValueError(
                f"ZERO1_RUN_AS: the range *={pool.start}-{pool.stop - 1} holds {what} {number}, {owner}'s: "
                "the range's uids go to the owners it does not name, one each"
            )
    for uid, owners in owners_of.items():
        if len(owners) > 1:
            raise ValueError(
                f"ZERO1_RUN_AS: uid {uid} is named for {len(owners)} owners ({', '.join(owners)}): each would "
                "read the others' files; give each owner a uid of its own"
            )

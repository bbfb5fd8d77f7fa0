"""Freeing a placement group without losing its resources to Ray.

Ray (2.60) reserves a group in two phases: it prepares the bundles' resources on each node, then
commits them. A group removed between the two is gone from the GCS, yet the nodes keep what they
prepared: no group, no lease, and the GPUs never come back (seen in CI: a group removed 3 ms after
its prepare left a 2-node cluster with 0 of 4 GPUs until it restarted). So a group still being
placed for the first time is given a moment to finish; one Ray cannot place soon (not enough
free) is removed after SETTLE_S.
"""

from __future__ import annotations

from typing import Any

from ray.util import placement_group_table
from ray.util.placement_group import remove_placement_group

SETTLE_S = 2.0
"""How long a removal waits for a group being placed: a prepare and its commit take milliseconds."""


def remove_group(group: Any, *, state: str | None = None) -> None:
    """Remove `group` (a PlacementGroup); one still PENDING (its first placement) once it is placed
    or SETTLE_S has passed. `state`: its state in ray.util.placement_group_table(), where the
    caller has it. Any other state is removed at once: a RESCHEDULING group (bundles lost with a
    node) kept for SETTLE_S failed the retry of tests/test_faults.py's removed-node tests."""
    if state is None:
        state = placement_group_table(group).get("state")
    if state == "PENDING":
        group.wait(timeout_seconds=SETTLE_S)  # the GCS answers: no task, no worker
    remove_placement_group(group)

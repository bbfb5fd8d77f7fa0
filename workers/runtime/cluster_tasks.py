"""What the control plane does to the cluster itself, beside its jobs: Ray tasks that learn what a
node has, and freeing a placement group without losing its resources.

Probes are Ray tasks sent to the nodes: a GPU's memory, a checkpoint directory's writability.

Freeing a group: Ray (2.60) reserves a group in two phases: it prepares the bundles' resources on
each node, then commits them. A group removed between the two is gone from the GCS, yet the nodes keep what they
prepared: no group, no lease, and the GPUs never come back (seen in CI: a group removed 3 ms after
its prepare left a 2-node cluster with 0 of 4 GPUs until it restarted). So a group still being
placed for the first time is given a moment to finish; one Ray cannot place soon (not enough
free) is removed after SETTLE_S.
"""

from __future__ import annotations

from typing import Any

import ray
from ray.util import placement_group_table
from ray.util.placement_group import remove_placement_group


@ray.remote(num_gpus=0.01, num_cpus=0)
def probe_gpu_memory_bytes() -> int | None:
    """Total memory of the GPU this task lands on; None where the GPUs are logical (no CUDA)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


@ray.remote(num_cpus=0)
def probe_writable(uri: str) -> str | None:
    """None when this node can create, write and delete a file under `uri` (a directory, or an
    object store's prefix with this node's credentials); else why not."""
    import os
    import tempfile
    import uuid

    from workers.training.storage import DirectoryStore, open_store

    store = open_store(uri)
    try:
        if isinstance(store, DirectoryStore):
            os.makedirs(store.root, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=store.root, prefix=".zero1-probe-"):
                pass
        else:
            name = f".zero1-probe-{uuid.uuid4().hex}"
            store.write(name, b"")
            store.remove(name)
    except OSError as exc:
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    except Exception as exc:  # noqa: BLE001 - an object store's client raises its own errors (no credentials, …)
        return f"{type(exc).__name__}: {exc}"[:500]
    return None


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

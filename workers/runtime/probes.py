"""Ray tasks the control plane sends to the cluster's nodes to learn what they have: a GPU's
memory, a checkpoint directory's writability."""

from __future__ import annotations

import ray


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

"""One rank's training, in the child a rank's actor starts (workers/runtime/ranks.py is the parent's side).

The conversation, parent -> child pickled, child -> parent JSON:

    parent: {"rank", "world_size", "address"}        as the actor starts
    child:  {"t": "store", "port"}                   rank 0: the rendezvous store it opened
    parent: {"config", "address", "port", "pg_timeout_s", "log_max_bytes"}   run()
    child:  {"t": "logs", "lines"} | {"t": "row", "row"}                           while training
    child:  {"t": "stop?", "step", "checkpointed"}   rank 0, after each step but the last (loop.train's stop_at)
    parent: {"stop": bool}                           the answer; rank 0 broadcasts it to the others
    child:  {"t": "result", "result"} | {"t": "error", "error"}                    the end

The child imports torch and the training loop as soon as it starts, while the job's other ranks
are being placed; it opens rank 0's store itself, so the actor (trusted, connected to Ray) never
loads torch.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from workers.runtime.capture import OutputCapture
from workers.runtime.link import ParentLink, error_of
from workers.runtime.rendezvous import join_process_group, open_rendezvous_store, parent_gone


def run_rank(link: ParentLink) -> None:
    hello = link.receive()
    rank, world_size = hello["rank"], hello["world_size"]
    import torch

    import workers.training.loop  # noqa: F401 - loaded while the other ranks start, not after the rendezvous

    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    store = None
    if rank == 0:
        store = open_rendezvous_store(hello["address"], world_size=world_size)
        link.send({"t": "store", "port": store.port})
    start = link.receive()
    capture = OutputCapture(
        rank=rank,
        send=lambda lines: link.send({"t": "logs", "lines": [dataclasses.asdict(line) for line in lines]}),
        delivered=lambda handle, timeout_s: True,  # a send returns once the socket has the batch
        max_bytes=start["log_max_bytes"],
    )
    with capture:
        try:
            outcome = {"t": "result", "result": dataclasses.asdict(_train(link, start, rank, world_size, store))}
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent, after its traceback
            capture.print_exception(exc)
            outcome = {"t": "error", "error": error_of(exc)}
    link.send(outcome)  # after the capture has sent every line: the parent has them before the end


def _train(link: ParentLink, start: dict[str, Any], rank: int, world_size: int, store: Any) -> Any:
    import torch.distributed as dist

    from workers.training.loop import train

    join_process_group(
        rank=rank,
        world_size=world_size,
        address=start["address"],
        port=start["port"],
        store=store,
        timeout_s=start["pg_timeout_s"],
    )

    def stop_at(step: int, checkpointed: bool) -> bool:
        link.send({"t": "stop?", "step": step, "checkpointed": checkpointed})
        return bool(link.receive()["stop"])

    try:
        result = train(
            start["config"],
            rank=rank,
            world_size=world_size,
            on_metrics=lambda row: link.send({"t": "row", "row": row.to_json()}),
            should_stop=parent_gone(),
            stop_at=stop_at,
        )
        if result.cancelled:  # the actor is gone: no one to report to, no peer to wait for
            os._exit(1)
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears its pairs down first
        return result
    finally:
        dist.destroy_process_group()

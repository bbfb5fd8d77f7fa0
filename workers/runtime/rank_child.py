"""One rank's training, in the child a rank's actor starts (workers/runtime/rank_parent.py is the parent's side).

The conversation, parent -> child pickled, child -> parent JSON:

    parent: {"rank", "world_size", "address"}        as the actor starts
    child:  {"t": "store", "port"}                   rank 0: the rendezvous store it opened
    parent: {"config", "address", "port", "pg_timeout_s", "log_max_bytes"}   run()
    child:  {"t": "logs", "lines"} | {"t": "row", "row"}                           while training
    child:  {"t": "at", "step", "phase"}             where it is (workers/phases.py), when that changed
    child:  {"t": "stop?", "step", "checkpointed"}   rank 0, after each step but the last (loop.train's stop_at)
    parent: {"stop": bool}                           the answer; rank 0 broadcasts it to the others
    child:  {"t": "latest"} | {"t": "fetch", ...} | {"t": "saved", ...}    checkpoints on an object store:
    parent: {"latest": ...} | {"fetched": path} | {"error": why}           workers/runtime/spool.py
    child:  {"t": "result", "result"} | {"t": "error", "error"}                    the end

The child has torch and the training loop loaded when it starts (forked from the node's zygote,
workers/runtime/zygote.py), or imports them at once, while the job's other ranks are being placed
(a fresh interpreter); it opens rank 0's store itself, so the actor (trusted, connected to Ray)
never loads torch.

A thread of the child's tells its parent where the training thread is (workers/phases.py), at most
every PHASE_REPORT_S and only when that changed: the parent's watchdog names the phase a hung rank
sat in, and does not count time spent outside the steps against them (workers/runtime/rank_parent.py).
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from pathlib import Path
from typing import Any

from workers import phases
from workers.runtime.capture import OutputCapture
from workers.runtime.link import ParentLink, error_of
from workers.runtime.rendezvous import join_process_group, open_rendezvous_store, parent_gone

PHASE_REPORT_S = 0.25
"""How often the child looks at where its training thread is, and says so if that changed."""


def run_rank(link: ParentLink) -> None:
    hello = link.receive()
    rank = hello["rank"]
    world_size = hello["world_size"]
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
        echo=False,  # the parent reads this process's stdout and stderr too: a line once, not twice
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

    reporting = threading.Event()
    threading.Thread(target=_report_phases, args=(link, reporting), daemon=True, name="zero1-phases").start()
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

    config = start["config"]
    try:
        result = train(
            config,
            rank=rank,
            world_size=world_size,
            on_metrics=lambda row: link.send({"t": "row", "row": row.to_json()}),
            should_stop=parent_gone(),
            stop_at=stop_at,
            io=_spooled(link, Path(config.checkpoint_dir)) if start.get("spool") else None,
        )
        if result.cancelled:  # the actor is gone: no one to report to, no peer to wait for
            os._exit(1)
        phases.enter("barrier")
        dist.barrier()  # leave together: gloo aborts a rank whose peer tears its pairs down first
        return result
    finally:
        reporting.set()
        dist.destroy_process_group()


def _report_phases(link: ParentLink, done: threading.Event) -> None:
    """Tell the parent where the training thread is, when that changed, until `done`."""
    said = None
    while not done.wait(PHASE_REPORT_S):
        at = phases.current()
        if at != said:
            link.send({"t": "at", "step": at[0], "phase": at[1]})
            said = at


def _spooled(link: ParentLink, spool: Path) -> Any:
    """The checkpoint storage as this child reaches it when it is an object store: through its
    parent, which holds the credentials (workers/runtime/spool.py). Asked only by the training
    thread (reads, before the first step); saves are announced by the writer's thread, and are
    stored once the parent has deleted them from the spool."""
    from workers.training.writer import CheckpointIO

    def ask(message: dict[str, Any]) -> dict[str, Any]:
        link.send(message)
        answer = link.receive()
        if "error" in answer:
            raise OSError(f"the checkpoint storage: {answer['error']}")
        return answer

    def latest() -> tuple[int, int] | None:
        found = ask({"t": "latest"})["latest"]
        return None if found is None else (int(found[0]), int(found[1]))

    def fetch(name: str, ranges: list[tuple[int, int]]) -> Path:
        return Path(ask({"t": "fetch", "name": name, "ranges": [[int(a), int(b)] for a, b in ranges]})["fetched"])

    def publish(step: int, files: list[Path]) -> None:
        link.send({"t": "saved", "step": step, "names": [str(path.relative_to(spool)) for path in files]})
        while any(path.exists() for path in files):  # the parent deletes each once it is stored
            time.sleep(0.02)

    return CheckpointIO(latest=latest, fetch=fetch, publish=publish)

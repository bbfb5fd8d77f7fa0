"""The child's side of workers/runtime/sandbox.py: `python -m workers.runtime.child MODE CONN_FD LIFELINE_FD STAGING`.

It runs untrusted work and reports in JSON over its socket: `call` applies one function to one
pickled argument (a plan's trace, a submit's dataset check); `rank` trains as one rank of a job
(workers/runtime/rank_child.py). It holds no secret and never imports Ray. When the lifeline pipe breaks
(its parent is gone, however it went) it exits at once. SIGUSR1 (its parent's, through its keeper:
workers/containment.py) has faulthandler write the stacks of all its threads to its stderr, which its
parent reads: how a hung rank's stacks reach its log (workers/runtime/rank_parent.py).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import importlib
import os
import shutil
import signal
import sys
import threading

from workers.runtime.link import ParentLink, error_of


def _watch_lifeline(fd: int, staging: str | None) -> None:
    """Exit the moment the parent's end of the lifeline closes (the parent ended), removing the copy
    of the code bundle the parent made for this child (a parent killed cannot)."""

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        os._exit(70)

    threading.Thread(target=watch, daemon=True, name="zero1-lifeline").start()


def _call(link: ParentLink) -> None:
    function, argument = link.receive()
    module_name, _, name = function.partition(":")
    try:
        result = getattr(importlib.import_module(module_name), name)(argument)
        if dataclasses.is_dataclass(result):
            result = dataclasses.asdict(result)
        link.send({"result": result})
    except Exception as exc:  # noqa: BLE001 - every failure of the work is reported to the parent
        link.send({"error": error_of(exc)})


def main(argv: list[str]) -> None:
    mode = argv[0]
    conn_fd = int(argv[1])
    lifeline_fd = int(argv[2])
    staging = argv[3]
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # fd 2: the parent reads it
    _watch_lifeline(lifeline_fd, None if staging == "-" else staging)
    link = ParentLink(conn_fd)
    if mode == "call":
        _call(link)
    elif mode == "rank":
        from workers.runtime.rank_child import run_rank

        run_rank(link)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])

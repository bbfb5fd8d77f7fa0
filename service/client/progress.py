"""A job's progress bar, as `Job.wait(progress=True)` and `zero1 watch` draw it: a rich bar on a
terminal (service/client/output.py), else one line redrawn in place."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from .output import STATUS_STYLES

if TYPE_CHECKING:
    from rich.console import Console


def _fields(job: dict, *, eval_loss: float | None) -> dict[str, str]:
    """The figures of the line as text: the plain line and the rich bar share them."""
    latest = job.get("latest") or {}
    loss = latest.get("loss")
    speed = latest.get("tokens_per_s")
    return {
        "loss": "-" if loss is None else f"{loss:.4f}",
        "eval": "" if eval_loss is None else f"eval {eval_loss:.4f}",
        "tokens_per_s": "-" if speed is None else f"{speed:,.0f}",
        "status": job["status"],
    }


def progress_line(job: dict, *, eval_loss: float | None = None, width: int = 30) -> str:
    """The plain line; eval_loss: the latest held-out loss seen (rows carry it only on steps that evaluate)."""
    done = 0 if job["step"] is None else job["step"] + 1
    filled = width * done // job["steps"]
    fields = _fields(job, eval_loss=eval_loss)
    evaluated = f"{fields['eval']}  " if fields["eval"] else ""
    return (
        f"[{'#' * filled}{'.' * (width - filled)}] {done}/{job['steps']}  loss {fields['loss']}  "
        f"{evaluated}{fields['tokens_per_s']} tokens/s  {fields['status']}"
    )


@contextlib.contextmanager
def progress_display(console: Console | None) -> Iterator[Callable[[dict, float | None], None]]:
    """draw(job, eval_loss): the line redrawn in place (`\\r`) on stdout, or on a terminal (`console`)
    a rich bar of steps done with loss, eval loss, tokens/s and the status beside it."""
    if console is None:

        def draw(job: dict, eval_loss: float | None) -> None:
            print(f"\r{progress_line(job, eval_loss=eval_loss)}", end="", flush=True)

        yield draw
        print()
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    bar = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[losses]}"),
        TextColumn("{task.fields[tokens_per_s]} tokens/s"),
        TextColumn("[{task.fields[style]}]{task.fields[status]}"),
        console=console,
    )
    tasks = []  # the job's bar, added at the first draw

    def draw(job: dict, eval_loss: float | None) -> None:
        done = 0 if job["step"] is None else job["step"] + 1
        fields = _fields(job, eval_loss=eval_loss)
        losses = f"loss {fields['loss']}  {fields['eval']}".rstrip()
        fields |= {"losses": losses, "style": STATUS_STYLES.get(job["status"], "default")}
        if not tasks:
            tasks.append(bar.add_task(f"job {job['id']}", total=job["steps"], **fields))
        bar.update(tasks[0], completed=done, total=job["steps"], **fields)

    with bar:
        yield draw

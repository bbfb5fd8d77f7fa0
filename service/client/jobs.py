"""A submitted job, as the client sees it: `Job` (its API answer in `info`, refreshed on demand) and
`LogLine` (one line of its output)."""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from service.schemas.printable import escape
from service.schemas.responses import (
    ArtifactPublic,
    CheckpointFilePublic,
    CheckpointPublic,
    EventPublic,
    JobPublic,
    LogLinePublic,
    MetricPublic,
)

from .errors import raise_for
from .output import terminal
from .progress import progress_display
from .streams import follow_lines

TERMINAL = frozenset({"succeeded", "failed", "cancelled", "stopped_early"})
"""The statuses a job never leaves."""


class LogLine(LogLinePublic):
    """A line of a job's output (GET /v1/jobs/{id}/logs), printed as `[rank R] line` (`[zero1] line`
    for the service's own), its control characters escaped: a rank may print anything."""

    def __str__(self) -> str:
        prefix = "[zero1]" if self.rank is None else f"[rank {self.rank}]"
        return f"{prefix} {escape(self.line, keep=chr(9))}"


class Job:
    """A job of the service. `info` is its last answer (JobPublic), asked for when first read if the
    job was made from its id alone; `refresh()` asks again."""

    def __init__(self, client: Any, job: JobPublic | int) -> None:
        """`client`: the zero1.Client it talks through; `job`: its API answer, or its id alone."""
        self.client = client
        self._id, self._info = (job, None) if isinstance(job, int) else (job.id, job)
        self.ended: dict = {}
        """After a followed log (logs(follow=True)) ran to its end: the server's end event, {"status": ...}."""

    @property
    def info(self) -> JobPublic:
        if self._info is None:
            self.refresh()
        return self._info

    def __repr__(self) -> str:  # what it knows: a repr never asks the API
        if self._info is None:
            return f"Job(id={self.id})"
        return f"Job(id={self.id}, name={self._info.name!r}, status={self._info.status!r})"

    @property
    def id(self) -> int:
        return self._id

    @property
    def status(self) -> str:
        """As of the last refresh."""
        return self.info.status

    @property
    def done(self) -> bool:
        """It ended: succeeded, failed or cancelled (as of the last refresh)."""
        return self.status in TERMINAL

    def refresh(self) -> Job:
        self._info = JobPublic.model_validate(self._get(f"/v1/jobs/{self.id}"))
        return self

    def wait(self, timeout: float | None = None, progress: bool = False, *, interval: float = 0.5) -> Job:
        """Until the job ends (a TimeoutError after `timeout` seconds), redrawing a progress bar of its
        steps, loss, eval loss and tokens/s on stdout if `progress`. The job, refreshed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        display = progress_display(terminal()) if progress else contextlib.nullcontext(lambda job, eval_loss: None)
        with display as draw:
            seen_step = None
            evaluated = {"step": -1, "eval_loss": None}
            while True:
                self.refresh()
                if progress and self.info.step is not None and self.info.step != seen_step:
                    seen_step = self.info.step
                    evaluated = self._latest_eval(after=evaluated)
                draw(self.info.model_dump(mode="json"), evaluated["eval_loss"])
                if self.done:
                    return self
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {self.id} is still {self.status} after {timeout} s")
                time.sleep(interval if deadline is None else max(0.0, min(interval, deadline - time.monotonic())))

    def _latest_eval(self, *, after: dict) -> dict:
        """The newest row that evaluated since `after`, else `after`: rows carry eval_loss only on the
        steps that evaluate, which a poll may not land on. Another's job's metrics are not ours: `after`."""
        response = self.client.http.get(
            f"/v1/jobs/{self.id}/metrics", params={"evaluated": "true", "after_step": after["step"], "limit": 10_000}
        )
        rows = response.json()["data"] if response.is_success else []
        return rows[-1] if rows else after

    def metrics(self, frame: bool = False, *, evaluated: bool = False, checkpointed: bool = False) -> Any:
        """Every stored row, oldest first, a page at a time (MetricPublic), or with `frame` a pandas
        DataFrame of them (one column per field); only the rows that evaluated or checkpointed if asked."""
        rows = []
        after = -1
        while after is not None:
            params = {"after_step": after, "limit": 10_000}
            params |= {key: "true" for key, on in (("evaluated", evaluated), ("checkpointed", checkpointed)) if on}
            page = self._get(f"/v1/jobs/{self.id}/metrics", params=params)
            rows += [MetricPublic.model_validate(row) for row in page["data"]]
            after = page["next_after_step"]
        if not frame:
            return rows
        import pandas  # an optional dependency: the rows themselves need none

        return pandas.DataFrame([row.model_dump() for row in rows], columns=list(MetricPublic.model_fields))

    def events(self) -> list[EventPublic]:
        """Its status changes, oldest first, each with its reason."""
        return [EventPublic.model_validate(e) for e in self._get(f"/v1/jobs/{self.id}/events")["data"]]

    def logs(
        self,
        follow: bool = False,
        *,
        rank: int | None = None,
        attempt: int | None = None,
        note: Callable[[str], None] | None = None,
    ) -> Iterator[LogLine]:
        """Its output lines, oldest first (only one rank's or attempt's if asked); with `follow` each
        new one as it comes, until the job ends. A followed stream that breaks off (a service
        restarting) is opened again after the last line; `note` hears each wait (default: stderr)."""
        query = {key: value for key, value in (("rank", rank), ("attempt", attempt)) if value is not None}
        if follow:
            note = note or (lambda text: print(f"zero1: {text}", file=sys.stderr))
            self.ended = {}
            for row in follow_lines(self.client.http, self.id, query=query, note=note, end=self.ended):
                yield LogLine.model_validate(row)
            return
        after = 0
        while True:
            page = self._get(f"/v1/jobs/{self.id}/logs", params={**query, "after": after})
            if not page["data"]:
                return
            for row in page["data"]:
                yield LogLine.model_validate(row)
            after = page["next"]

    def cancel(self) -> Job:
        return self._update("post", "cancel")

    def suspend(self) -> Job:
        """A running job stops at its next step with a checkpoint; a queued one leaves the queue."""
        return self._update("post", "suspend")

    def resume(self) -> Job:
        """A suspended job goes back in the queue."""
        return self._update("post", "resume")

    def set_priority(self, priority: int) -> Job:
        """0-100, up to your ceiling: the queue runs the highest first."""
        return self._update("patch", "", json={"priority": priority})

    def set_tags(self, tags: list[str]) -> Job:
        """Its tags, all of them (the set replaced; [] clears it); at any time, as its notes."""
        return self._update("patch", "", json={"tags": list(tags)})

    def set_notes(self, notes: str) -> Job:
        """Its notes, replaced ("" clears them)."""
        return self._update("patch", "", json={"notes": notes})

    def artifacts(self) -> list[ArtifactPublic]:
        """The files of a succeeded job's final model, each with its size and sha256."""
        return [ArtifactPublic.model_validate(a) for a in self._get(f"/v1/jobs/{self.id}/artifacts")["data"]]

    def checkpoints(self) -> list[CheckpointPublic]:
        """The complete checkpoints the job's storage holds now, oldest first, each with its files."""
        return [CheckpointPublic.model_validate(c) for c in self._get(f"/v1/jobs/{self.id}/checkpoints")["data"]]

    def download(
        self,
        directory: str | Path,
        *,
        checkpoint: int | None = None,
        on_file: Callable[[Path, ArtifactPublic | CheckpointFilePublic], None] | None = None,
    ) -> list[Path]:
        """Every file of the final model into `directory` (created), or, with `checkpoint` (a step the
        listing gives), that checkpoint's shards and marker. Each is streamed to a temporary name and
        given its own only once its size (and a final file's sha256) matches the listing; a ValueError
        (the file removed) at the first that does not, or for a step not stored. The paths written;
        `on_file` hears each as it lands."""
        if checkpoint is None:
            entries: list[Any] = self.artifacts()
            prefix = f"/v1/jobs/{self.id}/artifacts"
        else:
            stored = {c.step: c.files for c in self.checkpoints()}
            if checkpoint not in stored:
                raise ValueError(f"job {self.id} stores no checkpoint at step {checkpoint} (stored: {sorted(stored)})")
            entries = stored[checkpoint]
            prefix = f"/v1/jobs/{self.id}/checkpoints/{checkpoint}"
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        written = []
        for entry in entries:
            name = Path(entry.name).name  # a file name, never a path out of the directory
            part = directory / f".{name}.part"
            digest = hashlib.sha256()
            size = 0
            with self.client.http.stream("GET", f"{prefix}/{name}") as response:
                raise_for(response)
                with open(part, "wb") as file:
                    for chunk in response.iter_bytes(1 << 20):
                        digest.update(chunk)
                        size += len(chunk)
                        file.write(chunk)
            expected = getattr(entry, "sha256", None)
            if size != entry.bytes or (expected is not None and digest.hexdigest() != expected):
                part.unlink()
                listed = f"{entry.bytes:,} bytes" + (f", sha256 {expected}" if expected else "")
                raise ValueError(
                    f"{escape(name)}: {'sha256' if size == entry.bytes else 'size'} mismatch "
                    f"({size:,} bytes, sha256 {digest.hexdigest()}; listed {listed})"
                )
            part.replace(directory / name)
            written.append(directory / name)
            if on_file is not None:
                on_file(directory / name, entry)
        return written

    def _update(self, method: str, action: str, **kwargs) -> Job:
        path = f"/v1/jobs/{self.id}" + (f"/{action}" if action else "")
        self._info = JobPublic.model_validate(raise_for(getattr(self.client.http, method)(path, **kwargs)).json())
        return self

    def _get(self, path: str, **kwargs) -> dict:
        return raise_for(self.client.http.get(path, **kwargs)).json()

"""The order in which xdist hands the suite's files to its workers: the longest first.

`make test` runs `pytest -n 2 --dist loadfile`: each file goes whole to one worker, the next file to
whichever worker is free. Left to itself xdist sends the files with the most tests first, and the
longest files (one Ray job after another, a handful of tests each) come last: one worker then trains
the last of them alone while the other has nothing left. Sent longest first (the longest-processing-
time rule), the files left at the end are the short ones. The Makefile passes --no-loadscope-reorder
so that xdist keeps the order set here.

The seconds of each file (setup, call and teardown of its tests, summed) are kept in
tests/durations.json, from a run of the whole suite with --store-durations (`make test-durations`).
Only the order depends on them: a file they do not name (a new one) sorts as the median file, and a
stale figure costs time, never a result.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).with_name("durations.json")


def file_of(nodeid: str) -> str:
    """The file part of a test's node id, relative to the repository: tests/test_x.py."""
    return nodeid.split("::", 1)[0]


def read_durations(path: Path = DURATIONS) -> dict[str, float]:
    try:
        return {str(name): float(seconds) for name, seconds in json.loads(path.read_text()).items()}
    except FileNotFoundError:
        return {}


def longest_first(items: list[pytest.Item], durations: dict[str, float]) -> list[pytest.Item]:
    """`items` with their files in descending order of duration (unknown files as the median), the
    tests of a file in their order; files of equal duration keep the order they were collected in."""
    by_file: dict[str, list[pytest.Item]] = defaultdict(list)
    for item in items:
        by_file[file_of(item.nodeid)].append(item)
    typical = statistics.median(durations.values()) if durations else 0.0
    files = sorted(by_file, key=lambda name: -durations.get(name, typical))  # sorted() is stable
    return [item for name in files for item in by_file[name]]


class StoreDurations:
    """Sums each file's reported durations (the controller sees every worker's reports) and writes them
    to tests/durations.json at the end of a run that passed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[file_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        if hasattr(session.config, "workerinput") or exitstatus != 0:
            return  # a worker's share, or a run whose figures are not the suite's
        ordered = dict(sorted(((name, round(s, 1)) for name, s in self.seconds.items()), key=lambda kv: -kv[1]))
        self.path.write_text(json.dumps(ordered, indent=1) + "\n")

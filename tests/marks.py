"""The suite's markers (pyproject.toml declares them), applied by what a test starts: `make test-fast`
runs the tests that start none of these, `make test` every test.

A fixture says what it starts with @starts(...) under its @pytest.fixture; a test that uses it,
itself or through another fixture, gets those markers. A test that starts something in its own body
(a `zero1 serve`, a Ray node) carries the marker itself (@pytest.mark.ray).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

import pytest

MARKERS = ("ray", "s3", "postgres", "browser", "slow", "ranks")
MARKED_BY_PARAM = {"postgresql": "postgres", "s3": "s3"}
"""A parametrized test whose parameters include the value (a backend, a store) gets the marker: a
fixture such a parameter asks for by name (request.getfixturevalue("s3_uri")) is not in its closure."""

RUNS_RANKS = "run_ranks"
"""A test whose own body calls tests/distributed.py's run_ranks (imported at the top or in the body) is
marked `ranks`: it forks a process per rank and trains them together, seconds of CPU on 2 cores."""

Function = TypeVar("Function", bound=Callable)


def starts(*markers: str) -> Callable[[Function], Function]:
    """Mark a fixture's function with what it starts (put under @pytest.fixture)."""
    unknown = set(markers) - set(MARKERS)
    assert not unknown, f"unknown markers {sorted(unknown)}: pyproject.toml declares {MARKERS}"

    def mark(function: Function) -> Function:
        function.zero1_starts = frozenset(markers)
        return function

    return mark


def marks_of(item: pytest.Item) -> set[str]:
    """The markers of what `item` starts: those of every fixture in its closure, and of its parameters."""
    found: set[str] = set()
    for definitions in item._fixtureinfo.name2fixturedefs.values():  # every fixture the test uses
        found |= getattr(definitions[-1].func, "zero1_starts", frozenset())
    params = getattr(getattr(item, "callspec", None), "params", {})
    values = {value for value in params.values() if isinstance(value, str)}
    found |= {marker for value, marker in MARKED_BY_PARAM.items() if value in values}
    function = getattr(item, "function", None)
    if function is not None and RUNS_RANKS in function.__code__.co_names:
        found.add("ranks")
    return found


def apply_marks(items: list[pytest.Item]) -> None:
    for item in items:
        for marker in sorted(marks_of(item)):
            item.add_marker(marker)


def ray_is_up() -> bool:
    """Whether this process is connected to a Ray cluster (without importing Ray where nothing has)."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def check_no_ray_started(item: pytest.Item, *, up_before: bool) -> None:
    """Fail a test that is not marked `ray` yet connected this process to Ray (a Ray task's first call
    starts a local cluster unasked): `make test-fast` must start none."""
    if not up_before and ray_is_up() and item.get_closest_marker("ray") is None:
        pytest.fail(f"{item.nodeid} started Ray but is not marked ray (tests/marks.py)", pytrace=False)

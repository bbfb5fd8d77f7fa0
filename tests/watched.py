"""A watch on int() in one module's namespace, for the tests that show a number typed as text is
refused by its digits before int() expands it: int() of Decimal("1e1000000") takes time quadratic in
its million digits, holding the GIL. What such a test asserts is that no int() of the number was
called, not how long the refusal took."""

from __future__ import annotations

import builtins
from decimal import Decimal

import pytest

EXPANSION_DIGITS = 1000
"""Digits past which the watch refuses to convert: a bug that expands a huge number fails at the call."""


class IntWatch:
    """Stands in for a module's int(): records every Decimal it is given and converts it as int() does,
    or raises AssertionError for one of more than EXPANSION_DIGITS digits, so that the test fails at
    the call instead of waiting out the expansion."""

    def __init__(self) -> None:
        self.decimals: list[Decimal] = []

    def __call__(self, value: object = 0, *args: object) -> int:
        if isinstance(value, Decimal):
            self.decimals.append(value)
            if value.is_finite() and value.adjusted() >= EXPANSION_DIGITS:
                raise AssertionError(f"int() was asked to expand {value}")
        return builtins.int(value, *args)


def watch_int(monkeypatch: pytest.MonkeyPatch, module: str) -> IntWatch:
    """An IntWatch as `module`'s int (a module global comes before the builtin)."""
    watch = IntWatch()
    monkeypatch.setattr(f"{module}.int", watch, raising=False)
    return watch

"""Figures the fault, fuzz and load tests measure, printed at the end of a run (docs/guarantees.md)."""

from __future__ import annotations

FIGURES: list[tuple[str, dict[str, int]]] = []


def record(test: str, **figures: int) -> None:
    """Keep one test's measured figures for the summary that `pytest` prints at the end."""
    FIGURES.append((test, figures))


def summary_lines() -> list[str]:
    """One line per test and a total per figure."""
    totals: dict[str, int] = {}
    lines = []
    for test, figures in FIGURES:
        lines.append(f"{test}: " + ", ".join(f"{k} {v:,}" for k, v in figures.items()))
        for key, value in figures.items():
            totals[key] = totals.get(key, 0) + value
    lines.append("total: " + ", ".join(f"{k} {v:,}" for k, v in totals.items()))
    return lines

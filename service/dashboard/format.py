"""How the pages write numbers: bytes, durations, losses, rates (dashboard.js writes them the same way)."""

from __future__ import annotations

from datetime import UTC, datetime

_UNITS = ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"))


def human_bytes(num_bytes: int | None) -> str:
    """31406250000 -> '31.41 GB' (decimal units, as the planner's GB = 1e9 bytes)."""
    if num_bytes is None:
        return "—"
    for scale, unit in _UNITS:
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def short_bytes(num_bytes: int) -> str:
    """129600000000 -> '130 GB': three significant digits, for an axis label."""
    for scale, unit in _UNITS:
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes} B"


def byte_unit(num_bytes: int) -> tuple[int, str]:
    """The largest decimal unit that num_bytes reaches: 129600000000 -> (10**9, 'GB')."""
    return next(((scale, unit) for scale, unit in _UNITS if abs(num_bytes) >= scale), (1, "B"))


def bar_label(num_bytes: int, *, scale: int) -> str:
    """A sweep bar's value in the chart's unit, at most 5 characters so that neighbours never touch:
    3 significant digits from 1 up, 2 decimals below, '<0.01' below that."""
    value = num_bytes / scale
    if value >= 1:
        return f"{value:.3g}"
    return f"{value:.2f}" if value >= 0.01 else "<0.01"


def grouped(number: int | None) -> str:
    """31406250000 -> '31,406,250,000'."""
    return "—" if number is None else f"{number:,}"


def duration(seconds: float | None) -> str:
    """3723 -> '1h 02m 03s'; 125 -> '2m 05s'; 7 -> '7s'."""
    if seconds is None:
        return "—"
    seconds = max(0, int(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h {minutes:02d}m {secs:02d}s"
    return f"{minutes}m {secs:02d}s" if minutes else f"{secs}s"


def elapsed_s(
    started_at: datetime | None, finished_at: datetime | None, *, now: datetime | None = None
) -> float | None:
    """Seconds since the job started, up to when it finished; None if it never started."""
    if started_at is None:
        return None
    return ((finished_at or now or datetime.now(UTC)) - started_at).total_seconds()


def significant(value: float | None, digits: int = 4) -> str:
    """A loss or a step time to `digits` significant digits."""
    return "—" if value is None else f"{value:.{digits}g}"


def rate(value: float | None) -> str:
    """Tokens per second, whole and grouped."""
    return "—" if value is None else f"{value:,.0f}"


def clock(moment: datetime | None) -> str:
    """An instant as UTC wall-clock time, to the second."""
    return "—" if moment is None else moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def time_of_day(moment: datetime) -> str:
    """An instant's UTC time of day, to the second: a log line's, whose day the page's events give."""
    return moment.astimezone(UTC).strftime("%H:%M:%S")


FILTERS = {
    "human_bytes": human_bytes,
    "short_bytes": short_bytes,
    "grouped": grouped,
    "duration": duration,
    "significant": significant,
    "rate": rate,
    "clock": clock,
    "time_of_day": time_of_day,
}

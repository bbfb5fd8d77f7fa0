"""The field types every body shares: numbers that must be JSON numbers, booleans that must be JSON
booleans, text without NUL, other control characters or format characters, the bound on a number
typed as text, and the names of precisions, optimizers and job statuses."""

from __future__ import annotations

import os
from collections.abc import Sequence
from decimal import Decimal
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StringConstraints

from service.schemas.printable import escape, first_control

Precision = Literal["fp16", "bf16", "fp32"]
OptimizerName = Literal["adamw", "adam", "sgd_momentum", "sgd"]
JobStatus = Literal[
    "queued", "starting", "running", "restarting", "suspended", "succeeded", "failed", "cancelled", "stopped_early"
]
ACTIVE = ("starting", "running", "restarting")
"""The statuses of a job that holds its GPUs."""
TERMINAL = ("succeeded", "failed", "cancelled", "stopped_early")
"""The statuses a job ends in (a suspended job is neither: it holds no GPU and waits for a resume);
stopped_early: a sweep's early stopping ended it at a rung, with a checkpoint."""

MAX_TEXT_DIGITS = 30
"""Digits a number typed as text (the planner's form, the CLI) may have: more than any field's bound needs
(2**63 - 1 has 19); int() of 1e1000000 takes time quadratic in its million digits, holding the GIL."""


def too_many_digits(value: Decimal) -> bool:
    """More than MAX_TEXT_DIGITS significant digits, or 10**MAX_TEXT_DIGITS or more; asked before int() expands it."""
    # adjusted() is the exponent of the leading digit: 1e1000000 is measured without being expanded
    return value.adjusted() >= MAX_TEXT_DIGITS or len(value.as_tuple().digits) > MAX_TEXT_DIGITS


def _a_number(value: object) -> object:
    # pydantic's lax mode reads true as 1 and "2" as 2; the schema says number, and a count
    # given as a boolean or a string is a mistake
    if isinstance(value, bool):
        raise ValueError(f"Input should be a number, not a boolean (got {str(value).lower()})")
    if isinstance(value, str):
        raise ValueError(f"Input should be a number, not a string (got {value[:40]!r})")
    return value


def no_nul(text: str) -> str:
    # PostgreSQL's text columns cannot hold NUL (a 500 from the driver otherwise), nor can a file name
    if "\x00" in text:
        raise ValueError(f"must not contain a NUL character (\\u0000 at {text.index(chr(0))})")
    return text


def no_control(text: str) -> str:
    # a name is printed by the CLI and the dashboard to other users: an ESC in it would drive their
    # terminal, a bidi override (U+202E) would make it read as another name (service/schemas/printable.py
    # escapes what is stored; this refuses what is new)
    no_nul(text)
    if (index := first_control(text)) is None:
        return text
    if ord(text[index]) <= 0x9F:
        raise ValueError(
            f"must not contain a control character ({escape(text[index])} at {index}): C0, DEL and C1 "
            "characters (ESC, BEL, CR, newline, ...) are refused"
        )
    raise ValueError(
        f"must not contain a format character ({escape(text[index])} at {index}): Unicode's category Cf "
        "(bidi overrides and isolates, zero-width characters, U+FEFF, ...) is refused"
    )


Int = Annotated[int, BeforeValidator(_a_number)]
Float = Annotated[float, BeforeValidator(_a_number)]
Bool = StrictBool
"""true or false: pydantic's lax mode would also read 0, 1, "yes" and "off"."""
Text = Annotated[str, AfterValidator(no_control)]
"""Text a request names something by (a job's name, a path, a column, an entrypoint): no control or
format characters."""


def lines_only(text: str) -> str:
    # notes may run over lines; every other control or format character is refused, as in a name
    no_nul(text)
    if (index := first_control(text.replace("\n", " ").replace("\t", " "))) is None:
        return text
    raise ValueError(
        f"must not contain a control or format character ({escape(text[index])} at {index}): newline and tab "
        "are the only ones allowed"
    )


MAX_NOTES_CHARS = 20_000
Notes = Annotated[str, StringConstraints(max_length=MAX_NOTES_CHARS), AfterValidator(lines_only)]
"""A job's notes: text of several lines (newlines and tabs, no other control or format character)."""

TAG_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:=/+-]{0,63}$"
Tag = Annotated[str, StringConstraints(pattern=TAG_PATTERN)]
"""A job's tag: 1-64 letters, digits and . _ : = / + -, not starting with a punctuation mark
("baseline", "lr=3e-4", "sweep:7")."""
MAX_TAGS = 32


def distinct(values: list) -> list:
    """A set given as a list (a job's tags, its dependencies): each once, in order."""
    return sorted(set(values))


Tags = Annotated[list[Tag], AfterValidator(distinct)]
MAX_DEPENDENCIES = 32
JobIds = Annotated[
    list[Annotated[int, BeforeValidator(_a_number), Field(ge=1, le=2**63 - 1)]], AfterValidator(distinct)
]
"""Ids of jobs, each once, ascending."""


class Body(BaseModel):
    """A request body: a field it does not know is an error, not silently dropped."""

    model_config = ConfigDict(extra="forbid")


def resolved_roots(roots: Sequence[str]) -> tuple[str, ...]:
    """Data or model roots as a job's path is checked against them: real directories (relative ones
    under the working directory), URIs (s3://) as they are."""
    return tuple(root if "://" in root else os.path.realpath(root) for root in roots)

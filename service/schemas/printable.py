"""User text made safe to print: control characters shown escaped, never sent to a terminal.

A job's name, its log lines, an error's or an event's reason are written by users (another
user's, for an admin reading them) and by their code. Sent as they are, `ESC ] 0 ; ... BEL`
retitles the reader's terminal and `ESC [ 2 J` clears it. The API refuses control characters in
the names it stores (service/schemas/fields.py), but log lines and reasons may hold them, and rows stored
before the rule may too: so the CLI and the dashboard print every user text through escape().
Standard library only: `zero1 plan` and the dashboard import it.
"""

from __future__ import annotations

import re

CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
"""C0 (NUL to US, ESC among them), DEL and C1 (CSI among them): what a terminal may act on."""

MULTILINE = "\n\t"
"""What a text of several lines (a traceback, a spec) keeps: line breaks and tabs, which move only the cursor."""


def _escaped(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")  # \x1b, \n, \x9b: as Python writes them


def escape(text: str, *, keep: str = "") -> str:
    """`text` with each control character but those in `keep` written as its escape: '\\x1b]0;T\\x07'."""
    if keep:
        return CONTROL.sub(lambda m: m.group() if m.group() in keep else _escaped(m), text)
    return CONTROL.sub(_escaped, text)


def first_control(text: str) -> int | None:
    """The index of the first control character in `text`, or None."""
    match = CONTROL.search(text)
    return None if match is None else match.start()

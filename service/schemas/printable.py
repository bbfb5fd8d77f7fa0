"""User text made safe to print: control and format characters shown escaped, never sent to a terminal.

A job's name, its log lines, an error's or an event's reason are written by users (another
user's, for an admin reading them) and by their code. Sent as they are, `ESC ] 0 ; ... BEL`
retitles the reader's terminal and `ESC [ 2 J` clears it; a format character (Unicode's Cf: the
bidi overrides U+202A-U+202E and isolates U+2066-U+2069, zero-width ones, U+FEFF) draws nothing yet
reorders or hides what follows, so that a name reads as another one. The API refuses both in the
texts it stores (service/schemas/fields.py), but log lines and reasons may hold them, and rows stored
before the rule may too: so the CLI and the dashboard print every user text through escape().
Standard library only: `zero1 plan` and the dashboard import it.
"""

from __future__ import annotations

import re

CONTROL = re.compile(
    "[\x00-\x1f\x7f-\x9f"
    "\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f\u202a-\u202e"
    "\u2060-\u2064\u2066-\u206f\ufeff\ufff9-\ufffb\U000110bd\U000110cd\U00013430-\U0001343f"
    "\U0001bca0-\U0001bca3\U0001d173-\U0001d17a\U000e0001\U000e0020-\U000e007f]"
)
"""C0 (NUL to US, ESC among them), DEL and C1 (CSI among them): what a terminal may act on; and every
format character (category Cf) of Unicode 15, bidi overrides among them: what reorders or hides text
without drawing. Written out rather than built from unicodedata at import (a scan of every code point);
tests/test_trust_owners.py checks it against this Python's unicodedata."""

MULTILINE = "\n\t"
"""What a text of several lines (a traceback, a spec) keeps: line breaks and tabs, which move only the cursor."""


def _escaped(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")  # \x1b, \n, \x9b: as Python writes them


def escape(text: str, *, keep: str = "") -> str:
    """`text` with each control or format character but those in `keep` written as its escape:
    '\\x1b]0;T\\x07', '\\u202e'."""
    if keep:
        return CONTROL.sub(lambda m: m.group() if m.group() in keep else _escaped(m), text)
    return CONTROL.sub(_escaped, text)


def first_control(text: str) -> int | None:
    """The index of the first control or format character in `text`, or None."""
    match = CONTROL.search(text)
    return None if match is None else match.start()

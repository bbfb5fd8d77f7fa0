"""Where the CLI's output goes: rich tables, bars and colours on a terminal; the plain text of
before in a pipe or a file, which scripts, tests and `| head` read.

rich is imported here, inside the function, and by the commands that draw: `zero1 plan` and
`zero1 serve` never load it.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console

STATUS_STYLES = {
    "queued": "dim",
    "starting": "cyan",
    "running": "cyan",
    "restarting": "yellow",
    "suspended": "magenta",
    "succeeded": "green",
    "failed": "red",
    "cancelled": "yellow",
    "stopped_early": "blue",
}
"""A job status's colour in a table or bar (an unknown one is drawn unstyled)."""


def terminal(stream: TextIO | None = None) -> Console | None:
    """A rich Console on `stream` (default stdout) when it is a terminal, else None: plain text.

    A terminal is a tty that rich would draw on: TERM=dumb, TTY_COMPATIBLE=0 or TTY_INTERACTIVE=0
    make it plain text, NO_COLOR keeps the layout without colours. FORCE_COLOR alone does not make
    a pipe a terminal: a CI job that sets it for pytest's colours still reads the plain text.
    """
    stream = stream or sys.stdout
    try:
        if not stream.isatty():
            return None
    except ValueError:  # a closed stream
        return None
    from rich.console import Console

    console = Console(file=stream, highlight=False)
    return console if console.is_terminal and console.is_interactive else None

"""Secrets left at their example value: .env.example's placeholders carry a mark, and a token, a
password or a Ray auth token that still carries it is refused where it is read (service.auth,
service.store.db, service.planning.capacity), since everyone who read the example knows it.

May import: nothing of the project.
"""

from __future__ import annotations

import re

PLACEHOLDER = re.compile(r"change[-_]?me", re.IGNORECASE)
"""The mark of .env.example's values: a secret that has it is known to everyone who read the example."""
PLACEHOLDER_RULE = (
    "it contains change-me (or change_me, changeme, in any case), the mark of .env.example's placeholders"
)


def is_placeholder(secret: str) -> bool:
    return PLACEHOLDER.search(secret) is not None

"""zero1's Python client, installed as the package `zero1` (the wheel maps this folder to that name,
as it maps migrations/ to zero1_migrations): `from zero1 import Client`.

`Client(url=None, token=None)` talks to a running API (defaults: ZERO1_URL, ZERO1_TOKEN): `plan`,
`recommend`, `submit`, `job`, `jobs`, `sweep`, `sweeps`, `queue`, `cluster`, `upload_code`. A `Job` refreshes, waits
(with a progress bar), and reads its metrics (a pandas DataFrame where pandas is installed), events
and logs; it cancels, suspends, resumes and downloads its final model. A `Sweep` waits for its
trials, names its best trial's job and cancels. Answers are the API's own
response models (service/schemas/responses.py); an error answer is a `zero1.ApiError`. The
`zero1` command is built on this client: one HTTP client, not two.

Its modules import each other relatively, so that the same files run as `zero1` (installed) and
from the checkout.

May import: service.schemas.
"""

from __future__ import annotations

from .api import DEFAULT_URL, Client
from .errors import ApiError, StreamError
from .jobs import Job, LogLine
from .sweeps import Sweep

__all__ = ["DEFAULT_URL", "ApiError", "Client", "Job", "LogLine", "StreamError", "Sweep"]

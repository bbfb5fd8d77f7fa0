"""`python -m service.cli`: the `zero1` command, as the console script runs it."""

import sys

from service.cli import main

sys.exit(main())

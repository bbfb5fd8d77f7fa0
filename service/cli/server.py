"""`zero1 serve` runs the API and dashboard; `zero1 db upgrade` migrates its database."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from service.settings import get_settings


def cmd_db(args: argparse.Namespace) -> int:
    from sqlalchemy import make_url

    from service.store.db import upgrade

    url = get_settings().database_url
    try:
        upgrade(url)
    except ValueError as error:  # a placeholder password: a message, not a traceback
        print(f"zero1 db upgrade: {error}", file=sys.stderr)
        return 2
    # the password stays out of the output, which goes to container logs
    print(f"database at revision head: {make_url(url).render_as_string(hide_password=True)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from service.auth import check_bind, load_tokens
    from service.planning.cluster import check_ray_auth_token
    from service.store.db import check_url

    settings = get_settings()
    host = args.host or settings.host
    try:  # before anything starts: a bad token entry, an open bind or a placeholder is a message, not a traceback
        tokens = load_tokens(settings)
        check_bind(host, tokens=tokens)
        check_ray_auth_token(os.environ)
        check_url(settings.database_url)
    except ValueError as error:
        print(f"zero1 serve: {error}", file=sys.stderr)
        return 2

    import uvicorn

    from service.main import create_app

    # zero1's own log lines (re-attachments, retries, the drain at shutdown) beside uvicorn's
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvicorn.run(create_app(settings, tokens=tokens), host=host, port=args.port or settings.port)
    return 0

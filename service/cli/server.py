"""`zero1 serve` runs the API and dashboard; `zero1 db upgrade` migrates its database."""

from __future__ import annotations

import argparse
import copy
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
    from service.planning.capacity import check_ray_auth_token, private_ray_temp_dir
    from service.store.db import check_url

    try:  # before anything starts: a bad setting or token entry, an open bind or a placeholder is a message
        settings = get_settings()
        host = args.host or settings.host
        tokens = load_tokens(settings)
        check_bind(host, tokens=tokens)
        check_ray_auth_token(os.environ)
        check_url(settings.database_url)
        if settings.ray_address is None:  # the embedded Ray's files under a parent no job's uid can enter
            private_ray_temp_dir(os.environ)
    except ValueError as error:
        print(f"zero1 serve: {one_line(error)}", file=sys.stderr)
        return 2

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from service.main import create_app

    # zero1's own log lines (re-attachments, retries, the drain at shutdown) beside uvicorn's
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"  # beside every other line, not on stdout
    if settings.access_log == "changes":
        log_config.setdefault("filters", {})["changes"] = {"()": ChangesOnly}
        log_config["handlers"]["access"]["filters"] = ["changes"]
    try:  # ZERO1_RUN_AS: a uid that cannot run this Python is one line naming the directory that blocks it
        app = create_app(settings, tokens=tokens)
    except ValueError as error:
        print(f"zero1 serve: {one_line(error)}", file=sys.stderr)
        return 2
    uvicorn.run(
        app,
        host=host,
        port=args.port or settings.port,
        access_log=settings.access_log != "off",
        log_config=log_config,
        # X-Forwarded-* only from ZERO1_TRUSTED_PROXIES (uvicorn's default trusts loopback's)
        proxy_headers=bool(settings.trusted_proxies),
        forwarded_allow_ips=settings.trusted_proxies or None,
        # an idle connection is the client's to close: at uvicorn's default (5 s, httpx's and the zero1
        # client's idle expiry too) a request sent as the server closes it fails with "Server
        # disconnected without sending a response" (a loaded test_load.py met it)
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    return 0


KEEP_ALIVE_S = 75
"""Seconds the server keeps an idle connection open: past any client's idle expiry (httpx: 5 s) and a
load balancer's (60 s), so the client, not the server, ends an idle connection."""


def one_line(error: ValueError) -> str:
    """The error as one line: a refused ZERO1_* variable by its own message (pydantic's ValidationError
    spreads each over three lines, with a link), anything else as it is."""
    from pydantic import ValidationError

    if not isinstance(error, ValidationError):
        return " ".join(str(error).split())
    said = []
    for problem in error.errors():
        name = f"ZERO1_{str(problem['loc'][0]).upper()}" if problem.get("loc") else ""
        message = str(problem.get("msg", "invalid")).removeprefix("Value error, ")
        said.append(message if not name or message.startswith(name) else f"{name}: {message}")
    return "; ".join(said)


class ChangesOnly(logging.Filter):
    """uvicorn's access lines but a GET or HEAD answered below 400 (ZERO1_ACCESS_LOG=changes): its
    record's args are (client, method, path, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) == 5 and args[1] in ("GET", "HEAD") and isinstance(args[4], int) and args[4] < 400)

"""The FastAPI application.

May import: service.settings, service.errors, service.auth, service.telemetry, service.app_state,
service.scheduling, service.api, service.dashboard, workers.runtime.sandbox.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import Depends, FastAPI
from fastapi.staticfiles import StaticFiles

from service import dashboard
from service.api import root, v1
from service.api.limits import BodyLimit, BodySizeLimit
from service.api.wake import WakeScheduler
from service.app_state import AppState
from service.auth import Authenticator, TokenTable, load_tokens, lockout_of
from service.dashboard.login import install_login, require_page_reader
from service.errors import install_error_handlers
from service.scheduling.gauges import JobGauges, UsageCounters
from service.settings import Settings, get_settings
from service.telemetry import RequestTimer, Telemetry
from workers.runtime.sandbox import check_runnable

_PUBLIC_PATHS = ("/healthz",)
log = logging.getLogger(__name__)


def create_app(
    settings: Settings | None = None,
    *,
    tokens: TokenTable | None = None,
    make_state: Callable[..., AppState] = AppState,
) -> FastAPI:
    """The app; on start-up it migrates the database, connects Ray and starts the scheduler.

    `tokens` (parsed from the settings if not given) decide who may read and write; a malformed
    entry is a ValueError here, before anything starts. The app's metrics (app.state.telemetry)
    exist from here; their jobs and GPUs gauges read the runtime's database once it has started.
    `make_state(settings, telemetry=...)` builds what runs while the app is up: AppState (the tests'
    fast lane passes one on stand-ins for Ray).
    """
    settings = settings or get_settings()
    tokens = load_tokens(settings) if tokens is None else tokens
    if settings.run_as is not None:  # each named uid, and the range's first, can run a child: else say why now
        for identity in settings.run_as.checked_at_start():
            check_runnable(identity)
    if len(tokens.users) > 1 and settings.run_as is None:
        log.warning(
            "%d users have tokens and ZERO1_RUN_AS is unset: every user's python model runs as this service's "
            "user and can read what it reads (docs/security.md, Trust model)",
            len(tokens.users),
        )
    telemetry = Telemetry()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = make_state(settings, telemetry=telemetry)
        runtime.start()
        app.state.runtime = runtime
        telemetry.register(JobGauges(runtime.db, total_gpus=lambda: runtime.cluster.capacity().num_gpus))
        telemetry.register(UsageCounters(runtime.db))
        try:
            yield
        finally:
            runtime.stop()

    app = FastAPI(
        title="zero1",
        version=version("zero1"),
        description="Training jobs that fit where plain data parallelism cannot: ZeRO Stage 1 on Ray.",
        lifespan=lifespan,
    )
    app.state.authenticator = Authenticator(tokens, public_read=settings.public_read, lockout=lockout_of(settings))
    app.state.telemetry = telemetry
    app.add_middleware(
        BodySizeLimit,
        default=BodyLimit(settings.max_request_bytes, "ZERO1_MAX_REQUEST_BYTES"),
        by_path={"/v1/code": BodyLimit(settings.max_code_bytes, "ZERO1_MAX_CODE_BYTES")},
    )
    app.add_middleware(WakeScheduler)
    app.add_middleware(RequestTimer, telemetry=telemetry)  # added last, so outermost: a 413 is timed too
    install_error_handlers(app)
    app.include_router(root)
    app.include_router(v1)
    app.include_router(dashboard.router, dependencies=[Depends(require_page_reader)])
    install_login(app)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    if tokens.enabled:
        _document_bearer_auth(app, public_read=settings.public_read)
    return app


def _document_bearer_auth(app: FastAPI, *, public_read: bool) -> None:
    """/openapi.json declares the bearer token (so /docs has an Authorize button) where it is required."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()  # FastAPI's own, which it caches in app.openapi_schema
            schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                for method, operation in operations.items():
                    read = method == "get" or path in ("/v1/plan", "/v1/plan/recommend")
                    if path not in _PUBLIC_PATHS and not (public_read and read):
                        operation["security"] = [{"bearer": []}]
        return app.openapi_schema

    app.openapi = openapi

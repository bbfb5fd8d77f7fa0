"""The FastAPI application."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import version

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from service import dashboard
from service.api import root, v1
from service.config import Settings, get_settings
from service.errors import install_error_handlers
from service.runtime import Runtime


def create_app(settings: Settings | None = None) -> FastAPI:
    """The app; on start-up it migrates the database, connects Ray and starts the scheduler."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        runtime = Runtime(settings or get_settings())
        runtime.start()
        app.state.runtime = runtime
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
    install_error_handlers(app)
    app.include_router(root)
    app.include_router(v1)
    app.include_router(dashboard.router)
    app.mount("/static", StaticFiles(directory=dashboard.STATIC_DIR), name="static")
    return app

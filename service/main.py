"""The FastAPI application."""

from __future__ import annotations

from importlib.metadata import version

from fastapi import FastAPI

from service.api import root, v1
from service.errors import install_error_handlers


def create_app() -> FastAPI:
    app = FastAPI(
        title="zero1",
        version=version("zero1"),
        description="Training jobs that fit where plain data parallelism cannot: ZeRO Stage 1 on Ray.",
    )
    install_error_handlers(app)
    app.include_router(root)
    app.include_router(v1)
    return app

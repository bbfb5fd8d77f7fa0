"""Settings: every ZERO1_* environment variable, read in one place."""

from __future__ import annotations

from functools import lru_cache

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """zero1's configuration; each field is read from ZERO1_<FIELD NAME>."""

    model_config = SettingsConfigDict(env_prefix="ZERO1_", use_attribute_docstrings=True, extra="ignore")

    database_url: str = "sqlite:///.zero1/zero1.db"
    """SQLAlchemy URL of the database; PostgreSQL: postgresql+psycopg://user@host/db."""
    host: str = "127.0.0.1"
    """Address `zero1 serve` binds to."""
    port: int = Field(8000, ge=1, le=65535)
    """Port `zero1 serve` listens on."""
    simulated_gpus: int = Field(4, ge=1, le=4096)
    """Logical GPUs of the embedded cluster on a machine without CUDA; the
    planner's default num_gpus."""
    simulated_gpu_memory_gb: float = Field(80.0, gt=0, le=1e6, allow_inf_nan=False)
    """Memory of each logical GPU, in GB (1e9 bytes); the planner's default
    gpu_memory_gb."""
    gpu_overhead_gb: float = Field(1.0, ge=0, le=1e6, allow_inf_nan=False)
    """Fixed per-GPU bytes a job's plan reserves beyond model states and
    activations (CUDA context, communication buffers), in GB."""


@lru_cache
def get_settings() -> Settings:
    """The process's settings, read once from the environment."""
    return Settings()

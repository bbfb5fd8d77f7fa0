"""Alembic environment, driven from code: service.store.db.alembic_config() sets the URL and location."""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection, create_engine, make_url, pool

from service.store.tables import Base, UTCDateTime

config = context.config
target_metadata = Base.metadata


def _render_item(type_: str, obj: object, autogen_context) -> str | bool:
    """Write the models' own types as plain SQLAlchemy ones, so that migrations never import service code."""
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure_options(backend: str) -> dict:
    # SQLite cannot ALTER most things in place: batch mode copies the table instead.
    return {
        "target_metadata": target_metadata,
        "compare_type": True,
        "render_item": _render_item,
        "render_as_batch": backend == "sqlite",
    }


def run_migrations_offline() -> None:
    """Emit the SQL to stdout instead of running it (`alembic upgrade --sql`)."""
    url = config.get_main_option("sqlalchemy.url")
    options = _configure_options(make_url(url).get_backend_name())
    context.configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"}, **options)
    with context.begin_transaction():
        context.run_migrations()


def _run_on(connection: Connection) -> None:
    context.configure(connection=connection, **_configure_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    """Run against the database; a caller may lend its own connection through config.attributes."""
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_on(connection)
        return
    # A plain engine, not service.store.db.make_engine: SQLite's batch mode drops and
    # recreates tables, which with foreign_keys=ON would cascade-delete child rows.
    engine = create_engine(config.get_main_option("sqlalchemy.url"), poolclass=pool.NullPool)
    try:
        with engine.connect() as connection:
            _run_on(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

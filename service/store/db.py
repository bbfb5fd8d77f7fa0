"""Engine, sessions and migrations. SQLite embedded by default, PostgreSQL in production."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import resources
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker

from service.placeholders import PLACEHOLDER_RULE, is_placeholder

# the top-level migrations/ folder, installed as the package zero1_migrations (pyproject.toml)
MIGRATIONS_DIR = Path(str(resources.files("zero1_migrations")))


def check_url(url: str) -> None:
    """Refuse .env.example's POSTGRES_PASSWORD: a database anyone who read the example could log in to."""
    password = make_url(url).password
    if password is not None and is_placeholder(password):
        raise ValueError(
            f"ZERO1_DATABASE_URL: the password is a placeholder ({PLACEHOLDER_RULE}); "
            "set POSTGRES_PASSWORD in .env (or the URL's password) to a secret of your own"
        )


def private_database_file(path: Path) -> None:
    """The SQLite file 0600 and its directory 0700, whatever the umask: SQLite gives its WAL and
    shared-memory files the database file's mode, so a job's code running under another uid
    (ZERO1_RUN_AS) opens none of them. A directory that also holds the checkpoint storage (as
    .zero1/ does by default) is opened to 0711 by the launcher: traversed, never listed."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if path.parent.stat().st_mode & 0o7777 not in (0o700, 0o711):
        os.chmod(path.parent, 0o700)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600))
    os.chmod(path, 0o600)


def make_engine(url: str) -> Engine:
    """An engine for `url`; SQLite gets WAL, foreign keys and a busy timeout for the API's threads."""
    check_url(url)
    if url.startswith("sqlite"):
        database = url.split("///", 1)[-1]
        if database and database != ":memory:":
            private_database_file(Path(database))
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_connection, _record) -> None:
            cursor = dbapi_connection.cursor()
            cursor.execute("PRAGMA journal_mode=WAL")
            cursor.execute("PRAGMA foreign_keys=ON")
            cursor.execute("PRAGMA synchronous=NORMAL")
            cursor.close()

        return engine
    # psycopg prepares a statement after 5 runs, and PostgreSQL then moves it to a generic plan:
    # for the thinned metrics query (step IN 500 parameters) that plan tests every row against
    # the list one value at a time, 20x slower than the plan for the values at hand
    return create_engine(
        url, pool_pre_ping=True, pool_size=10, max_overflow=20, connect_args={"prepare_threshold": None}
    )


def alembic_config(url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return config


def upgrade(url: str, revision: str = "head") -> None:
    """Apply the migrations: the only way the schema is created or changed."""
    check_url(url)  # migrations/env.py makes its own engine
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str, revision: str = "base") -> None:
    command.downgrade(alembic_config(url), revision)


class Database:
    """The engine and a session factory; one commit point per unit of work."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A session that commits when the block succeeds and rolls back when it raises."""
        with self.sessions() as session:
            try:
                yield session
                session.commit()
            except BaseException:
                session.rollback()
                raise

    def dispose(self) -> None:
        self.engine.dispose()

"""zero1's Alembic migrations, installed as the package zero1_migrations."""

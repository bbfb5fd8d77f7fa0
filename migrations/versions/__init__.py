"""One module per revision: the only way the schema changes."""

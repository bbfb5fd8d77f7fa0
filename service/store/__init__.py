"""What the control plane keeps: the database (engine, tables, metric rows, log lines, artifacts,
code uploads) and the files on the checkpoint storage it owns (code bundles, job directories, the
dataset token cache), with the housekeeping that bounds them.

May import: service.settings, service.errors, service.auth, service.schemas, workers.
"""

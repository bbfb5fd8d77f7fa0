"""Code bundles, a user's zip for a python model: their checks (checks: what a bundle may hold, the
digest, unpack's re-packing under bundle/), their stores (stores: a directory every worker reads, or an
object store's prefix; code_store picks one) and who uploaded which (uploads: the rows and the check
that admits a job's `code` only for its uploaders)."""

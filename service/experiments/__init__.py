"""Jobs run as a search: sweeps (a job spec searched over its fields, planned whole before any trial
starts, its trials submitted as jobs by the scheduler's tick; suspend, resume, cancel; what the API
answers of one) and their early stopping (early_stopping: ASHA, from the rows the service stores).

May import: service.auth, service.errors, service.schemas, service.store, service.intake, service.scheduling.
"""

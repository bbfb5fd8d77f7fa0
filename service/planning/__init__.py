"""What a job needs and whether the cluster holds it: plans through the memory model, traced plans,
recommendations (the configurations that fit, cheapest first), the cluster's capacity, and the
submit-time checks of a model's path and a dataset. Work that needs torch or runs a user's code goes
to a Ray task (tasks), within the concurrency limits of the API's long calls (service.concurrency).

May import: service.settings, service.placeholders, service.errors, service.concurrency, service.schemas, workers.
"""

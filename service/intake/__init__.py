"""A job from request to queue: its checks before it is stored (admission: the plan against the
cluster's memory, the data and model paths, the dataset's tokenizing, the storage), its start from
another job's final weights (init_from), and storing it (submission: idempotency, each owner's limit
of queued jobs, its tags and dependencies), queued for service.scheduling; and a job planned again at a
smaller configuration after an attempt ran out of memory (replans), for the scheduler to relaunch.

May import: service.settings, service.errors, service.auth, service.schemas, service.store,
service.planning, service.scheduling, workers.
"""

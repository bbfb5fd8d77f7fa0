"""zero1's control plane: the API process. It plans, admits, queues and watches jobs; it never loads
torch (the workers do). Its packages, each opened by what it holds and what it may import:

    main, runtime        the FastAPI app, and what it runs while it is up
    settings, run_as,    every ZERO1_* setting, and ZERO1_RUN_AS read; who is calling; the bound on
    auth, lockout,       guessing tokens; the errors every layer raises, rendered as JSON; the
    errors, telemetry    Prometheus metrics
    api/                 the REST routes, their dependencies and limits
    dashboard/           the live pages, rendered on the server
    cli/                 the `zero1` command
    schemas/             the REST contract: request and response bodies, field types
    planning/            plans, traces, recommendations, the cluster's capacity, submit-time checks
    scheduling/          admission, the job state machine, the scheduler, elastic sizes, the launcher
    store/               the database's tables and rows, and the files on the checkpoint storage
    tracking/            each job as an MLflow run, exported in the background

Imports run from the app down to schemas and store, and from here into workers, never back.
"""

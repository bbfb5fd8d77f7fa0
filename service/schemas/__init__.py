"""The REST contract: the bodies the API takes and returns, shared by the CLI and the dashboard.

plan_requests (plans, recommendations), requests (jobs), responses, model_specs and data_specs (what
a job trains and on what, each converted once into the workers' frozen configuration), fields (the
field types and job statuses every body shares) and printable (user text escaped before it reaches a
terminal).
Pydantic and the standard library; no torch.

May import: workers.config, workers.limits, workers.memory.
"""

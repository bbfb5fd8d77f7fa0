"""ZeRO1AdamW (optimizer): mixed-precision AdamW with its fp32 state sharded over the ranks. Its flat
layout (flat), the update of one rank's shard (adamw), the reduce and gather over the ranks (comm,
buckets), fp16 loss scaling (loss_scale) and its checkpoint formats: the sharded one, resharded across
world sizes (sharded_state), and the consolidated one (consolidated). Stages 2 (stage2) and 3 (stage3,
on FSDP2, sharded by a model's units: workers.models.units).

May import: workers.limits, workers.memory, workers.models, workers.phases.
"""

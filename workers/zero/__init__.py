"""ZeRO1AdamW (optimizer): mixed-precision AdamW with its fp32 state sharded over the ranks. Its flat
layout (flat), the update of one rank's shard (adamw), the reduce and gather over the ranks (comm,
buckets), fp16 loss scaling (loss_scale) and its checkpoint formats: the sharded one, resharded across
world sizes (sharded_state), and the consolidated one (consolidated).

May import: workers.limits, workers.memory.
"""

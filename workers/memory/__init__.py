"""The memory model: per-GPU bytes of a ZeRO stage 1 job (model), from the built-in models' closed
forms (specs) or a traced workload, and its fit to GPUs (fit: the plan at N, min_gpus, the sweep over
N). The standard library only: the API plans with it without torch.

May import: the standard library only.
"""

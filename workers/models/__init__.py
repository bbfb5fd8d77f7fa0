"""The models a rank trains: the built-in GPT and MLP (builtin), Hugging Face causal LMs (hf), a
user's own code (usercode), and the tracer that counts what a training step keeps alive (trace).

May import: workers.config, workers.memory, workers.data.
"""

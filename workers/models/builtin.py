"""The models a job trains: a GPT-2-style decoder and an MLP, built from their specs.

Parameter names and shapes are the memory model's (GPTSpec.parameter_shapes),
so a plan counts exactly what these modules allocate.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from workers.memory.buckets import DEFAULT_BUCKET_CAP_MB
from workers.memory.model import GPTSpec, MLPSpec
from workers.models.trace import StepTrace, trace_layers, trace_step

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


class Linear(nn.Linear):
    """nn.Linear in its input's dtype: itself when they agree; with GPT's compute_dtype, a 16-bit
    layer upcasts its weights and computes in fp32 (CPUs without bf16 matmul units run bf16 ~30x slower)."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        return F.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm in its input's dtype, as Linear."""

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == self.weight.dtype:
            return super().forward(x)
        return F.layer_norm(x, self.normalized_shape, self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class CausalSelfAttention(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.n_head = spec.n_head
        self.c_attn = Linear(spec.n_embd, 3 * spec.n_embd)
        self.c_proj = Linear(spec.n_embd, spec.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        # (B, T, 3C) -> three (B, n_head, T, head_dim) views of one tensor
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(c, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # fused: no (T, T) matrix is kept
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLPBlock(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.c_fc = Linear(spec.n_embd, 4 * spec.n_embd)
        self.c_proj = Linear(4 * spec.n_embd, spec.n_embd)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, spec: GPTSpec) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(spec.n_embd)
        self.attn = CausalSelfAttention(spec)
        self.ln_2 = LayerNorm(spec.n_embd)
        self.mlp = MLPBlock(spec)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: learned positions, pre-LayerNorm blocks, LM head tied to the token embedding."""

    def __init__(
        self, spec: GPTSpec, *, activation_checkpointing: bool = False, compute_dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.spec = spec
        self.activation_checkpointing = activation_checkpointing
        self.compute_dtype = compute_dtype
        """Dtype of the activations; None: the parameters'."""
        self.transformer = nn.ModuleDict(
            {
                "wte": nn.Embedding(spec.vocab_size, spec.n_embd),
                "wpe": nn.Embedding(spec.block_size, spec.n_embd),
                "h": nn.ModuleList(Block(spec) for _ in range(spec.n_layer)),
                "ln_f": LayerNorm(spec.n_embd),
            }
        )
        self.lm_head = Linear(spec.n_embd, spec.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2: scale residual projections by depth
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * spec.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of next-token prediction, computed in fp32."""
        t = idx.shape[1]
        if t > self.spec.block_size:
            raise ValueError(f"sequence length ({t}) exceeds block_size ({self.spec.block_size})")
        pos = torch.arange(t, device=idx.device)
        dtype = self.compute_dtype or self.transformer.wte.weight.dtype
        x = self.transformer.wte(idx).to(dtype) + self.transformer.wpe(pos).to(dtype)
        for block in self.transformer.h:
            # reentrant: the block's input is kept as a saved tensor and its recompute runs inside
            # backward, one block at a time (the shape GPTSpec's closed forms count)
            x = checkpoint(block, x, use_reentrant=True) if self.activation_checkpointing else block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


class MLP(nn.Module):
    """Linear layers with ReLU between them; a classifier over sizes[-1] classes."""

    def __init__(self, spec: MLPSpec) -> None:
        super().__init__()
        self.spec = spec
        pairs = list(itertools.pairwise(spec.sizes))
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in pairs)

    def forward(self, x: Tensor, targets: Tensor) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return F.cross_entropy(x.float(), targets)


def build_model(
    spec: GPTSpec | MLPSpec,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    activation_checkpointing: bool = False,
    seed: int = 0,
    compute_dtype: torch.dtype | None = None,
) -> nn.Module:
    """The model of a spec, initialised from `seed` (the same on every rank), in `dtype` on `device`;
    a GPT computes in `compute_dtype` when given."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if isinstance(spec, GPTSpec):
            model = GPT(spec, activation_checkpointing=activation_checkpointing, compute_dtype=compute_dtype)
        else:
            model = MLP(spec)
    return model.to(device=device, dtype=dtype)


def trace_builtin(
    spec: GPTSpec | MLPSpec,
    *,
    precision: str,
    micro_batch_size: int,
    seq_len: int | None = None,
    activation_checkpointing: bool = False,
    bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
) -> StepTrace:
    """One micro-batch of a built-in model's training step, traced on fake tensors (workers/models/trace.py);
    a GPT's depth is extrapolated from two shallow traces; stage 2's buckets are of bucket_cap_mb MiB."""
    dtype = DTYPES[precision]
    if isinstance(spec, MLPSpec):
        return trace_step(
            lambda: MLP(spec),
            lambda: (
                torch.randn(micro_batch_size, spec.sizes[0], dtype=dtype),
                torch.zeros(micro_batch_size, dtype=torch.long),
            ),
            dtype=dtype,
            bucket_cap_mb=bucket_cap_mb,
        )
    seq_len = seq_len or spec.block_size
    return trace_layers(
        lambda num_layers: GPT(
            dataclasses.replace(spec, n_layer=num_layers), activation_checkpointing=activation_checkpointing
        ),
        lambda: tuple(torch.zeros(micro_batch_size, seq_len, dtype=torch.long) for _ in range(2)),  # ids, targets
        dtype=dtype,
        num_layers=spec.n_layer,
        bucket_cap_mb=bucket_cap_mb,
    )

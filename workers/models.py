"""The models a job trains: a GPT-2-style decoder and an MLP, built from their specs.

Parameter names and shapes are the memory model's (GPTSpec.parameter_shapes),
so a plan counts exactly what these modules allocate.
"""

from __future__ import annotations

import itertools
import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from workers.memory import GPTSpec, MLPSpec


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
            # reentrant: the block's input is kept through save_for_backward, where
            # ActivationMeter's hooks see it (and the recompute happens inside backward)
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


class ActivationMeter:
    """Bytes of activations autograd keeps for backward: the CPU's stand-in
    for torch.cuda.max_memory_allocated.

    Saved tensors are counted by storage, once each (q, k and v are views of
    one tensor); parameters, which autograd also saves, are model states and
    are not counted. With activation checkpointing each block is recomputed
    during backward, one at a time: the largest block's recomputed tensors
    are added to what forward kept.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.forward_bytes = 0
        self.recompute_bytes = 0

    @property
    def peak_bytes(self) -> int:
        return self.forward_bytes + self.recompute_bytes

    def run(self, loss_fn, backward) -> Tensor:
        """loss = loss_fn(); backward(loss); both measured. Returns the loss."""
        params = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        tallies: list[dict[int, int]] = [{}]

        def pack(tensor: Tensor) -> Tensor:
            storage = tensor.untyped_storage()
            if storage.data_ptr() not in params:
                tallies[-1][storage.data_ptr()] = storage.nbytes()
            return tensor

        blocks = getattr(getattr(self.model, "transformer", None), "h", [])
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = loss_fn()
            self.forward_bytes = sum(tallies[0].values())
            # a recomputed block's storages are freed before the next block's, which may reuse
            # their addresses: tally each recomputation on its own
            hooks = [block.register_forward_pre_hook(lambda *_: tallies.append({})) for block in blocks]
            try:
                backward(loss)
            finally:
                for hook in hooks:
                    hook.remove()
        self.recompute_bytes = max((sum(t.values()) for t in tallies[1:]), default=0)
        return loss


def saved_activation_bytes(model: nn.Module, *inputs: Tensor) -> int:
    """ActivationMeter's peak for one forward and backward of `model` on `inputs`."""
    meter = ActivationMeter(model)
    meter.run(lambda: model(*inputs), lambda loss: loss.backward())
    return meter.peak_bytes

"""The built-in models' shapes: a GPT-2-style decoder and an MLP, with their exact parameter
counts (as the optimizer lays them out: decayed matrices, then the rest) and the closed form of
the activations one micro-batch keeps for the backward.

Standard library only, as workers/memory/model.py, which plans with them.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from workers.memory.buckets import Staging


@dataclass(frozen=True, slots=True, kw_only=True)
class GPTSpec:
    """A GPT-2-style decoder: learned positions, pre-LayerNorm blocks with
    biases, a 4x MLP, and an LM head tied to the token embedding."""

    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("vocab_size", "n_layer", "n_head", "n_embd", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head}): "
                f"{self.n_embd} % {self.n_head} = {self.n_embd % self.n_head}"
            )

    def param_groups(self) -> tuple[int, int]:
        """(decay, no_decay) element counts: matrices and embeddings are decayed;
        biases and LayerNorm weights are not (nanoGPT's rule: dim >= 2 decays)."""
        c = self.n_embd
        layers = self.n_layer
        # per block: c_attn (c, 3c), attn c_proj (c, c), c_fc (c, 4c), mlp c_proj (4c, c)
        decay = self.vocab_size * c + self.block_size * c + layers * 12 * c * c
        # per block: ln_1 and ln_2 (2c each), biases 3c + c + 4c + c; plus ln_f (2c)
        no_decay = layers * 13 * c + 2 * c
        return decay, no_decay

    @property
    def num_params(self) -> int:
        """Ψ = V·C + T·C + L·(12C² + 13C) + 2C (the LM head is tied)."""
        return sum(self.param_groups())

    def gathered_numel(self) -> int:
        """Parameters a ZeRO stage-3 rank holds whole at once (workers/zero/stage3.py): the root's
        (embeddings, ln_f: gathered for the whole step) and two blocks (the one running and the
        next, which FSDP2 prefetches)."""
        c = self.n_embd
        return self.vocab_size * c + self.block_size * c + 2 * c + min(2, self.n_layer) * (12 * c * c + 13 * c)

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, as the workers' GPT module must
        report them from named_parameters() (nanoGPT's names; nn.Linear
        weights are (out, in); the tied LM head is listed once, as wte)."""
        c = self.n_embd
        shapes = {"transformer.wte.weight": (self.vocab_size, c), "transformer.wpe.weight": (self.block_size, c)}
        for i in range(self.n_layer):
            block = f"transformer.h.{i}"
            for name, shape in (
                ("ln_1.weight", (c,)),
                ("ln_1.bias", (c,)),
                ("attn.c_attn.weight", (3 * c, c)),
                ("attn.c_attn.bias", (3 * c,)),
                ("attn.c_proj.weight", (c, c)),
                ("attn.c_proj.bias", (c,)),
                ("ln_2.weight", (c,)),
                ("ln_2.bias", (c,)),
                ("mlp.c_fc.weight", (4 * c, c)),
                ("mlp.c_fc.bias", (4 * c,)),
                ("mlp.c_proj.weight", (c, 4 * c)),
                ("mlp.c_proj.bias", (c,)),
            ):
                shapes[f"{block}.{name}"] = shape
        shapes["transformer.ln_f.weight"] = shapes["transformer.ln_f.bias"] = (c,)
        return shapes

    def activation_bytes(
        self, *, micro_batch_size: int, seq_len: int, bytes_per_element: int, checkpointing: bool
    ) -> int:
        """Bytes alive when one micro-batch's forward returns: its inputs and what autograd saved.

        Per layer, Korthikanti et al. 2022, "Reducing Activation Recomputation
        in Large Transformer Models" (arXiv:2205.05198), §4.1, count
        s·b·h·(34 + 5·a·s/h) bytes for 16-bit activations with dropout and an
        unfused attention. zero1's GPT has no dropout and uses fused
        scaled-dot-product attention, which keeps no s×s matrix but its output
        and an fp32 log-sum-exp (a·s·b). What each block saves, in s·b·h
        elements: ln_1 input 1, c_attn input 1, q/k/v 3, attention output 1
        (which is also c_proj's input: the fused kernels lay their output out
        as (B, T, heads, head_dim), so transposing it back copies nothing),
        ln_2 input 1, c_fc input 1, GELU input 4, mlp c_proj input 4: 16 —
        Korthikanti's count without dropout — plus fp32 mean and rstd of both
        LayerNorms (4·s·b). The head saves ln_f's input and the LM head's input
        (2·s·b·h), ln_f's statistics, and the fp32 log-softmax of the logits
        (4·s·b·V). The micro-batch itself: token ids and targets (int64) and the
        positions (one row). With checkpointing each block keeps only its input;
        the block recomputed during backward is a temporary (temporaries_bytes).
        Checked against a trace of the step in tests/test_trace.py.
        """
        sb = micro_batch_size * seq_len
        e = bytes_per_element
        inputs = 2 * 8 * sb + 8 * seq_len
        kept = sb * self.n_embd * e if checkpointing else self._block_bytes(sb, e)
        return inputs + self.n_layer * kept + self._head_bytes(sb, e)

    def temporaries_bytes(
        self, *, micro_batch_size: int, seq_len: int, bytes_per_element: int, checkpointing: bool
    ) -> int:
        """Bytes beyond the activations at the step's peak, the larger of two moments of backward.

        The head's: the loss's gradient and the logits' gradient, both fp32 (s·b·V each),
        beside the saved log-softmax. The last block's, once the head's saved tensors are
        freed: the MLP's c_proj backward holds the gradient arriving at the block (s·b·h),
        the one it computes for its input (4·s·b·h), and its weight's and bias's gradients
        (4h² + h) before they are added into the flat gradient buffer; the tied LM head's
        weight gradient (V·h), which autograd holds until the embedding's part arrives at the
        end of backward; with checkpointing, the block's recomputed activations.
        """
        sb = micro_batch_size * seq_len
        e = bytes_per_element
        c = self.n_embd
        head_peak = 2 * 4 * sb * self.vocab_size
        recomputed = self._block_bytes(sb, e) if checkpointing else 0
        c_proj_grads = (sb * c + 4 * sb * c + 4 * c * c + c) * e
        tied_grad = self.vocab_size * c * e
        return max(head_peak, recomputed + c_proj_grads + tied_grad - self._head_bytes(sb, e))

    def buckets_bytes(
        self, *, micro_batch_size: int, seq_len: int, bytes_per_element: int, checkpointing: bool, bucket_cap_mb: float
    ) -> int:
        """Bytes a ZeRO stage-2 rank's step peaks at beyond temporaries_bytes: the staging buffers of its
        gradient buckets (workers/memory/buckets.py), played over backward's order of the gradients.

        A bound, by phase of backward: the head's moment stages nothing (the tied head's gradient waits
        for the embedding's); in each block (the last with ln_f) the most staged at once beside the last
        block's moment less the blocks already freed behind it (one block's saved tensors each, its
        input with checkpointing); at the end the embeddings' gradients (the tied one, the lookup's and
        their sum, and the positions') beside what is staged then. Checked against a trace of the step
        (tests/test_stage2_memory.py): never under it.
        """
        sb = micro_batch_size * seq_len
        e = bytes_per_element
        c = self.n_embd
        step = {"micro_batch_size": micro_batch_size, "seq_len": seq_len, "bytes_per_element": e}
        temporaries = self.temporaries_bytes(**step, checkpointing=checkpointing)
        recomputed = self._block_bytes(sb, e) if checkpointing else 0
        tied_grad = self.vocab_size * c * e
        last_block = recomputed + (5 * sb * c + 4 * c * c + c) * e + tied_grad - self._head_bytes(sb, e)
        freed = sb * c * e if checkpointing else self._block_bytes(sb, e)
        ln_f, per_layer, at_embeddings = _gpt_staged(self, e, bucket_cap_mb)
        moments = [temporaries]
        for behind, staged in enumerate(per_layer):
            moments.append(last_block - behind * freed + max(staged, ln_f if behind == 0 else 0))
        activations = self.activation_bytes(**step, checkpointing=checkpointing)
        inputs = 2 * 8 * sb + 8 * seq_len
        embeddings = (sb * c + self.block_size * c + 2 * self.vocab_size * c) * e + tied_grad
        moments.append(inputs + embeddings - activations + at_embeddings)
        return max(moments) - temporaries

    def _block_bytes(self, sb: int, e: int) -> int:
        """What one block saves for backward (activation_bytes' per-layer term)."""
        fp32 = 4
        return sb * (16 * self.n_embd * e + 2 * 2 * fp32 + self.n_head * fp32)

    def _head_bytes(self, sb: int, e: int) -> int:
        """What ln_f, the LM head and the loss save for backward."""
        fp32 = 4
        return sb * (2 * self.n_embd * e + 2 * fp32 + self.vocab_size * fp32)


@dataclass(frozen=True, slots=True, kw_only=True)
class MLPSpec:
    """A stack of Linear layers with biases and ReLU between them."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.sizes) < 2:
            raise ValueError(f"sizes needs at least 2 entries (input and output), got {len(self.sizes)}")
        for i, size in enumerate(self.sizes):
            if size < 1:
                raise ValueError(f"sizes[{i}] must be >= 1, got {size}")

    def param_groups(self) -> tuple[int, int]:
        """(decay, no_decay): weight matrices, then biases."""
        pairs = list(itertools.pairwise(self.sizes))
        return sum(a * b for a, b in pairs), sum(b for _, b in pairs)

    @property
    def num_params(self) -> int:
        return sum(self.param_groups())

    def gathered_numel(self) -> int:
        """Parameters a ZeRO stage-3 rank holds whole at once: its two largest layers (each a unit)."""
        layers = sorted((a * b + b for a, b in itertools.pairwise(self.sizes)), reverse=True)
        return sum(layers[:2])

    def parameter_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every parameter, as the workers' MLP reports them (weights (out, in))."""
        shapes = {}
        for i, (a, b) in enumerate(itertools.pairwise(self.sizes)):
            shapes[f"layers.{i}.weight"] = (b, a)
            shapes[f"layers.{i}.bias"] = (b,)
        return shapes

    def activation_bytes(
        self, *, micro_batch_size: int, seq_len: int, bytes_per_element: int, checkpointing: bool
    ) -> int:
        """Each Linear saves its input (a ReLU's saved output is the same tensor), and the
        classification loss saves an fp32 log-softmax of the output and the int64 targets.
        One sample is one row: seq_len and checkpointing do not apply."""
        del seq_len, checkpointing
        inputs = sum(self.sizes[:-1]) * bytes_per_element
        return micro_batch_size * (inputs + 4 * self.sizes[-1] + 8)

    def temporaries_bytes(
        self, *, micro_batch_size: int, seq_len: int, bytes_per_element: int, checkpointing: bool
    ) -> int:
        """Bytes beyond the activations at the step's peak: the largest of backward's moments,
        walked layer by layer from the loss (the loss's and the logits' fp32 gradients; then each
        Linear's gradients for its input, weight and bias beside the one arriving; each ReLU's
        new gradient beside the old), as the saved tensors behind it are freed."""
        del seq_len, checkpointing
        return max(moment for moment, _ in self._moments(micro_batch_size, bytes_per_element))

    def buckets_bytes(
        self, *, micro_batch_size: int, seq_len: int, bytes_per_element: int, checkpointing: bool, bucket_cap_mb: float
    ) -> int:
        """Bytes a ZeRO stage-2 rank's step peaks at beyond temporaries_bytes: the staging buffers of its
        gradient buckets (workers/memory/buckets.py) beside each of backward's moments, a layer's
        weight and bias gradients staged at the moment they are made."""
        del seq_len, checkpointing
        e = bytes_per_element
        staging = _Arrivals(self.parameter_shapes(), bytes_per_element=e, bucket_cap_mb=bucket_cap_mb)
        moments = self._moments(micro_batch_size, e)
        staged = []
        for _, layer in moments:
            names = [] if layer is None else [f"layers.{layer}.bias", f"layers.{layer}.weight"]  # bias first
            staged.append(staging.arrive(names))
        return max(m + s for (m, _), s in zip(moments, staged, strict=True)) - max(m for m, _ in moments)

    def _moments(self, b: int, e: int) -> list[tuple[int, int | None]]:
        """(bytes beyond the activations, the layer whose weight and bias gradients are made then, if
        any) at each of backward's moments."""
        out = self.sizes[-1]
        moments: list[tuple[int, int | None]] = [(2 * 4 * b * out, None)]  # nll's and log-softmax's fp32 grads
        live = -4 * b * out  # then the saved log-softmax is freed
        grad = b * out * e  # the logits' gradient in the model's dtype
        if e != 4:  # cast down from fp32, both alive a moment
            moments.append((live + 4 * b * out + grad, None))
        live += grad
        for i in range(len(self.sizes) - 2, -1, -1):
            fan_in = self.sizes[i]
            fan_out = self.sizes[i + 1]
            grad_input = b * fan_in * e if i else 0  # the first layer's input needs no gradient
            moments.append((live + grad_input + (fan_in * fan_out + fan_out) * e, i))
            live += grad_input - grad
            grad = grad_input
            if i:  # the ReLU before it: a new gradient beside the old, then its saved output freed
                moments.append((live + grad, None))
                live -= b * fan_in * e
        return moments


ModelSpec = GPTSpec | MLPSpec

_BLOCK_GRADS = (
    "mlp.c_proj.bias",
    "mlp.c_proj.weight",
    "mlp.c_fc.bias",
    "mlp.c_fc.weight",
    "ln_2.weight",
    "ln_2.bias",
    "attn.c_proj.bias",
    "attn.c_proj.weight",
    "attn.c_attn.bias",
    "attn.c_attn.weight",
    "ln_1.weight",
    "ln_1.bias",
)
"""A GPT block's parameters in the order backward hands over their gradients (a Linear's bias first)."""


@functools.lru_cache(maxsize=64)
def _gpt_staged(spec: GPTSpec, bytes_per_element: int, bucket_cap_mb: float) -> tuple[int, tuple[int, ...], int]:
    """The most a GPT's staging buffers hold while ln_f's gradients are made, during each block's (the
    last block first), and during the embeddings'. They depend on the shapes and the cap only, so the
    recommender, which weighs many micro-batches and checkpointings of one model, plays them once."""
    staging = _Arrivals(spec.parameter_shapes(), bytes_per_element=bytes_per_element, bucket_cap_mb=bucket_cap_mb)
    ln_f = staging.arrive(["transformer.ln_f.weight", "transformer.ln_f.bias"])  # before the last block's
    per_layer = tuple(
        staging.arrive([f"transformer.h.{layer}.{name}" for name in _BLOCK_GRADS])
        for layer in reversed(range(spec.n_layer))
    )
    return ln_f, per_layer, staging.arrive(["transformer.wpe.weight", "transformer.wte.weight"])


class _Arrivals:
    """A built-in model's staging buffers (workers/memory/buckets.py Staging), its gradients named as
    parameter_shapes() names them, over the optimizer's flat buffers: decayed (2 or more dimensions),
    then the rest, each in the model's order."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], *, bytes_per_element: int, bucket_cap_mb: float) -> None:
        buffers = [
            [n for n, shape in shapes.items() if len(shape) >= 2],
            [n for n, shape in shapes.items() if len(shape) < 2],
        ]
        buffers = [names for names in buffers if names]
        self.place = {name: (b, i) for b, names in enumerate(buffers) for i, name in enumerate(names)}
        numels = [[math.prod(shapes[name]) for name in names] for names in buffers]
        self.staging = Staging(numels, bytes_per_element=bytes_per_element, bucket_cap_mb=bucket_cap_mb)

    def arrive(self, names: list[str]) -> int:
        """The named gradients are made, in turn, and each staged: the most the buffers hold meanwhile."""
        most = self.staging.live_bytes
        for name in names:
            self.staging.stage(*self.place[name])
            most = max(most, self.staging.live_bytes)
            self.staging.staged(*self.place[name])
        return most


def first_mismatch(
    model: dict[str, tuple[int, ...]], weights: dict[str, tuple[int, ...]], *, source: str
) -> str | None:
    """Why `weights` (name -> shape, from `source`) cannot initialise `model` (name -> shape, in the
    model's order): its first parameter that the weights lack or hold in another shape, else the
    first name the model lacks; None when they match. What init_from's 422 and a rank's load say."""
    for name, shape in model.items():
        if name not in weights:
            return f"parameter {name} {_shown(shape)} is not among {source}"
        if tuple(weights[name]) != tuple(shape):
            return (
                f"parameter {name} has shape {_shown(weights[name])} in {source}, {_shown(shape)} in this job's model"
            )
    extra = next((name for name in weights if name not in model), None)
    return None if extra is None else f"{source} hold {extra} {_shown(weights[extra])}, which this job's model lacks"


def _shown(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(map(str, shape)) + ")"

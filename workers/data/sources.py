"""Training data: deterministic, seeded sources that every rank slices the same way.

Sample i of step s is drawn from its own generator, seeded by (seed, s, i), so
the global batch of a step is the same for any world size and rank r makes
only its own slice of it. Held-out samples (evaluation) come from the "steps"
below zero, which training never draws: see Batches.held_out_micro_batch.
"""

from __future__ import annotations

import errno
import io
import os
import stat
from pathlib import Path

import torch
from torch import Tensor

from workers.config import DatasetSpec, DataSource, HFSpec, SyntheticSpec, TextSpec
from workers.data.datasets import DatasetSource
from workers.memory.model import GPTSpec, MLPSpec

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, step, index) over 63 bits
_READ_CHUNK_BYTES = 1 << 20


def sample_seed(seed: int, step: int, index: int) -> int:
    """A distinct generator seed per (seed, step, sample index)."""
    return ((seed * _MIX + step) * _MIX + index) % (1 << 63)


class MarkovSource:
    """Tokens from a fixed random Markov chain: each token has `branching`
    successors with Dirichlet(1) weights; a sequence starts uniformly."""

    def __init__(self, *, vocab_size: int, branching: int, seed: int) -> None:
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"branching must be in [1, vocab_size={vocab_size}], got {branching}")
        gen = torch.Generator().manual_seed(seed)
        successors = torch.stack([torch.randperm(vocab_size, generator=gen)[:branching] for _ in range(vocab_size)])
        weights = -torch.rand(vocab_size, branching, generator=gen, dtype=torch.float64).log()  # Dirichlet(1)
        weights /= weights.sum(1, keepdim=True)
        self.vocab_size = vocab_size
        self.transition = torch.zeros(vocab_size, vocab_size, dtype=torch.float64)
        self.transition.scatter_(1, successors, weights)
        self.cdf = self.transition.cumsum(1)

    def loss_floor(self, seq_len: int) -> float:
        """The best mean next-token loss (nats) over `seq_len` targets: target t
        is one chain step from token t, whose law is uniform·Pᵗ. A model can do
        no better than the entropy of that step, averaged."""
        p = self.transition
        row_entropy = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
        law = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        total = 0.0
        for _ in range(seq_len):
            total += float(law @ row_entropy)
            law = law @ p
        return total / seq_len

    def sample(self, seeds: list[int], length: int) -> Tensor:
        """(len(seeds), length) int64 token sequences, one generator per row."""
        u = torch.stack(
            [torch.rand(length, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
        )
        out = torch.empty(len(seeds), length, dtype=torch.int64)
        out[:, 0] = (u[:, 0] * self.vocab_size).long().clamp_(max=self.vocab_size - 1)
        for t in range(1, length):
            cdf = self.cdf[out[:, t - 1]]
            out[:, t] = torch.searchsorted(cdf, u[:, t : t + 1].contiguous()).squeeze(1).clamp_(max=self.vocab_size - 1)
        return out


def read_text(spec: TextSpec) -> str:
    """The text of spec.path, read the way it was checked.

    The service checks data.path at submit, but a rank reads it later, on its own node: by then
    the file may have been swapped for a symlink (out of the roots, to /dev/zero) or a FIFO. So
    the rank resolves it again, checks it is inside a root, opens it without following a symlink
    in any component (a swap after the check fails to open), and reads it only if the opened file
    is a regular one of at most max_bytes. Newlines are translated as by Path.read_text.
    """
    real = os.path.realpath(spec.path)
    root = _root_of(real, spec)
    try:
        fd = _open_nofollow(real, root=root)
    except OSError as exc:
        swapped = exc.errno in (errno.ELOOP, errno.ENOTDIR)
        why = "a component is now a symbolic link (swapped after the check?)" if swapped else exc.strerror
        raise ValueError(f"data.path {spec.path!r}: cannot open {real}: {why}; data roots {_roots(spec)}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(
                f"data.path {spec.path!r} ({real}) is not a regular file (mode {stat.filemode(info.st_mode)}); "
                f"data roots {_roots(spec)}"
            )
        if info.st_size > spec.max_bytes:
            raise ValueError(
                f"data.path {spec.path!r} is {info.st_size} bytes, above the limit of {spec.max_bytes} bytes"
            )
        data = _read_at_most(fd, spec.max_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > spec.max_bytes:
        raise ValueError(f"data.path {spec.path!r} grew past the limit of {spec.max_bytes} bytes while it was read")
    return io.TextIOWrapper(io.BytesIO(data), encoding="utf-8").read()


def _roots(spec: TextSpec) -> list[str] | None:
    return None if spec.roots is None else [os.path.realpath(root) for root in spec.roots]


def _root_of(real: str, spec: TextSpec) -> str | None:
    """The data root that `real` (a resolved path) is inside; None when the spec has no roots."""
    roots = _roots(spec)
    if roots is None:
        return None
    for root in roots:
        if os.path.commonpath([real, root]) == root:
            return root
    raise ValueError(
        f"data.path {spec.path!r} resolves to {real}, outside the data roots {roots} "
        "(ZERO1_DATA_ROOTS; checked again where a rank reads it)"
    )


def _open_nofollow(real: str, *, root: str | None) -> int:
    """A read-only fd of `real` (a resolved path), opened component by component from `root` with
    O_NOFOLLOW (only the last component without a root), so that a component swapped for a
    symlink after the realpath check fails to open (ELOOP, ENOTDIR). O_NONBLOCK: a FIFO opens at
    once instead of waiting for a writer, and is then refused as not a regular file."""
    nofollow = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    if root is None:
        return os.open(real, nofollow | os.O_NONBLOCK)
    parts = Path(real).relative_to(root).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        try:
            child = os.open(part, nofollow | (os.O_NONBLOCK if last else os.O_DIRECTORY), dir_fd=fd)
        finally:
            os.close(fd)
        fd = child
    return fd  # the root itself when real is the root: a directory, refused by the caller


def _read_at_most(fd: int, limit_bytes: int) -> bytes:
    chunks = []
    total = 0
    while total < limit_bytes:
        chunk = os.read(fd, min(_READ_CHUNK_BYTES, limit_bytes - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


class TextSource:
    """Character-level windows of a text file; the vocabulary is its sorted characters."""

    def __init__(self, *, spec: TextSpec, vocab_size: int) -> None:
        text = read_text(spec)
        chars = sorted(set(text))
        if len(chars) > vocab_size:
            raise ValueError(f"{spec.path} has {len(chars)} distinct characters, more than vocab_size ({vocab_size})")
        index = {c: i for i, c in enumerate(chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.int64)
        self.chars = chars

    def sample(self, seeds: list[int], length: int) -> Tensor:
        if len(self.tokens) < length + 1:
            raise ValueError(f"text has {len(self.tokens)} characters, needs at least {length + 1}")
        starts = [
            int(torch.randint(0, len(self.tokens) - length + 1, (1,), generator=torch.Generator().manual_seed(s)))
            for s in seeds
        ]
        return torch.stack([self.tokens[a : a + length] for a in starts])


class TeacherSource:
    """MLP data: x ~ N(0, I), label = argmax of a fixed random linear teacher."""

    def __init__(self, *, in_features: int, num_classes: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.teacher = torch.randn(num_classes, in_features, generator=gen)
        self.in_features = in_features

    def sample(self, seeds: list[int]) -> tuple[Tensor, Tensor]:
        x = torch.stack([torch.randn(self.in_features, generator=torch.Generator().manual_seed(s)) for s in seeds])
        return x, (x @ self.teacher.T).argmax(1)


class Batches:
    """Rank r's micro-batches of each global batch."""

    def __init__(
        self,
        *,
        model: GPTSpec | MLPSpec | HFSpec,
        data: DataSource,
        seed: int,
        seq_len: int | None,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int,
        world_size: int,
    ) -> None:
        per_rank, rest = divmod(global_batch_size, world_size)
        if rest or per_rank % micro_batch_size:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a multiple of "
                f"world_size ({world_size}) x micro_batch_size ({micro_batch_size})"
            )
        self.seed = seed
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.rank = rank
        self.world_size = world_size
        self.first = rank * per_rank
        self.accumulation_steps = per_rank // micro_batch_size
        self.model = model
        if isinstance(model, MLPSpec):
            if not isinstance(data, SyntheticSpec):
                raise ValueError("an mlp model trains on synthetic data only")
            self.source = TeacherSource(in_features=model.sizes[0], num_classes=model.sizes[-1], seed=seed)
            self.seq_len = 1
        else:
            self.seq_len = model.block_size if seq_len is None else seq_len
            if isinstance(data, DatasetSpec):
                self.source = DatasetSource(
                    spec=data,
                    seq_len=self.seq_len,
                    seed=seed,
                    vocab_size=model.vocab_size,
                    global_batch_size=global_batch_size,
                    tokenizer_dir=getattr(model, "path", None),  # an hf model's directory holds its tokenizer
                )
            elif isinstance(data, TextSpec):
                self.source = TextSource(spec=data, vocab_size=model.vocab_size)
            else:
                self.source = MarkovSource(vocab_size=model.vocab_size, branching=data.branching, seed=seed)

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch_size * self.seq_len

    def micro_batch(self, step: int, micro: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of micro-batch `micro` of this rank's slice of step `step`."""
        start = self.first + micro * self.micro_batch_size
        if isinstance(self.source, DatasetSource):
            indices = range(start, start + self.micro_batch_size)
            tokens = self.source.train_block_tokens(step, indices, self.global_batch_size)
            return tokens[:, :-1], tokens[:, 1:]
        return self._samples([sample_seed(self.seed, step, i) for i in range(start, start + self.micro_batch_size)])

    def held_out_micro_batch(self, index: int) -> tuple[Tensor, Tensor]:
        """(inputs, targets) of this rank's held-out micro-batch `index` (evaluation).

        A dataset's: global held-out blocks (index * world_size + rank) * m + j, j < m, taken mod the
        number of held-out blocks. The seeded sources': samples rank·micro_batch_size .. of held-out
        step -1 - index, a stream that training (steps >= 0) never draws, so for the synthetic
        sources these are fresh samples of the same law (the MLP teacher's too), and for text fresh
        windows of the same file (the fit to that file, not a disjoint split). A seed could coincide
        with a training sample's only where (step + 1 + index)·_MIX ≡ i' - i (mod 2^63) for sample
        indices i, i'.
        """
        if isinstance(self.source, DatasetSource):
            start = (index * self.world_size + self.rank) * self.micro_batch_size
            tokens = self.source.held_out_tokens(range(start, start + self.micro_batch_size))
            return tokens[:, :-1], tokens[:, 1:]
        start = self.rank * self.micro_batch_size
        return self._samples(
            [sample_seed(self.seed, -1 - index, i) for i in range(start, start + self.micro_batch_size)]
        )

    def _samples(self, seeds: list[int]) -> tuple[Tensor, Tensor]:
        if isinstance(self.source, TeacherSource):
            return self.source.sample(seeds)
        tokens = self.source.sample(seeds, self.seq_len + 1)
        return tokens[:, :-1], tokens[:, 1:]

    def loss_floor(self) -> float | None:
        """The loss a perfect model reaches on this source (nats per target); None for real text."""
        if isinstance(self.source, MarkovSource):
            return self.source.loss_floor(self.seq_len)
        if isinstance(self.source, TeacherSource):
            return 0.0
        return None

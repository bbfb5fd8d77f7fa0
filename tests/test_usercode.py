"""The python model kind's worker side (workers/models/usercode.py): the example bundle traced and built,
and every way user code can fail named with the user's file:line.

Packages: workers.models.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from workers.config import InvalidModelError, PythonSpec
from workers.models.usercode import build_python, trace_python

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "byo-model"
TINYLM_ARGS = {"vocab_size": 512, "n_layer": 2, "n_embd": 64, "n_head": 4, "block_size": 64}


@pytest.fixture
def bundle(tmp_path, monkeypatch):
    """A bundle directory as Ray unpacks one: the working directory and first on sys.path; its
    modules forgotten afterwards (each test writes its own)."""
    root = tmp_path / "bundle"
    root.mkdir()
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root))
    yield root
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(root)):
            del sys.modules[name]


def write(root: Path, name: str, source: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))


def trace(entrypoint: str, args: dict | None = None, **kwargs):
    return trace_python(entrypoint, args or {}, precision_dtype=torch.float32, micro_batch_size=2, seq_len=16, **kwargs)


def test_the_example_traces_with_its_parameters_counted_once_and_its_vocabulary_read(bundle):
    shutil.copytree(EXAMPLE / "tinylm", bundle / "tinylm")
    traced = trace("tinylm.model:build", TINYLM_ARGS)
    real = build_python(
        PythonSpec(
            entrypoint="tinylm.model:build", args=TINYLM_ARGS, code="sha256:" + "0" * 64, vocab_size=512, block_size=64
        ),
        dtype=torch.float32,
    )
    unique = {id(p): p for p in real.parameters()}.values()  # the tied head once
    assert traced.trace.params.num_params == sum(p.numel() for p in unique)
    assert traced.trace.params.no_decay_numel == sum(p.numel() for p in unique if p.dim() < 2)
    assert traced.vocab_size == 512
    assert traced.trace.memory.activations_bytes > 0 and traced.trace.memory.temporaries_bytes > 0


def test_a_rank_builds_the_same_weights_from_the_same_seed(bundle):
    shutil.copytree(EXAMPLE / "tinylm", bundle / "tinylm")
    spec = PythonSpec(
        entrypoint="tinylm.model:build", args={}, code="sha256:" + "0" * 64, vocab_size=256, block_size=64
    )
    a, b = (build_python(spec, dtype=torch.float32, seed=3) for _ in range(2))
    c = build_python(spec, dtype=torch.float32, seed=4)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))
    assert not torch.equal(a.state_dict()["tokens.weight"], c.state_dict()["tokens.weight"])
    assert a.training


def refused(entrypoint: str, **kwargs) -> InvalidModelError:
    with pytest.raises(InvalidModelError) as info:
        trace(entrypoint, **kwargs)
    return info.value


def test_an_import_error_quotes_the_exception_and_the_users_file_and_line(bundle):
    write(bundle, "pkg/__init__.py", "")
    write(bundle, "pkg/broken.py", "import os\n\nimport no_such_module_here\n")
    error = refused("pkg.broken:build")
    assert error.field == "model.entrypoint"
    assert "importing 'pkg.broken' failed: ModuleNotFoundError: No module named 'no_such_module_here'" in error.reason
    assert error.reason.endswith("(at pkg/broken.py:3)")


def test_a_syntax_error_names_its_line(bundle):
    write(bundle, "bad.py", "def build(:\n    pass\n")
    assert "SyntaxError" in refused("bad:build").reason and refused("bad:build").reason.endswith("(at bad.py:1)")


def test_an_exception_in_the_function_is_quoted_where_it_was_raised(bundle):
    write(
        bundle,
        "model.py",
        """
        def helper(width):
            return 1 // width

        def build(width=0):
            return helper(width)
        """,
    )
    error = refused("model:build")
    assert "model:build(**args) raised: ZeroDivisionError: integer division or modulo by zero" in error.reason
    assert error.reason.endswith("(at model.py:3)")


def test_a_function_that_does_not_return_a_module_or_is_missing(bundle):
    write(bundle, "model.py", "def build():\n    return 42\n")
    assert refused("model:build").reason == "model:build returned builtins.int, not a torch.nn.Module"
    assert refused("model:nothing").reason == "module 'model' has no function 'nothing'"


def test_a_module_that_cannot_be_built_on_the_meta_device(bundle):
    write(
        bundle,
        "model.py",
        """
        import torch

        def build():
            layer = torch.nn.Linear(4, 4)
            scale = float(layer.weight.detach().abs().max())  # data: a meta tensor has none
            return torch.nn.Linear(4, int(scale) + 4)
        """,
    )
    error = refused("model:build")
    assert "model:build(**args) raised" in error.reason and error.reason.endswith("(at model.py:6)")


def test_a_forward_that_fails_on_fake_tensors_names_the_users_line(bundle):
    write(
        bundle,
        "model.py",
        """
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(32, 8)

            def forward(self, input_ids, labels):
                x = self.emb(input_ids)
                return x @ torch.ones(3, 3)  # (.., 8) @ (3, 3)

        def build():
            return Net()
        """,
    )
    error = refused("model:build")
    assert "running forward and backward on fake tensors failed" in error.reason
    assert error.reason.endswith("(at model.py:11)")


def test_the_vocabulary_is_read_off_the_embedding_of_input_ids_or_must_be_stated(bundle):
    write(
        bundle,
        "model.py",
        """
        import torch

        class OneHot(torch.nn.Module):  # no embedding: the ids are one-hot encoded
            def __init__(self, vocab):
                super().__init__()
                self.vocab = vocab
                self.proj = torch.nn.Linear(vocab, vocab)

            def forward(self, input_ids, labels):
                logits = self.proj(torch.nn.functional.one_hot(input_ids, self.vocab).float())
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())

        class WithSide(torch.nn.Module):  # two embeddings: only the one that looks up input_ids counts
            def __init__(self):
                super().__init__()
                self.side = torch.nn.Embedding(4, 8)
                self.tokens = torch.nn.Embedding(100, 8)

            def forward(self, input_ids, labels):
                x = self.tokens(input_ids) + self.side(torch.zeros_like(input_ids)).sum()
                return x.float().mean()

        def one_hot(vocab=10):
            return OneHot(vocab)

        def with_side():
            return WithSide()
        """,
    )
    assert "state vocab_size" in refused("model:one_hot").reason
    assert trace("model:one_hot", vocab_size=10).vocab_size == 10
    assert trace("model:with_side").vocab_size == 100
    error = refused("model:with_side", vocab_size=101)
    assert error.field == "model.vocab_size" and "vocab_size (101) is more than the 100 rows" in error.reason


def test_a_python_model_returning_an_object_with_loss_is_traced(bundle):
    write(
        bundle,
        "model.py",
        """
        import torch
        from types import SimpleNamespace

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.emb = torch.nn.Embedding(16, 4)

            def forward(self, input_ids, labels):
                return SimpleNamespace(loss=self.emb(input_ids).pow(2).mean(), logits=None)

        def build():
            return Net()
        """,
    )
    assert trace("model:build").trace.params.num_params == 64

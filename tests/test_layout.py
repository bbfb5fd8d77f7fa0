"""The house's layout (service and workers, every package): each package says in its opening docstring what
it holds and what it may import ("May import: ..."), and the imports keep to it; no module imports
another in a circle; no folder holds more than a dozen modules, nor a module more than 400 lines;
no assignment packs three values, or an attribute, into one line; every path and dotted name the code
and the docs cite exists; each test file names what it tests; the suite hands xdist its longest files
first (tests/ordering.py).

Packages: every one, service.main to workers.memory.
"""

from __future__ import annotations

import ast
import io
import json
import re
import tokenize
import warnings
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import pytest
from ordering import StoreDurations, file_of, longest_first, read_durations

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("service", "workers")
MAX_MODULES_PER_FOLDER = 12
MAX_LINES_PER_MODULE = 400


@cache
def modules() -> dict[str, Path]:
    """Every module of the two rooms by dotted name (a package by its own name)."""
    found = {}
    for room in ROOMS:
        for path in (ROOT / room).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


ALIASES = {"zero1": "service.client"}
"""Packages the wheel installs under another name (pyproject's package-dir): imported by that name."""


def _owner(name: str) -> str | None:
    """The module or package of the project that an imported dotted name lands in."""
    for alias, package in ALIASES.items():
        if name == alias or name.startswith(alias + "."):
            name = package + name[len(alias) :]
    while name and name not in modules():
        name = name.rpartition(".")[0]
    return name or None


@cache
def imports() -> dict[str, set[str]]:
    """What each module imports of the project: every import statement, at the top, in a function
    or under TYPE_CHECKING (a lazy import is still an arrow between two modules)."""
    graph: dict[str, set[str]] = {}
    for name, path in modules().items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {_owner(alias.name) for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                for alias in node.names:  # `from package import module` imports that module
                    targets.add(_owner(f"{base}.{alias.name}") if f"{base}.{alias.name}" in modules() else _owner(base))
        graph[name] = {t for t in targets if t and t != name}
    return graph


def _declared(name: str) -> tuple[str, list[str]] | None:
    """The nearest "May import:" above a module, and the module or package that declares it."""
    candidates = [name]
    while "." in candidates[-1]:
        candidates.append(candidates[-1].rpartition(".")[0])
    for candidate in candidates:
        if candidate in ROOMS:
            return None
        doc = ast.get_docstring(ast.parse(modules()[candidate].read_text())) or ""
        match = re.search(r"^May import: (.*)", doc, re.M | re.S)  # the docstring's last paragraph
        if match:
            text = " ".join(match.group(1).split()).rstrip(".")
            return candidate, [] if text == "the standard library only" else [a.strip() for a in text.split(",")]
    return None


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_package_and_top_level_module_says_what_it_holds_and_may_import():
    undeclared = [name for name in modules() if name not in ROOMS and _declared(name) is None]
    assert undeclared == []
    for room in ROOMS:
        for package in (ROOT / room).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(package.read_text()))
            assert doc and len(doc.split()) >= 8, f"{package.relative_to(ROOT)} needs a docstring saying what it holds"


def test_every_import_keeps_to_what_its_package_declares():
    strays = []
    for name, targets in imports().items():
        declared = _declared(name)
        if declared is None:  # service/__init__.py, workers/__init__.py: they import nothing
            assert targets == set(), name
            continue
        owner, allowed = declared
        for target in targets:
            if not _within(target, owner) and not any(_within(target, a) for a in allowed):
                strays.append(f"{name} imports {target}, which {owner} does not declare")
    assert strays == []


def test_the_rules_of_the_house():
    """service -> workers only; in workers, runtime on top and memory on the standard library."""
    edges = [(a, b) for a, targets in imports().items() for b in targets]
    assert [(a, b) for a, b in edges if _within(a, "workers") and _within(b, "service")] == []
    assert [(a, b) for a, b in edges if _within(b, "workers.runtime") and _within(a, "workers")
            and not _within(a, "workers.runtime")] == []  # fmt: skip
    assert [(a, b) for a, b in edges if _within(a, "workers.memory") and not _within(b, "workers.memory")] == []
    # nothing below the API imports it: the routes, the dashboard, the app and the CLI sit on top
    top = ("service.api", "service.dashboard", "service.main", "service.cli")
    assert [(a, b) for a, b in edges if _within(b, "service.api") and not any(_within(a, t) for t in top)] == []


def test_no_module_imports_another_in_a_circle():
    graph = imports()
    index = {}
    low = {}
    stack = []
    on_stack = set()
    circles = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert circles == []


def test_folder_and_module_sizes_guide_and_never_grow_past_half_again():
    """Past a dozen modules a folder, or 400 lines a module, the test warns: split by responsibility
    when the next change lands there, never by packing lines. Past half again (18, 600) it fails."""
    folders: dict[Path, int] = {}
    for path in modules().values():
        if path.name != "__init__.py":
            folders[path.parent] = folders.get(path.parent, 0) + 1
    folders_over = {str(f.relative_to(ROOT)): n for f, n in folders.items() if n > MAX_MODULES_PER_FOLDER}
    lines = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in modules().values()}
    modules_over = {p: n for p, n in lines.items() if n > MAX_LINES_PER_MODULE}
    for name, count in {**folders_over, **modules_over}.items():
        warnings.warn(
            f"{name}: {count}, past the guide of {MAX_MODULES_PER_FOLDER} modules / {MAX_LINES_PER_MODULE} lines",
            stacklevel=1,
        )
    assert {f: n for f, n in folders_over.items() if n > MAX_MODULES_PER_FOLDER * 3 // 2} == {}
    assert {p: n for p, n in modules_over.items() if n > MAX_LINES_PER_MODULE * 3 // 2} == {}


PACKED_FOLDERS = ("service", "workers", "benchmarks", "examples", "migrations", "tests")


def _written(target: ast.expr) -> list[ast.expr]:
    """What a target writes, through nested tuples and lists: `(a, b), self.c` writes a, b and self.c."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [w for element in target.elts for w in _written(element)]
    return _written(target.value) if isinstance(target, ast.Starred) else [target]


def test_no_packed_assignments():
    """One assignment a line: `self.a, self.b = a, b` or `x, y, z = 1, 2, 3` packs what a reader takes in
    one at a time. A swap of two names (`a, b = b, a`) and a returned pair unpacked
    (`q, r = divmod(n, d)`: its value is no tuple display) stay."""
    packed = []
    for folder in PACKED_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Tuple)):
                    continue
                if not isinstance(node.value, ast.Tuple):
                    continue
                attribute = any(isinstance(w, ast.Attribute) for w in _written(node.targets[0]))
                if len(node.value.elts) >= 3 or attribute:
                    packed.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert packed == []


_CITED_PATH = re.compile(r"(?<![\w./-])((?:service|workers)/[\w/]+\.py)\b")
_CITED_NAME = re.compile(r"(?<![\w./-])((?:service|workers)\.(?!(?:py|db)\b)[a-z_]\w*(?:\.\w+)*)")
"""A dotted name in the rooms, service.store.db or workers.memory.fit.plan (not service.py, service.db: files)."""


def _resolves(cited: str) -> bool:
    """Its longest prefix that is a module exists below the room, and what follows a package is in it."""
    parts = cited.split(".")
    for n in range(len(parts), 1, -1):
        name = ".".join(parts[:n])
        if name in modules():
            path = modules()[name]
            if n == len(parts) or path.name != "__init__.py":
                return True
            code = path.read_text().replace(ast.get_docstring(ast.parse(path.read_text()), clean=False) or "", "")
            return re.search(rf"\b{parts[n]}\b", code) is not None  # a name the package itself defines
    return False


def _cited_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "Dockerfile", ROOT / "pyproject.toml", *(ROOT / "docs").glob("*.md")]
    files += [p for p in (ROOT / "CONTRIBUTING.md",) if p.is_file()]
    for folder in ("service", "workers", "tests", "benchmarks", "migrations", "examples"):
        files += [p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    return files


def test_every_module_the_code_and_docs_cite_exists():
    """A move leaves no old path behind: in the docs, the docstrings, the wheel's list, the tests."""
    missing = set()
    for path in _cited_files():
        text = path.read_text()
        if path.suffix == ".py":  # its docstrings, comments and strings: `service` may name a variable
            text = "\n".join(
                token.string
                for token in tokenize.generate_tokens(io.StringIO(text).readline)
                if token.type in (tokenize.STRING, tokenize.COMMENT)
            )
        for cited in _CITED_PATH.findall(text):
            if not (ROOT / cited).is_file():
                missing.add(f"{path.relative_to(ROOT)}: {cited}")
        for cited in _CITED_NAME.findall(text):
            if not _resolves(cited):
                missing.add(f"{path.relative_to(ROOT)}: {cited}")
    assert sorted(missing) == []


_CITED_DOC = re.compile(r"(?<![\w/.-])((?:\.{1,2}/)*(?:[\w-]+/)*[\w-]+\.md)\b")
"""A document a text names: docs/api.md, or one beside the citing file (optimizer.md)."""


def test_no_text_cites_a_document_outside_the_repository():
    """The project stands on its own: every Markdown document a doc, docstring or comment names is a
    file of the repository (beside the citing file, or from the root or docs/), none outside it."""
    missing = set()
    for path in _cited_files():
        text = path.read_text()
        missing |= {f"{path.relative_to(ROOT)}: {m}" for m in re.findall(r"\.\./shared/[\w./-]+", text)}
        for cited in _CITED_DOC.findall(text):
            candidates = (path.parent / cited, ROOT / cited, ROOT / "docs" / cited)
            if not any(c.resolve().is_relative_to(ROOT) and c.is_file() for c in candidates):
                missing.add(f"{path.relative_to(ROOT)}: {cited}")
    assert sorted(missing) == []


def test_each_test_file_names_the_packages_it_exercises():
    packages = {name for name, path in modules().items() if path.name == "__init__.py" and "." in name}
    packages |= {name for name in modules() if name.count(".") == 1}  # service.auth, workers.config, ...
    unnamed = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if not any(re.search(rf"(?<![\w.]){re.escape(p)}(?![\w])", doc) for p in packages):
            unnamed.append(path.name)
    assert unnamed == []


def test_docs_architecture_maps_every_package():
    text = (ROOT / "docs" / "architecture.md").read_text()
    the_map = text[text.index("## The map") : text.index("### A job's path")]
    packages = [p.parent.name for p in modules().values() if p.name == "__init__.py" and p.parent.parent.name in ROOMS]
    assert [p for p in packages if f"  {p}/ " not in the_map] == []


def collected_items(*nodeids: str) -> list[SimpleNamespace]:
    return [SimpleNamespace(nodeid=nodeid) for nodeid in nodeids]


def test_files_go_longest_first_each_keeping_its_tests_order_and_an_unknown_file_sorts_as_the_median():
    collected = collected_items(
        "tests/test_a.py::one",
        "tests/test_a.py::two",
        "tests/test_b.py::one",
        "tests/test_new.py::one",
        "tests/test_c.py::one",
        "tests/test_c.py::two[x]",
        "tests/test_d.py::one",
    )
    durations = {"tests/test_a.py": 1.0, "tests/test_b.py": 50.0, "tests/test_c.py": 20.0, "tests/test_d.py": 10.0}
    ordered = [item.nodeid for item in longest_first(collected, durations)]
    assert ordered == [
        "tests/test_b.py::one",
        "tests/test_c.py::one",
        "tests/test_c.py::two[x]",
        "tests/test_new.py::one",  # the median of 1, 10, 20, 50: 15, between test_c and test_d
        "tests/test_d.py::one",
        "tests/test_a.py::one",
        "tests/test_a.py::two",
    ]
    assert sorted(ordered) == sorted(item.nodeid for item in collected)  # nothing lost nor doubled


def test_without_durations_the_collected_order_stands():
    collected = collected_items("tests/test_z.py::one", "tests/test_a.py::one", "tests/test_z.py::two")
    assert [i.nodeid for i in longest_first(collected, {})] == [
        "tests/test_z.py::one",
        "tests/test_z.py::two",
        "tests/test_a.py::one",
    ]


def test_a_passing_run_stores_each_files_summed_seconds_longest_first_and_a_failing_one_stores_nothing(tmp_path):
    path = tmp_path / "durations.json"
    store = StoreDurations(path)
    for nodeid, seconds in [("tests/test_a.py::x", 1.25), ("tests/test_b.py::y[1]", 3.0), ("tests/test_a.py::z", 2.5)]:
        for phase in ("setup", "call", "teardown"):
            store.pytest_runtest_logreport(SimpleNamespace(nodeid=nodeid, duration=seconds if phase == "call" else 0.0))
    controller = SimpleNamespace(config=SimpleNamespace())
    store.pytest_sessionfinish(controller, exitstatus=pytest.ExitCode.TESTS_FAILED)
    assert not path.exists()
    worker = SimpleNamespace(config=SimpleNamespace(workerinput={}))
    store.pytest_sessionfinish(worker, exitstatus=pytest.ExitCode.OK)
    assert not path.exists()  # a worker saw only its share
    store.pytest_sessionfinish(controller, exitstatus=pytest.ExitCode.OK)
    assert list(json.loads(path.read_text()).items()) == [("tests/test_a.py", 3.8), ("tests/test_b.py", 3.0)]
    assert read_durations(path) == {"tests/test_a.py": 3.8, "tests/test_b.py": 3.0}
    assert read_durations(tmp_path / "absent.json") == {}


def test_a_node_ids_file_is_the_part_before_its_first_double_colon():
    assert file_of("tests/test_x.py::TestY::test_z[a::b]") == "tests/test_x.py"

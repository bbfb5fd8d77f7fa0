# The two set-up commands of the README: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# zero1 is built and tested against torch 2.13.0. Where a CPU build of it lies
# on local disk (as on the development and CI machines) pip takes that; on
# other Linux machines PyPI's torch 2.13.0 is the CUDA build. To choose a CUDA
# version, point TORCH_INDEX_URL at PyTorch's wheel index for it (docs/deployment.md).
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX_URL ?=

.PHONY: install run test test-fast test-durations lint format bench clean

install: $(VENV)/.installed

# --no-compile, then compileall on every core: pip compiles one file at a time, most of an
# install's time. Compiled they must be: where PYTHONDONTWRITEBYTECODE is set (as on these
# machines) Python never writes the .pyc it compiles at import, so every process (each Ray rank,
# each `zero1` command) would compile torch again: 2.1 s of CPU for `import torch` without the
# .pyc files, 1.0 s with them. A file written for a newer Python (torch ships one for 3.12) does
# not compile and is skipped: `|| true`. The runtime dependencies install at the versions the
# image pins (docker/constraints.txt), so the venv the tests run in is the image's, whatever
# PyPI released since.
$(VENV)/.installed: pyproject.toml Makefile docker/constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --no-compile --constraint docker/constraints.txt -e '.[dev]'
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib > /dev/null || true
	touch $@

# The tour's dataset examples read the corpus the repository ships (examples/data); roots in
# ZERO1_DATA_ROOTS (comma-separated) are added to those two. `zero1 serve` itself takes the
# variable as it is: set, it replaces the default (data).
comma := ,
RUN_DATA_ROOTS := data,examples/data$(if $(ZERO1_DATA_ROOTS),$(comma)$(ZERO1_DATA_ROOTS))
run: install
	ZERO1_DATA_ROOTS="$(RUN_DATA_ROOTS)" $(BIN)/zero1 serve

# Two pytest-xdist workers, each with its own Ray cluster, a test file each at a time: on 2 cores a
# single process left the machine idle between a job's processes (a clean clone of fdc7eb1 on
# 2026-12-06: one process 838 s of tests; two workers 743 s, the machine 95% busy). PYTEST_WORKERS=0
# runs in one process (a debugger, a test's output as it happens). The files go longest first, by
# tests/durations.json (tests/ordering.py); `make test-durations` measures them again.
PYTEST_WORKERS ?= 2
PYTEST := $(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: install
	$(PYTEST)

test-durations: install
	$(PYTEST) --store-durations

# The tests that start no Ray, S3 server, PostgreSQL database, browser, slow process nor ranks (tests/marks.py):
# the API, the scheduler and the workers' code on stand-ins (tests/fakes.py).
test-fast: install
	$(PYTEST) -m "not ray and not s3 and not postgres and not browser and not slow and not ranks"

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python benchmarks/planner.py
	$(BIN)/python benchmarks/optimizer.py
	$(BIN)/python benchmarks/stages.py
	$(BIN)/python benchmarks/control_plane.py
	$(BIN)/python benchmarks/throughput.py
	$(BIN)/python benchmarks/scheduling.py
	$(BIN)/python benchmarks/checkpoint.py
	$(BIN)/python benchmarks/sweeps.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info

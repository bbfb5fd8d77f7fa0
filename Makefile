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

.PHONY: install run test lint format bench clean

install: $(VENV)/.installed

# --no-compile: Python byte-compiles each module when it is first imported (most of torch never
# is), instead of pip compiling every file of every package at install, most of an install's time
$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --no-compile $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL)) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --no-compile -e '.[dev]'
	touch $@

# The tour's dataset examples read the corpus the repository ships (examples/data); set
# ZERO1_DATA_ROOTS to choose other roots.
run: install
	ZERO1_DATA_ROOTS="$${ZERO1_DATA_ROOTS:-data,examples/data}" $(BIN)/zero1 serve

# One process by default: on 2 cores the suite is CPU-bound (most of it is Ray workers importing
# torch and training), and two pytest-xdist workers gained 12% once and took twice as long another
# time. PYTEST_WORKERS=2 runs two workers, each with its own Ray cluster, a test file each at a time.
PYTEST_WORKERS ?= 0

test: install
	$(BIN)/pytest -n $(PYTEST_WORKERS) --dist loadfile

lint: install
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .

format: install
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: install
	$(BIN)/python benchmarks/planner.py
	$(BIN)/python benchmarks/optimizer.py
	$(BIN)/python benchmarks/control_plane.py
	$(BIN)/python benchmarks/throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis *.egg-info

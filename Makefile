# Two set-up commands (see README): `make demo` and `make test`.
# Each creates .venv on first use. CPU machines pin torch to the local CPU
# build through constraints/cpu.txt; on a GPU machine install a CUDA build of
# torch into .venv first and run with `CONSTRAINTS=` (empty) to keep it.
PYTHON ?= python3
VENV ?= .venv
CONSTRAINTS ?= constraints/cpu.txt
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_CONSTRAINT_FLAG := $(if $(CONSTRAINTS),-c $(CONSTRAINTS),)

.PHONY: install demo test test-slow test-gpu test-floor bench clean

$(STAMP): pyproject.toml $(CONSTRAINTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_CONSTRAINT_FLAG) -e ".[dev,distributed]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/vlm-catalog demo

# The CPU suites run on every core (pytest-xdist; `PYTEST_WORKERS=0` runs them in this process).
# The GPU tests run in one process here, to fit any device; scripts/gpu_session.py runs them
# on four workers of an 80 GB one.
PYTEST_WORKERS ?= auto
PARALLEL := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist worksteal)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL)

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q $(PARALLEL) -m slow

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -q -m gpu

# The whole suite on the oldest versions the project declares (torch 2.11, Triton 3.6,
# transformers 5.17, Pillow 12.3: the GPU image's), in a venv of their own so .venv stays as it
# is. torch 2.11 from PyPI is a CUDA build (about 4.6 GB in the venv; it runs on CPU too), so
# the CPU constraints are not applied here.
FLOOR_VENV ?= /tmp/vlm-catalog-floor
FLOOR_PINS := 'torch==2.11.*' 'triton==3.6.*' 'transformers==5.17.*' 'pillow==12.3.*'
test-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q $(FLOOR_PINS)
	$(FLOOR_VENV)/bin/python -m pip install -q -e ".[dev]" $(FLOOR_PINS)
	$(FLOOR_VENV)/bin/python -m pytest -q $(PARALLEL)

clean:
	rm -rf $(VENV) scratch .pytest_cache

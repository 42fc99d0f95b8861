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

# The whole suite on the oldest versions the project declares: every dependency in
# pyproject.toml (and the dev extra) at its floor, the packages they pull at the newest that
# fit (uv's lowest-direct resolution; torch 2.11 with Triton 3.6, as on the GPU image), in a
# venv of their own so .venv stays as it is; the resolution is written to floor.txt there, and
# the venv holds exactly it (uv lives in a venv of its own beside it). torch 2.11 from PyPI is a
# CUDA build (about 4.6 GB in the venv; it runs on CPU too), so the CPU constraints do not apply.
FLOOR_VENV ?= /tmp/vlm-catalog-floor
FLOOR_UV := $(FLOOR_VENV)-uv/bin/uv
test-floor:
	test -x $(FLOOR_UV) || ($(PYTHON) -m venv $(FLOOR_VENV)-uv && $(FLOOR_VENV)-uv/bin/pip install -q uv)
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_UV) pip compile -q pyproject.toml --extra dev --resolution lowest-direct \
		--python $(FLOOR_VENV)/bin/python -o $(FLOOR_VENV)/floor.txt
	$(FLOOR_UV) pip sync -q --python $(FLOOR_VENV)/bin/python $(FLOOR_VENV)/floor.txt
	$(FLOOR_UV) pip install -q --python $(FLOOR_VENV)/bin/python --no-deps -e .
	$(FLOOR_VENV)/bin/python -m pytest -q $(PARALLEL)

clean:
	rm -rf $(VENV) scratch .pytest_cache

# `make test` and `make bench` set themselves up on a fresh machine with only python3 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build; on these machines it installs from a local file. An unpinned torch pulls CUDA.
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test bench lint setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench,ray]' '$(TORCH_PIN)'
	$(PY) -m compileall -q src
	touch $(STAMP)

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check src tests $(wildcard benchmarks) $(wildcard examples)
	$(PY) -m mypy
	$(PY) -m pytest -q

# Bytecode as a wheel install would leave it (an editable install leaves none, and with
# PYTHONDONTWRITEBYTECODE set every spawn/forkserver worker would compile stoker afresh).
bench: $(STAMP)
	$(PY) -m compileall -q src
	$(VENV)/bin/stoker bench
	$(PY) benchmarks/close_times.py
	$(PY) benchmarks/resume_cost.py
	$(PY) benchmarks/memory.py

lint: $(STAMP)
	$(PY) -m ruff check src tests $(wildcard benchmarks) $(wildcard examples)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# `make test` and `make bench` set themselves up on a fresh machine with only python3 and make.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build; on these machines it installs from a local file. An unpinned torch pulls CUDA.
TORCH_PIN := torch==2.13.0
# Elsewhere (another machine, or another Python here) pip takes torch from PyPI, which on Linux is
# the CUDA build (several GB with its nvidia-* wheels). `make test TORCH_INDEX=https://download.pytorch.org/whl/cpu`
# lets every pip run of the set-up also look in PyTorch's CPU index, whose torch==2.13.0+cpu then wins.
TORCH_INDEX ?=
ifneq ($(TORCH_INDEX),)
export PIP_EXTRA_INDEX_URL := $(TORCH_INDEX) $(PIP_EXTRA_INDEX_URL)
endif
# Without its dependencies: they are in the test-datasets extra, less torchvision (see pyproject.toml).
LITDATA_PIN := litdata==0.2.76
STAMP := $(VENV)/.installed
# The tests run as on a machine where PYTHONDONTWRITEBYTECODE is not set, Python caching what it
# compiles (in __pycache__, ignored by git). With it set, as on some CI images, each pytest
# process would rewrite and compile every test module again, and each worker, rank and example a
# test starts would compile what it imports. The benchmarks run in the environment as found.
TEST_ENV := env -u PYTHONDONTWRITEBYTECODE
# What make test takes on a fresh clone of a quiet 2-core machine, set-up included (printed as it starts).
TEST_MINUTES := 30

# pytest-xdist: one worker per core, at most 4 (each test starts worker processes of its own).
# Each test file runs whole on one worker, so that a module's fixture (a framework's two-rank
# launch) and the Ray cluster session (every test that needs it is in tests/ray/test_cluster.py)
# start once. (`--dist loadgroup` with xdist_group marks does not group with pytest 9.2 and
# pytest-xdist 3.8: xdist writes the group into `item._nodeid`, which pytest 9 no longer reads, so
# every module fixture would start once per worker.)
PYTEST_WORKERS := -n auto --maxprocesses 4 --dist loadfile

# The user-install tier: a venv holding only what `pip install 'stoker[torch,stream,parquet,jax,arrayrecord]'`
# brings (no s3fs, boto3 or moto, which the test extras install), plus the test runner and
# psutil (the suite's leak check). Its dependencies are installed once per change of
# pyproject.toml; this checkout is installed into it as a wheel on every run.
USER_VENV := build/user-venv
USER_PY := $(USER_VENV)/bin/python
USER_STAMP := $(USER_VENV)/.installed
USER_TESTS := tests/user tests/shards/test_relay.py tests/shards/test_elastic.py

# The JAX user tier: a venv holding only `pip install 'stoker[jax]'` and Orbax (which the JAX
# guide tells users to install beside it), no torch, plus the test runner and psutil; it runs the
# JAX guide's examples as written (tests/user/test_user_jax.py, STOKER_USER_TIER=jax).
JAX_PIN := jax==0.10.2
ORBAX_PIN := orbax-checkpoint==0.12.8
USER_JAX_VENV := build/user-jax-venv
USER_JAX_PY := $(USER_JAX_VENV)/bin/python
USER_JAX_STAMP := $(USER_JAX_VENV)/.installed

# The core suite on the other Pythons users run (3.10, 3.12, 3.13; `make test` runs 3.11). torch's
# CPU wheel is a local file for 3.11 only (an unpinned torch would pull a multi-GB CUDA build), so
# each of these venvs holds what needs no torch: numpy, the shards' and progress extras, the test
# runner, psutil (the leak check), hypothesis, moto (the S3 server on loopback), s3fs (the fsspec
# client's S3) and webdataset (the shard tests read with it). The tiers below run whole: a test
# that needs torch, PIL or a framework skips itself (pytest.importorskip), so a new test joins by
# being placed in a tier, and one that imports torch unguarded fails here, as a user's would.
# Made once per change of pyproject.toml; the checkout is installed editable, so each run tests
# the tree as it is. An interpreter is found in pyenv's versions, else on PATH (python3.10 ...).
PYTHONS := 3.10 3.12 3.13
PYENV_ROOT ?= $(HOME)/.pyenv
CORE_TESTS := tests/unit tests/integration tests/faults tests/shards tests/mix
python_for = $(or $(lastword $(sort $(wildcard $(PYENV_ROOT)/versions/$(1).*/bin/python$(1)))),python$(1))

.PHONY: test bench lint typecheck pytest user-tier user-tier-jax test-pythons $(addprefix test-python,$(PYTHONS)) coverage docs docs-strict setup clean

# The test environment is installed by uv (itself from PyPI, into the venv), which unpacks the
# ~180 packages in parallel where pip unpacks one at a time. uv reads no pip configuration, so it is
# handed the sources pip's configuration names (its files and PIP_* variables: find-links,
# index-url, extra-index-url, constraint; on these machines torch's CPU wheel is a local file
# named by find-links), and, like pip, takes the best version any of them has. The user tiers
# below install with pip, as the documentation says.
# compileall then writes the bytecode on every core (uv writes none).
# Skipped: a file of torch's test helpers written for Python 3.12 only.
UV_PIN := uv==0.13.9
UV_INSTALL = $(VENV)/bin/uv pip install --quiet --python $(PY) --index-strategy unsafe-best-match $$($(PY) -c "$$PIP_SOURCES")
define PIP_SOURCES
import subprocess, sys
flags = {"find-links": "--find-links", "index-url": "--index-url", "extra-index-url": "--extra-index-url", "constraint": "--constraint"}
listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
out = []
for line in listed.splitlines():
    key, _, value = line.partition("=")
    flag = flags.get(key.rsplit(".", 1)[-1])
    for source in value.strip("'").split() if flag else ():
        if source not in out:
            out += [flag, source]
print(" ".join(out))
endef
export PIP_SOURCES

$(STAMP): pyproject.toml benchmarks/pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip '$(UV_PIN)'
	$(UV_INSTALL) -e '.[test,test-frameworks,test-datasets,test-jax,bench,ray,vision,docs,stream,parquet]' '$(TORCH_PIN)'
	$(UV_INSTALL) --no-deps '$(LITDATA_PIN)'
	$(UV_INSTALL) --no-deps -e benchmarks
	$(PY) -m compileall -q -j 0 -x '/torch/testing/_internal/py312' \
		"$$($(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" src
	touch $(STAMP)

setup: $(STAMP)

# Each user venv also gets pyproject.toml's [build-system] requires, once: the checkout's wheel is
# then built with them on every run (--no-build-isolation) from this tree alone (--no-index), so
# a second run needs no network.
BUILD_REQUIRES := $(shell sed -n '/^\[build-system\]/,/^\[/s/^requires = \[\(.*\)\]$$/\1/p' pyproject.toml | tr ',' ' ')
INSTALL_CHECKOUT := -m pip install --quiet --no-deps --force-reinstall --no-build-isolation --no-index .

$(USER_STAMP): pyproject.toml
	rm -rf $(USER_VENV)
	$(PYTHON) -m venv $(USER_VENV)
	$(USER_PY) -m pip install --quiet --upgrade pip
	$(USER_PY) -m pip install --quiet '.[torch,stream,parquet,jax,arrayrecord]' '$(TORCH_PIN)' pytest pytest-timeout psutil \
		$(BUILD_REQUIRES)
	touch $(USER_STAMP)

# The moto server runs from the test environment's interpreter (STOKER_S3_SERVER_PYTHON).
user-tier: $(STAMP) $(USER_STAMP)
	$(USER_PY) $(INSTALL_CHECKOUT)
	$(TEST_ENV) STOKER_USER_TIER=1 STOKER_S3_SERVER_PYTHON=$(abspath $(PY)) $(USER_PY) -m pytest -q -p no:cacheprovider $(USER_TESTS)

$(USER_JAX_STAMP): pyproject.toml
	rm -rf $(USER_JAX_VENV)
	$(PYTHON) -m venv $(USER_JAX_VENV)
	$(USER_JAX_PY) -m pip install --quiet --upgrade pip
	$(USER_JAX_PY) -m pip install --quiet '.[jax]' '$(JAX_PIN)' '$(ORBAX_PIN)' pytest pytest-timeout psutil \
		$(BUILD_REQUIRES)
	touch $(USER_JAX_STAMP)

# After user-tier, not beside it: each builds the checkout's wheel in ./build.
user-tier-jax: $(STAMP) $(USER_JAX_STAMP)
	$(USER_JAX_PY) $(INSTALL_CHECKOUT)
	$(TEST_ENV) STOKER_USER_TIER=jax $(USER_JAX_PY) -m pytest -q -p no:cacheprovider tests/user/test_user_jax.py

build/py%/.installed: pyproject.toml
	rm -rf build/py$*
	$(call python_for,$*) -m venv build/py$*
	build/py$*/bin/python -m pip install --quiet --upgrade pip
	build/py$*/bin/python -m pip install --quiet -e '.[stream,parquet,progress]' \
		pytest pytest-timeout pytest-xdist psutil hypothesis 'moto[server]' s3fs webdataset
	touch $@

# One Python's core suite: `make test-python3.12`. Each run prints its wall time. A Python that is
# not installed is skipped with a line that says so, and fails nothing.
$(addprefix test-python,$(PYTHONS)): test-python%:
	@if $(call python_for,$*) -c '' >/dev/null 2>&1; then \
		$(MAKE) -q build/py$*/.installed || $(MAKE) --no-print-directory build/py$*/.installed; fi
	@if ! $(call python_for,$*) -c '' >/dev/null 2>&1; then \
		echo "SKIPPED the core suite on Python $*: no python$* in $(PYENV_ROOT)/versions/$*.*/bin or on PATH" \
			"(install Python $*, e.g. pyenv install $*, to run it)"; \
		exit 0; \
	fi; \
	start=$$(date +%s); \
	$(TEST_ENV) build/py$*/bin/python -m pytest -q -p no:cacheprovider $(PYTEST_WORKERS) $(CORE_TESTS) \
		&& echo "core suite on Python $*: $$(( $$(date +%s) - start )) s"

# One after another (each uses every core); every Python runs, then any failure fails the goal.
test-pythons:
	@failed=""; for v in $(PYTHONS); do $(MAKE) --no-print-directory test-python$$v || failed="$$failed $$v"; done; \
	if [ -n "$$failed" ]; then echo "the core suite failed on Python$$failed"; exit 1; fi

# Lint, type check, tests and the strict docs build run side by side: on a fresh clone the type
# check alone takes ~35 s of one core (it reads torch's stubs); so does the user-install tier.
# Each tier's wall time is written to build/tier-times/ and printed when make test ends, passed or
# failed (the figures in the README's getting started come from these lines). The guide pages the
# user tiers run as written (shards, mixing and packing, JAX) are not run a second time by pytest's
# docs test (STOKER_USER_TIERS_RUN_GUIDES, tests/test_docs.py).
TIMES := build/tier-times
test:
	@rm -rf $(TIMES); mkdir -p $(TIMES); date +%s > $(TIMES)/.start
	@echo "make test: about $(TEST_MINUTES) min on a quiet 2-core machine (the first run also builds three venvs)"
	@rc=0; $(MAKE) --no-print-directory timed-setup || rc=$$?; \
	if [ $$rc -eq 0 ]; then \
		STOKER_USER_TIERS_RUN_GUIDES=1 $(MAKE) --no-print-directory -j4 -k timed-lint timed-typecheck timed-pytest timed-docs-strict timed-user-tier || rc=$$?; \
		$(MAKE) --no-print-directory timed-user-tier-jax || rc=$$?; \
	fi; \
	echo; echo "make test, wall time per tier (side by side: lint, typecheck, pytest, docs-strict, user-tier):"; \
	for f in setup lint typecheck pytest docs-strict user-tier user-tier-jax; do \
		[ -f $(TIMES)/$$f ] && cat $(TIMES)/$$f; done; \
	echo "  total            $$(( $$(date +%s) - $$(cat $(TIMES)/.start) )) s"; \
	exit $$rc

# `make timed-X`: make X, and write its wall time and outcome to $(TIMES)/X.
timed-%:
	@mkdir -p $(TIMES); start=$$(date +%s); rc=0; $(MAKE) --no-print-directory $* || rc=$$?; \
	printf '  %-16s %5d s  %s\n' "$*" $$(( $$(date +%s) - start )) "$$( [ $$rc -eq 0 ] && echo passed || echo FAILED)" > $(TIMES)/$*; \
	exit $$rc

typecheck: $(STAMP)
	$(PY) -m mypy

pytest: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q $(PYTEST_WORKERS)

# Line coverage of the package by the whole suite (the main test processes; not the workers
# and ranks they start), as the note of each change that moves or removes tests compares it.
coverage: $(STAMP)
	$(TEST_ENV) $(PY) -m pytest -q $(PYTEST_WORKERS) --cov=stoker --cov-report=term --cov-report=json:build/coverage.json

# Bytecode as a wheel install would leave it (an editable install leaves none, and with
# PYTHONDONTWRITEBYTECODE set every spawn/forkserver worker would compile stoker and the
# harness's workloads afresh). benchmarks/run.py is the harness (benchmarks/stoker_bench). What the
# benchmarks make stays in the clone (bench-results/, and under build/ the JPEGs of W9 and W12, the
# mix corpus and MosaicML Streaming's venv); a second run needs no network. Progress bars (tqdm's,
# the harness's and those of the libraries it runs) are off when stderr is not a terminal.
ifeq ($(shell [ -t 2 ] && echo terminal),)
bench: export TQDM_DISABLE := 1
endif
bench: $(STAMP)
	@echo "make bench: about 35 min on 2 cores; each benchmark prints its table when it ends"
	$(PY) -m compileall -q src benchmarks/stoker_bench
	$(PY) benchmarks/run.py
	$(PY) benchmarks/close_times.py
	$(PY) benchmarks/resume_cost.py
	$(PY) benchmarks/state_cost.py
	$(PY) benchmarks/memory.py
	$(PY) benchmarks/kept_fields.py
	$(PY) benchmarks/trainer_step.py
	$(PY) benchmarks/shards_bench.py
	$(PY) benchmarks/mix_bench.py
	$(PY) benchmarks/cpu_normalize_faults.py
	$(PY) benchmarks/pack_rows_speed.py
	$(PY) benchmarks/jax_feed.py

# The documentation site (docs/, mkdocs.yml) into build/site. --strict: a broken link or anchor,
# a page left out of the nav, an unresolved API reference or a missing snippet fails.
MKDOCS := NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs
docs: $(STAMP)
	$(MKDOCS) build

docs-strict: $(STAMP)
	$(MKDOCS) build --strict --quiet

lint: $(STAMP)
	$(PY) -m ruff check src tests $(wildcard benchmarks) $(wildcard examples)
	$(PY) -m ruff format --check src tests $(wildcard benchmarks) $(wildcard examples)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

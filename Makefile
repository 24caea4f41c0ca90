# Two commands for a fresh machine: `make demo` and `make test`. Both install first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# constraints.txt pins every dependency to versions known to work together here; it pins
# torch to the CPU build (a bare `torch` would pull a multi-GB CUDA build).
STAMP  := $(VENV)/.installed
# the oldest-versions environment (constraints-oldest.txt): Python 3.10, the floors of
# pyproject's ranges; pyenv's 3.10 where there is one, else python3.10 on the PATH
OLDEST_PYTHON ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.10*/bin/python3.10) python3.10)
OLDEST_VENV   ?= .venv-oldest
OLDEST_STAMP  := $(OLDEST_VENV)/.installed
# the backend conformance suites the oldest environment runs (no torch: see constraints-oldest.txt)
OLDEST_TESTS  := tests/test_backends.py tests/test_backend_jax.py tests/test_backend_tensorflow.py \
	tests/test_jax_laplacian.py tests/test_tf_laplacian.py tests/test_jax_forward_hessian.py \
	tests/test_hessian.py tests/test_tunecache.py tests/test_cache_trust.py \
	tests/test_once_differentiable.py tests/test_api.py tests/test_validate.py \
	tests/test_compat_jax.py tests/test_compat_tensorflow.py

.PHONY: install install-oldest demo test test-oldest lint bench bench-quick mutate clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[all,dev]"
	# the bytecode a wheel install writes (an editable install leaves it to the first import,
	# which PYTHONDONTWRITEBYTECODE forbids: each process then compiles batchjac's modules)
	$(PY) -m compileall -q src/batchjac
	touch $(STAMP)

install: $(STAMP)

$(OLDEST_STAMP): pyproject.toml constraints-oldest.txt
	$(OLDEST_PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(OLDEST_VENV)/bin/python -m pip install -q -c constraints-oldest.txt -e ".[tensorflow,jax]" \
		pytest hypothesis scipy psutil pandas equinox pytest-xdist
	# (batchjac's bytecode for this Python too, as for the main environment's)
	$(OLDEST_VENV)/bin/python -m compileall -q src/batchjac
	touch $(OLDEST_STAMP)

install-oldest: $(OLDEST_STAMP)

demo: install
	$(VENV)/bin/batchjac demo

lint: install
	$(PY) -m ruff check src tests
	$(PY) -m mypy

# branch coverage of the package (settings and the threshold in pyproject.toml [tool.coverage]);
# in two processes (pytest-xdist), each test file whole in one of them (its fixtures shared);
# then the oldest versions (test-oldest)
test: lint
	$(PY) -m pytest -n auto --maxprocesses 2 --dist loadfile --cov=batchjac --cov-branch \
		--cov-report=term:skip-covered
	$(MAKE) test-oldest

# the versions pyproject claims at their floors: the backend conformance suites on the oldest
# jax, TensorFlow and numpy the extras allow, on Python 3.10 (README: "Versions"); part of
# `make test`. What those versions lack is skipped, each skip declared in tests/conftest.py
# (EXPECTED_SKIPS): torch (no CPU build for Python 3.10 here), zarr 3 and pyarrow (batchjac[io]
# needs Python 3.11), and the JAX builds whose XLA options jaxlib 0.4.36 refuses; any other skip
# fails the run. About 2-3 minutes on 2 cores, install included
test-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -m pytest -n auto --maxprocesses 2 --dist loadfile -p no:cacheprovider \
		$(OLDEST_TESTS)

# mutation testing of the core modules with their own tests ([tool.mutmut]); CPU heavy, not in
# CI: `mutmut results` lists the survivors, `mutmut show NAME` one of them
# (the venv's bin on PATH: mutmut runs mypy, its type_check_command, by name)
mutate: install
	PATH="$(abspath $(VENV))/bin:$$PATH" $(VENV)/bin/mutmut run
	$(VENV)/bin/mutmut results

bench: install
	$(VENV)/bin/batchjac bench --output BENCHMARKS.md

bench-quick: install
	$(VENV)/bin/batchjac bench --quick --output bench-out/BENCHMARKS-quick.md

clean:
	rm -rf $(VENV) $(OLDEST_VENV) mutants .coverage build *.egg-info src/*.egg-info .pytest_cache .ruff_cache .mypy_cache

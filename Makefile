# Two commands for a fresh machine: `make demo` and `make test`. Both install first.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# constraints.txt pins every dependency to versions known to work together here; it pins
# torch to the CPU build (a bare `torch` would pull a multi-GB CUDA build).
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint bench bench-quick mutate clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[all,dev]"
	# the bytecode a wheel install writes (an editable install leaves it to the first import,
	# which PYTHONDONTWRITEBYTECODE forbids: each process then compiles batchjac's modules)
	$(PY) -m compileall -q src/batchjac
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/batchjac demo

lint: install
	$(PY) -m ruff check src tests
	$(PY) -m mypy

# branch coverage of the package (settings and the threshold in pyproject.toml [tool.coverage]);
# in two processes (pytest-xdist), each test file whole in one of them (its fixtures shared)
test: lint
	$(PY) -m pytest -n auto --maxprocesses 2 --dist loadfile --cov=batchjac --cov-branch \
		--cov-report=term:skip-covered

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
	rm -rf $(VENV) mutants .coverage build *.egg-info src/*.egg-info .pytest_cache .ruff_cache .mypy_cache

"""Session set-up shared by every test module.

The tuning cache (:mod:`batchjac._tune.cache`) remembers decisions in a per-user directory,
``~/.cache/batchjac`` by default. Tests must neither write into the developer's (or the CI
machine's) cache nor read decisions left there by earlier runs, which would make their timings
and choices depend on history. So, before any test module is collected, ``BATCHJAC_CACHE_DIR``
points at a fresh temporary directory, in ``os.environ`` so that subprocesses inherit it; it is
removed at the end of the session.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

#: the session's cache directory (None outside a test session)
SESSION_CACHE_DIR: str | None = None
_PREVIOUS: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global SESSION_CACHE_DIR, _PREVIOUS
    _PREVIOUS = os.environ.get("BATCHJAC_CACHE_DIR")
    SESSION_CACHE_DIR = tempfile.mkdtemp(prefix="batchjac-tunecache-")
    os.environ["BATCHJAC_CACHE_DIR"] = SESSION_CACHE_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    global SESSION_CACHE_DIR
    if SESSION_CACHE_DIR is None:
        return
    shutil.rmtree(SESSION_CACHE_DIR, ignore_errors=True)
    if _PREVIOUS is None:
        os.environ.pop("BATCHJAC_CACHE_DIR", None)
    else:
        os.environ["BATCHJAC_CACHE_DIR"] = _PREVIOUS
    SESSION_CACHE_DIR = None


@pytest.fixture(autouse=True)
def _own_tuning_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test its own cache directory: a decision one test's race wrote must not change what
    a later test's first call does (tests would depend on their order)."""
    monkeypatch.setenv("BATCHJAC_CACHE_DIR", str(tmp_path_factory.mktemp("tunecache")))


@pytest.fixture(autouse=True)
def _no_siblings() -> None:
    """Models of identical code share what binding taught (batchjac._bind): tests build such
    models independently and must not inherit each other's ledgers and decisions."""
    from batchjac import _bind, _twins

    _bind._SIBLINGS.clear()
    _twins.forget()  # (and a new function object of a finished test's code is not its twin)


#: skips the suite expects, by the reason pytest reports: everything else that is skipped (a
#: framework that failed to install, a module skipped whole) fails the run, so that a green
#: ``make test`` means every promise was tested
EXPECTED_SKIPS: dict[str, str] = {
    # none in the main environment: the permission tests that root used to skip run in a child
    # process without the DAC capabilities (tests/helpers.py without_dac_capabilities)
}


def _oldest_pin(name: str) -> str | None:
    """The version constraints-oldest.txt pins ``name`` to."""
    path = Path(__file__).resolve().parents[1] / "constraints-oldest.txt"
    for line in path.read_text().splitlines():
        if line.strip().lower().startswith(f"{name}=="):
            return line.strip().split("==", 1)[1]
    return None


#: ... and those of the oldest-versions environment (constraints-oldest.txt, `make test-oldest`),
#: by what its versions lack; each reason names that environment's own version, never the main's
if sys.version_info < (3, 11):
    EXPECTED_SKIPS.update({
        "could not import 'torch'": "no CPU build of torch for Python 3.10 on the project's "
                                    "machines (constraints-oldest.txt)",
        "could not import 'zarr'": "zarr 3, the floor of batchjac[io] and [dask], needs Python 3.11",
        "could not import 'pyarrow'": "batchjac[io] (zarr 3) does not install on Python 3.10",
        "could not import 'flax": "flax (Flax NNX and Linen models, a dev dependency) is not "
                                  "installed in this environment: flax 0.12 needs jax >= 0.10",
        "could not import 'haiku'": "dm-haiku (Haiku models, a dev dependency) is not installed "
                                    "in this environment, which installs the backends' extras "
                                    "and the test tools only (Makefile, test-oldest)",
    })
EXPECTED_SKIPS[f"this XLA (jaxlib {_oldest_pin('jaxlib')}) refuses"] = (
    "the oldest jaxlib's XLA knows neither YNNPACK's fusion type nor the fusion emitters: no "
    '"no-ynnpack" or "quick" build to test (tests/test_backend_jax.py needs_build)')


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    unexpected = []
    for report in reporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(expected in reason for expected in EXPECTED_SKIPS):
            unexpected.append(f"{report.nodeid}: {reason}")
    if unexpected:
        reporter.write_line("undeclared skips (declare them in tests/conftest.py EXPECTED_SKIPS, "
                            "or install what they need):", red=True)
        for line in unexpected:
            reporter.write_line(f"  {line}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED

"""The versions pyproject claims are the versions CI runs: each framework's floor (and numpy's,
and Python's) is what the oldest environment pins (constraints-oldest.txt, `make test-oldest`),
and torch's, which has no CPU build for that Python here, is the main environment's pin."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^\s;]+)", line.strip())
        if match:
            pins[match.group(1).lower().replace("_", "-")] = match.group(2)
    return pins


def _floors() -> dict[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    floors = {}
    for name in ("numpy", "tensorflow-cpu", "tensorflow", "jax", "torch"):
        found = set(re.findall(rf'"{re.escape(name)}>=([0-9][0-9.]*)', text))
        assert len(found) == 1, (name, found)
        floors[name] = found.pop()
    python = re.search(r'requires-python = ">=([0-9.]+)"', text)
    assert python is not None
    floors["python"] = python.group(1)
    return floors


def _same_release(floor: str, pin: str) -> bool:
    """``2.19`` is the floor of the pin ``2.19.0``; ``0.4.36`` of ``0.4.36``."""
    parts, pinned = floor.split("."), pin.split(".")
    return pinned[:len(parts)] == parts and all(p == "0" for p in pinned[len(parts):])


def test_the_floors_are_what_the_oldest_environment_runs() -> None:
    floors, oldest, main = _floors(), _pins("constraints-oldest.txt"), _pins("constraints.txt")
    assert _same_release(floors["numpy"], oldest["numpy"]), (floors["numpy"], oldest["numpy"])
    assert _same_release(floors["jax"], oldest["jax"]), (floors["jax"], oldest["jax"])
    assert oldest["jaxlib"] == oldest["jax"]
    assert floors["tensorflow-cpu"] == floors["tensorflow"]
    assert _same_release(floors["tensorflow-cpu"], oldest["tensorflow-cpu"])
    assert _same_release(floors["torch"], main["torch"].split("+")[0]), (floors["torch"], main["torch"])
    assert "torch" not in oldest
    makefile = (ROOT / "Makefile").read_text()
    assert f"versions/{floors['python']}*" in makefile  # the oldest environment's Python
    # ... and CI runs it: `make test` (.ci/run) ends with the oldest environment's suites
    test = re.search(r"^test:.*\n((?:\t.*\n)+)", makefile, re.M)
    assert test is not None
    assert "$(MAKE) test-oldest" in test.group(1), test.group(1)

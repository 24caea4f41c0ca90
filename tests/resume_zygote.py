"""Start ``batchjac compute`` (or ``solve``) runs as real processes quickly, to kill them with SIGKILL.

Importing TensorFlow takes seconds, so a *zygote* process imports it (and batchjac) once, runs
nothing, and forks one child per run: each child is a separate process running
``batchjac compute ARGS`` from its first line, as the command line would, and is killed with
a real SIGKILL. (Forking before any TensorFlow op runs is safe: no runtime threads exist yet.)

Used by tests/test_resume.py and scripts/resume_trials.py. A run may also kill itself at a
chosen point: the ``nth`` call of a function (``"os:replace"``, or
``"batchjac._stores.formats:ZarrFormat.commit"``), before or after it runs, optionally counting only
calls made ``within`` another function, e.g. the renames inside a format's ``commit``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class Run:
    pid: int
    log: Path
    zygote: Zygote

    def wait(self) -> int:
        """The exit code, or minus the signal that killed it."""
        return self.zygote.wait(self.pid)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text() if self.log.exists() else ""


class Zygote:
    def __init__(self, preload: tuple[str, ...] = ("tensorflow", "keras")) -> None:
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore"}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", __file__, *preload], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        assert self.proc.stdout is not None
        ready = self.proc.stdout.readline()
        if ready.strip() != "ready":
            raise RuntimeError(f"zygote failed to start: {ready!r}")

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def start(self, args: list[str], log: Path, kill_at: dict[str, Any] | None = None,
              command: str = "compute") -> Run:
        """Run ``batchjac COMMAND ARGS`` (compute or solve) in a forked child."""
        reply = self._ask({"args": args, "log": str(log), "kill_at": kill_at, "command": command})
        return Run(reply["pid"], log, self)

    def wait(self, pid: int) -> int:
        return int(self._ask({"wait": pid})["status"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        self.proc.stdin.close()  # the zygote ends when its input does
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


def count_done(out: Path) -> int:
    done = Path(str(out) + ".partial") / "done"
    try:
        return sum(1 for name in os.listdir(done) if name.endswith(".json"))
    except FileNotFoundError:
        return 0


def tree(out: Path) -> dict[str, bytes]:
    """Every file a finished output occupies, by name relative to its folder, and its bytes."""
    from batchjac import _stores

    from .store_conformance import tree as files_of

    return files_of(_stores.store_format(out), out)


def kill_when(run: Run, out: Path, done: int, extra_delay: float, timeout: float = 120) -> int:
    """SIGKILL ``run`` once ``done`` chunks are recorded, ``extra_delay`` seconds later (or when
    it ends by itself); return how many chunks were recorded when it was killed."""
    deadline = time.monotonic() + timeout
    while count_done(out) < done and time.monotonic() < deadline:
        if _exited(run.pid):
            break
        time.sleep(0.0005)
    time.sleep(extra_delay)
    run.kill()
    return count_done(out)


def _exited(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


# -- the zygote process ---------------------------------------------------------------------

def _arm(spec: dict[str, Any]) -> None:
    import importlib

    def resolve(target: str) -> tuple[Any, str]:
        module, _, attr = target.partition(":")
        owner: Any = importlib.import_module(module)
        *path, name = attr.split(".")
        for part in path:
            owner = getattr(owner, part)
        return owner, name

    state = {"count": 0, "inside": 0}
    owner, name = resolve(spec["target"])
    original = getattr(owner, name)
    nth, after = int(spec.get("nth", 1)), bool(spec.get("after", False))

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        counting = state["inside"] > 0 or not spec.get("within")
        if counting:
            state["count"] += 1
        hit = counting and state["count"] == nth
        if hit and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if hit and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, name, wrapped)
    if spec.get("within"):
        w_owner, w_name = resolve(spec["within"])
        w_original = getattr(w_owner, w_name)

        def within(*args: Any, **kwargs: Any) -> Any:
            state["inside"] += 1
            try:
                return w_original(*args, **kwargs)
            finally:
                state["inside"] -= 1

        setattr(w_owner, w_name, within)


def _child(request: dict[str, Any]) -> None:
    fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    code = 1
    try:
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        if request.get("kill_at"):
            _arm(request["kill_at"])
        if request.get("command") == "solve":
            from batchjac.cli.solve import solve as command
        else:
            from batchjac.cli.compute import compute as command

        try:
            command.main(request["args"], prog_name=f"batchjac {command.name}")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve(preload: list[str]) -> None:
    import importlib

    for name in preload:
        importlib.import_module(name)
    import batchjac._loaders
    import batchjac._stores
    import batchjac.cli  # noqa: F401

    for name in ("zarr", "h5py", "pyarrow.csv"):
        importlib.import_module(name)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    for line in sys.stdin:
        request = json.loads(line)
        if "wait" in request:
            _, status = os.waitpid(int(request["wait"]), 0)
            code = os.waitstatus_to_exitcode(status)
            out.write(json.dumps({"status": code}) + "\n")
        else:
            pid = os.fork()
            if pid == 0:
                _child(request)
            out.write(json.dumps({"pid": pid}) + "\n")
        out.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])

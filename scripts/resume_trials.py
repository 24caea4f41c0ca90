"""Crash-safe resume, the long experiment: ``batchjac compute`` killed with SIGKILL at random
moments, then run again, compared byte for byte with an uninterrupted run.

Each trial picks an output format (Zarr, HDF5, .npy, in turn) and kills the same command 1-3
times, each at a random moment of its writing: mostly drawn uniformly from the time its
remaining chunks take (from its first newly recorded chunk; the time is estimated from an
uninterrupted run), sometimes from the start of the store (creating it, compiling), with a
margin past the end (the commit, removing the work directory). Then it runs the command to
completion. A trial passes when

- after every kill, whatever exists under the output's name is complete and final;
- the completing run resumed exactly the chunks recorded before it (none computed twice);
- the finished output is bitwise identical to the uninterrupted run's (every file), and no
  work directory is left behind.

Every run is a fresh ``python -m batchjac compute ...`` process (``--fast`` forks them from a
zygote that has imported TensorFlow, as tests/test_resume.py does).

    python scripts/resume_trials.py --trials 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.resume_zygote import Zygote, count_done, tree  # noqa: E402

SUFFIXES = (".zarr", ".h5", ".npy")


class Runner:
    """Starts ``batchjac compute`` runs: fresh interpreters, or forks of a zygote."""

    def __init__(self, fast: bool) -> None:
        self.zygote = Zygote() if fast else None

    def start(self, args: list[str], log: Path) -> Any:
        if self.zygote is not None:
            return self.zygote.start(args, log)
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
        handle = open(log, "w")  # noqa: SIM115 - closed in wait()
        proc = subprocess.Popen([sys.executable, "-m", "batchjac", "compute", *args],
                                stdout=handle, stderr=subprocess.STDOUT, env=env)
        return _Proc(proc, handle, log)

    def close(self) -> None:
        if self.zygote is not None:
            self.zygote.close()


class _Proc:
    def __init__(self, proc: subprocess.Popen[bytes], handle: Any, log: Path) -> None:
        self.proc, self.handle, self.log, self.pid = proc, handle, log, proc.pid

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)

    def wait(self) -> int:
        code = self.proc.wait()
        self.handle.close()
        return code

    def output(self) -> str:
        return self.log.read_text()


def phase(out: Path) -> str:
    work = Path(str(out) + ".partial")
    if out.exists():
        if work.exists():
            return "committed, work dir not yet removed"
        if list(out.parent.glob(out.name + ".partial.removed-*")):
            return "committed, deleting the work dir"
        return "finished"
    if not work.exists():
        return "not started"
    if not (work / "manifest.json").exists():
        return "creating the store"
    return f"{count_done(out)} chunks recorded"


def compare(out: Path, ref: dict[str, bytes], ref_name: str) -> bool:
    got = {k.replace(out.stem, "ref", 1): v for k, v in tree(out).items()}
    return got == ref


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=12)
    p.add_argument("--rows", type=int, default=50000)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--fast", action="store_true", help="fork runs from a zygote (TensorFlow imported once)")
    args = p.parse_args()
    rng = random.Random(args.seed)
    runner = Runner(args.fast)
    tmp = Path(tempfile.mkdtemp(prefix="batchjac-trials-"))
    try:
        results = run_trials(runner, tmp, args, rng)
    finally:
        runner.close()
        shutil.rmtree(tmp, ignore_errors=True)
    passed = sum(r["ok"] for r in results)
    kills = sum(len(r["kills"]) for r in results)
    print(f"\n{passed}/{len(results)} trials passed ({kills} SIGKILLs in all).")
    print("RESUME-JSON " + json.dumps(results))
    sys.exit(0 if passed == len(results) else 1)


def run_trials(runner: Runner, tmp: Path, args: argparse.Namespace,
               rng: random.Random) -> list[dict[str, Any]]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    from batchjac.examples import workload_inputs

    u, k = workload_inputs("W1", args.rows, seed=3)
    np.save(tmp / "u.npy", u)
    np.save(tmp / "k.npy", k)
    subprocess.run([sys.executable, "-c", "import sys; from batchjac.examples import seed_model; "
                    "seed_model('tensorflow').save(sys.argv[1])", str(tmp / "seed.keras")],
                   check=True, capture_output=True)
    base = [str(tmp / "seed.keras"), "-i", str(tmp / "u.npy"), "-k", str(tmp / "k.npy"),
            "--chunk-size", str(args.chunk_size), "--with-outputs", "-q", "--json"]

    refs: dict[str, tuple[dict[str, bytes], float]] = {}
    for suffix in SUFFIXES:  # uninterrupted runs: the bytes to match, and how long writing lasts
        out = tmp / f"ref{suffix}"
        run = runner.start([*base, "-o", str(out)], tmp / f"ref{suffix}.log")
        window = watch_window(run, out)
        assert run.wait() == 0, run.output()
        refs[suffix] = (tree(out), window)
        print(f"reference {suffix}: chunks written over {window:.2f} s", flush=True)

    chunks = -(-args.rows // args.chunk_size)
    results = []
    for trial in range(args.trials):
        suffix = SUFFIXES[trial % len(SUFFIXES)]
        ref, window = refs[suffix]
        out = tmp / f"t{trial}{suffix}"
        record: dict[str, Any] = {"trial": trial, "format": suffix, "kills": [], "ok": True}
        for attempt in range(rng.randint(1, 3)):
            run = runner.start([*base, "-o", str(out)], tmp / f"t{trial}.{attempt}.log")
            # a moment drawn uniformly from this run's writing: usually from its first newly
            # recorded chunk to its end (what is left of the reference's window), sometimes
            # from the very start of the store (creating it, compiling the first chunk)
            before = count_done(out)
            wait_for_store(run, out)
            left = window * (1 - before / chunks)
            if rng.random() < 0.75:
                wait_for_record(run, out, before)
                left *= 0.9
            time.sleep(rng.uniform(0, left * 1.1))
            where = phase(out)
            run.kill()
            status = run.wait()
            record["kills"].append({"at": where, "status": status})
            if out.exists() and not compare(out, ref, "ref"):
                record["ok"] = False
                record["problem"] = f"after kill {attempt}: the output exists but differs"
        recorded = count_done(out)
        run = runner.start([*base, "-o", str(out)], tmp / f"t{trial}.final.log")
        code = run.wait()
        summary = json.loads(run.output().strip().splitlines()[-1]) if code == 0 else {}
        record["final_exit"] = code
        record["resumed"] = summary.get("resumed_chunks")
        record["recorded_before"] = recorded
        if code != 0:
            record["ok"] = False
            record["problem"] = run.output()[-500:]
        elif not compare(out, ref, "ref"):
            record["ok"] = False
            record["problem"] = "the finished output differs from the uninterrupted run"
        elif list(out.parent.glob(out.name + ".partial*")):
            record["ok"] = False
            record["problem"] = "a work directory (or its remains) was left behind"
        elif recorded and summary["resumed_chunks"] != recorded:
            record["ok"] = False
            record["problem"] = f"resumed {summary['resumed_chunks']} chunks, {recorded} were recorded"
        results.append(record)
        kills = "; ".join(f"{k['at']} ({k['status']})" for k in record["kills"])
        print(f"trial {trial:2d} {suffix:5s} {'OK  ' if record['ok'] else 'FAIL'} kills: {kills} | "
              f"final: resumed {record['resumed']} of {summary.get('chunks')} chunks"
              + (f" | {record.get('problem')}" if not record["ok"] else ""), flush=True)
        if out.is_dir():
            shutil.rmtree(out)
        for path in out.parent.glob(out.stem + ".*"):
            if path.is_file():
                path.unlink()
    return results


def wait_for_store(run: Any, out: Path, timeout: float = 300) -> None:
    """Until the run starts writing (its work directory appears) or ends."""
    work = Path(str(out) + ".partial")
    deadline = time.monotonic() + timeout
    while not work.exists() and not out.exists() and time.monotonic() < deadline:
        if _ended(run):
            return
        time.sleep(0.001)


def wait_for_record(run: Any, out: Path, before: int, timeout: float = 300) -> None:
    """Until the run records a chunk beyond the ``before`` already recorded (or ends)."""
    deadline = time.monotonic() + timeout
    while count_done(out) <= before and not out.exists() and time.monotonic() < deadline:
        if _ended(run):
            return
        time.sleep(0.0005)


def watch_window(run: Any, out: Path) -> float:
    """Seconds from the first chunk recorded to the finished output appearing."""
    wait_for_store(run, out)
    wait_for_record(run, out, 0)
    start = time.monotonic()
    while not out.exists() and not _ended(run):
        time.sleep(0.001)
    return time.monotonic() - start


def _ended(run: Any) -> bool:
    proc = getattr(run, "proc", None)
    if proc is not None:
        return proc.poll() is not None
    try:
        with open(f"/proc/{run.pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"
    except (FileNotFoundError, IndexError):
        return True


if __name__ == "__main__":
    main()

"""Cold start: the first call of batchjac and of the best native code, each in a fresh process.

BENCHMARKS-SPEC.md, "Cold start". The steady-state table hides what a script that computes
one Jacobian and exits pays: tracing, XLA compilation, batchjac's probes and tuning. Here
every case is its own process (``python -m batchjac._bench.cold SIDE WORKLOAD BACKEND N``);
the timer starts once the framework, batchjac, the model and the data exist and stops when
the first numpy Jacobian is back. Sides:

- ``batchjac``: ``batchjac.jacobian(model, unknown, known)`` (or ``(model, x)``);
- ``native``: the steady table's expert baseline, built and called once (TF: B2
  ``batch_jacobian`` under ``tf.function(jit_compile=True)``; torch: B3 ``vmap(jacrev|jacfwd)``;
  JAX: B4 ``jit(vmap(jacrev|jacfwd))``; ``--variant`` picks jacrev or jacfwd);
- ``batchjac-loop`` (JAX): ``--loop`` calls, each with a NEW function object
  (``lambda z: model(z)``), against the native function built once (its repeated calls).

``batchjac`` and ``native`` call the same function again, up to ``--calls`` times or
``--seconds`` in all: the time to the K-th answer, the sum of the first K calls.

The driver (:func:`run_all`, called by :mod:`batchjac._bench.run`) runs batchjac with
``BATCHJAC_CACHE_DIR`` set to a fresh temporary directory per (workload, backend, round),
then the native variants, then batchjac again with the same directory (warm cache).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import second as _second

#: fresh processes per case (full run, quick run): the report gives medians over rounds
FULL_ROUNDS, QUICK_ROUNDS = 3, 1
#: calls per process in the JAX fresh-closure loop
LOOP_CALLS = 20
#: the time to the K-th answer is reported for these K (where both sides reached them)
KTH = (1, 2, 3, 5, 10, 20, 50, 100, 1000)
#: repeated calls per process for it: at most this many, or until the calls after the first
#: take this many seconds (full run, quick run): the slow workloads reach fewer K
KTH_CALLS, KTH_SECONDS, KTH_QUICK_SECONDS = 1000, 3.0, 1.5
#: ... and at least this many (K = 50 for every case: the races of builds and of chunk sizes
#: ride on a workload's first tens of calls, and the table shows whether they were repaid)
KTH_MIN_CALLS = 50
#: rows of each side's Jacobian saved for the cross-check of the two sides
CHECK_ROWS = 16
MODULE = "batchjac._bench.cold"

NATIVE_NAME = {"tensorflow": "B2 batch_jacobian+XLA", "torch": "B3 vmap({})",
               "jax": "B4 jit(vmap({}))"}
#: Keras 3 models on another Keras backend (issue 37): the case's label -> the framework that
#: computes them; the native side is that framework's transform of the model's own call (JAX:
#: of its stateless function, the variables' values its arguments, as a JAX training loop
#: passes them, read once when the function is built)
KERAS = {"keras-jax": "jax", "keras-torch": "torch"}


def framework(backend: str) -> str:
    """The framework a case computes in (a Keras case's backend)."""
    return KERAS.get(backend, backend)


def shapes(workload: str) -> tuple[int, int]:
    """``(k, m)``: unknowns and outputs per instance (of the model, for W6 and W7)."""
    from ..examples import WORKLOADS
    from .second import SECOND

    w = WORKLOADS[SECOND[workload].base if workload in SECOND else workload]
    k = 784 if w.kind == "cnn" else w.n_unknown
    m = w.sizes[-1] if w.kind == "mlp" else 10
    return k, m


def cost_model_variant(workload: str) -> str:
    """What batchjac's cost model picks: forward mode when the unknowns are fewer."""
    k, m = shapes(workload)
    return "jacfwd" if k < m else "jacrev"


def native_variants(workload: str, backend: str) -> list[str | None]:
    """The native variants timed cold: TensorFlow has one (B2); torch and JAX both jacrev and
    jacfwd, except where forward mode is hopeless (k >= 8 m, as in the steady table); the
    second-order workloads one each (:mod:`batchjac._bench.second`)."""
    backend = framework(backend)
    if backend == "tensorflow" or _second.is_second(workload):
        return [None]
    k, m = shapes(workload)
    return ["jacrev"] if k >= 8 * m else ["jacrev", "jacfwd"]


def native_name(backend: str, variant: str | None, workload: str = "W1") -> str:
    if _second.is_second(workload):
        return _second.native_name(workload, backend)
    return NATIVE_NAME[framework(backend)].format(variant)


# --------------------------------------------------------------------------------------------
# in the fresh process


def _native(backend: str, model: Any, variant: str | None, workload: str = "W1"
            ) -> Callable[[np.ndarray, np.ndarray | None], np.ndarray]:
    if _second.is_second(workload):
        return _second.native(workload, backend, model)
    if backend == "keras-jax":  # its stateless function, the variables' values its arguments
        from . import jax_baselines as jb

        return jb.stateless_jac(model, variant or "jacrev")
    backend = framework(backend)
    if backend == "tensorflow":
        from . import tf_baselines as tfb

        return tfb.xla_batch_jacobian(model)
    if backend == "torch":
        from . import torch_baselines as tb

        return tb.vmap_jac(model, variant or "jacrev")
    from . import jax_baselines as jb

    return jb.vmap_jac(model, variant or "jacrev")


def _import_baselines(backend: str) -> None:
    """Import what the native side uses before the timer, as a user's script would."""
    if backend == "tensorflow":
        from . import tf_baselines  # noqa: F401
    elif backend == "torch":
        from . import torch_baselines  # noqa: F401
    else:
        from . import jax_baselines  # noqa: F401


def first_call(side: str, workload: str, backend: str, n: int, *, variant: str | None = None,
               loop: int = LOOP_CALLS, check: str | None = None, profile: int = 0,
               calls: int = 2, seconds: float = 0.0) -> dict[str, Any]:
    """Run one cold case in this (fresh) process and return its timings.

    ``first_s`` is the first call, timed from the moment the model and data exist;
    ``second_s`` a second call of the same function (how much of the first was one-off);
    ``calls_s`` every call's time (``batchjac`` and ``native``: up to ``calls`` calls, at
    least :data:`KTH_MIN_CALLS`, until the calls after the first take ``seconds``; the loops:
    ``loop`` calls); ``setup_s`` the framework's import, the model and
    the data (untimed by the rest). ``check`` names a .npy file to save the first
    ``CHECK_ROWS`` rows of the Jacobian to."""
    t0 = time.perf_counter()
    if backend in KERAS:  # (read by Keras when it is imported)
        os.environ["KERAS_BACKEND"] = KERAS[backend]
    import batchjac
    from batchjac.examples import workload_inputs, workload_model

    _import_baselines(framework(backend))
    if _second.is_second(workload):
        model, unknown, known = _second.model_and_inputs(workload, backend, n)
    elif backend in KERAS:
        from batchjac._examples import keras as keras_examples
        from batchjac.examples import WORKLOADS

        model = keras_examples.mlp(WORKLOADS[workload].sizes)
        unknown, known = workload_inputs(workload, n)
    else:
        model = workload_model(workload, backend)
        unknown, known = workload_inputs(workload, n)
    data = (unknown,) if known is None else (unknown, known)
    # the imports' garbage collected before the timer, on both sides: CPython's first full
    # collection after importing a framework takes 35-75 ms (the heap it built), and lands in
    # whichever call first crosses the threshold the imports left near (measured: the native
    # W1 JAX call ended 700 allocations short of it, batchjac's crossed it), a cost of the
    # import history that neither side's work causes
    gc.collect()
    setup_s = time.perf_counter() - t0
    out: dict[str, Any] = {"side": side, "workload": workload, "backend": backend, "n": n,
                           "variant": variant, "setup_s": setup_s,
                           "pid": os.getpid()}
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    def verb(model: Any, data: tuple[np.ndarray, ...]) -> np.ndarray:
        if _second.is_second(workload):
            return _second.batchjac_call(workload, model, data)
        return np.asarray(batchjac.jacobian(model, *data))

    if side in ("batchjac", "native"):
        built: list[Callable[[np.ndarray, np.ndarray | None], np.ndarray]] = []

        def call() -> np.ndarray:
            if side == "batchjac":
                return verb(model, data)
            if not built:  # building the native function is part of its first call
                built.append(_native(backend, model, variant, workload))
            return built[0](unknown, known)

        start = time.perf_counter()
        if prof is not None:
            prof.enable()
        jac = call()
        if prof is not None:
            prof.disable()
        out["calls_s"] = times = [time.perf_counter() - start]
        # then the same model (batchjac) or the same built function (native) again: the
        # user's repeated calls, for the time to the K-th answer, at most ``calls``, at
        # least KTH_MIN_CALLS (or ``calls``), then until the calls after the first add up to
        # ``seconds`` (a native first call of seconds left the repeated ones no time)
        least = min(max(2, calls), KTH_MIN_CALLS)
        while len(times) < max(2, calls) and (len(times) < least or sum(times[1:]) < seconds):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        out["first_s"], out["second_s"] = times[0], times[1]
    elif side == "batchjac-settle":
        # what a user's repeated calls do: call until batchjac has no race left to run, which
        # writes its decisions to the cache the warm-cache case then reads
        from .worker import Case, settle

        start = time.perf_counter()
        jac = verb(model, data)
        out["first_s"] = time.perf_counter() - start
        out["settle"] = settle(Case("batchjac", lambda: verb(model, data), "batchjac"), model)
    elif side == "batchjac-loop":
        if backend != "jax":
            raise SystemExit("the fresh-closure loop is a JAX case")
        looped = []
        for i in range(loop):
            start = time.perf_counter()
            if prof is not None and i == 0:
                prof.enable()
            jac = np.asarray(batchjac.jacobian(lambda z: model(z), *data))
            if prof is not None and i == 0:
                prof.disable()
            looped.append(time.perf_counter() - start)
        out["calls_s"] = looped
        out["first_s"] = looped[0]
    else:
        raise SystemExit(f"unknown side {side!r}")
    out["shape"] = list(jac.shape)
    if check:
        np.save(check, np.ascontiguousarray(jac[:CHECK_ROWS]))
    if prof is not None:
        import io
        import pstats

        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(profile)
        sys.stderr.write(buf.getvalue())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("side", choices=["batchjac", "native", "batchjac-settle", "batchjac-loop"])
    p.add_argument("workload", choices=["W1", "W2", "W3", "W4", *_second.SECOND])
    p.add_argument("backend", choices=["tensorflow", "torch", "jax", *KERAS])
    p.add_argument("n", type=int)
    p.add_argument("--variant", choices=["jacrev", "jacfwd"], default=None,
                   help="native torch/JAX: which transform (default jacrev)")
    p.add_argument("--loop", type=int, default=LOOP_CALLS, help="calls of the fresh-closure loop")
    p.add_argument("--calls", type=int, default=2,
                   help="batchjac and native: calls of the same function (at least 2)")
    p.add_argument("--seconds", type=float, default=0.0,
                   help="... stopping once the calls after the first add up to this many seconds")
    p.add_argument("--check", default=None, help=f"save the first {CHECK_ROWS} rows of J here (.npy)")
    p.add_argument("--profile", type=int, default=0, metavar="LINES",
                   help="print a cProfile of the first call to stderr, top LINES by cumtime")
    args = p.parse_args(argv)
    out = first_call(args.side, args.workload, args.backend, args.n, variant=args.variant,
                     loop=args.loop, check=args.check, profile=args.profile,
                     calls=args.calls, seconds=args.seconds)
    sys.stdout.write("COLD-JSON " + json.dumps(out) + "\n")


# --------------------------------------------------------------------------------------------
# the driver, in the bench process


def command(side: str, workload: str, backend: str, n: int, *, variant: str | None = None,
            loop: int | None = None, check: str | None = None,
            calls: tuple[int, float] | None = None) -> list[str]:
    cmd = [sys.executable, "-m", MODULE, side, workload, backend, str(n)]
    if variant:
        cmd += ["--variant", variant]
    if loop is not None:
        cmd += ["--loop", str(loop)]
    if calls is not None:
        cmd += ["--calls", str(calls[0]), "--seconds", f"{calls[1]:g}"]
    if check:
        cmd += ["--check", check]
    return cmd


def run_case(cmd: Sequence[str], *, cache_dir: str, timeout: float) -> dict[str, Any]:
    """One fresh process; its COLD-JSON, or ``{"error": ...}``."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore",
           "BATCHJAC_CACHE_DIR": cache_dir}
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("COLD-JSON "):
            res: dict[str, Any] = json.loads(line[len("COLD-JSON "):])
            return res
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def _rel_err(a_path: str, b_path: str) -> float | None:
    try:
        a, b = np.load(a_path).astype(np.float64), np.load(b_path).astype(np.float64)
    except OSError:
        return None
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max() / (np.abs(b).max() or 1.0))


def _display(cmd: Sequence[str], names: dict[str, str]) -> str:
    """The command as the report shows it: ``python`` for this interpreter and the temporary
    paths by name (``$CACHE``...)."""
    text = " ".join(shlex.quote("python" if c == sys.executable else c) for c in cmd)
    for path, name in sorted(names.items(), key=lambda item: -len(item[0])):
        text = text.replace(path, name)
    return text


def measure_round(workload: str, backend: str, n: int, *, timeout: float = 900,
                  loop: int = LOOP_CALLS, log: Callable[[str], None] = lambda s: None,
                  seconds: float = KTH_SECONDS) -> dict[str, Any]:
    """One round of every cold case of (workload, backend), each in a fresh process, with one
    fresh cache directory: batchjac (cold cache), the native variants, batchjac again (warm
    cache), each called again for up to ``seconds`` (the time to the K-th answer), and for
    JAX the fresh-closure loop (batchjac with a second fresh directory)."""
    calls = (KTH_CALLS, seconds)
    rnd: dict[str, Any] = {"native": {}, "commands": []}
    with tempfile.TemporaryDirectory(prefix="batchjac-cold-") as tmp:
        cache = os.path.join(tmp, "cache")
        check = os.path.join(tmp, "check")
        os.makedirs(cache)
        os.makedirs(check)

        names = {cache: "$CACHE", check: "$CHECK", os.path.join(tmp, "loop-cache"): "$CACHE_LOOP"}

        def go(key: str, cmd: list[str], cache_dir: str, note: str = "") -> dict[str, Any]:
            res = run_case(cmd, cache_dir=cache_dir, timeout=timeout)
            rnd["commands"].append(f"BATCHJAC_CACHE_DIR={names[cache_dir]} {_display(cmd, names)}"
                                   + (f"  # {note}" if note else ""))
            log(f"    {key}: " + (f"failed: {res['error']}" if "error" in res
                                    else f"first call {res['first_s']:.3g} s"))
            return res

        bj_check = os.path.join(check, "batchjac.npy")
        rnd["batchjac"] = go("batchjac (cold cache)",
                             command("batchjac", workload, backend, n, check=bj_check,
                                     calls=calls), cache)
        errs = {}
        for variant in native_variants(workload, backend):
            name = native_name(backend, variant, workload)
            path = os.path.join(check, f"native-{variant}.npy" if variant else "native.npy")
            rnd["native"][name] = res = go(name, command("native", workload, backend, n,
                                                         variant=variant, check=path,
                                                         calls=calls), cache)
            if "error" not in res and "error" not in rnd["batchjac"]:
                errs[name] = _rel_err(bj_check, path)
        rnd["max_rel_err"] = errs
        rnd["batchjac_settle"] = go("batchjac (repeated calls until tuned)",
                                    command("batchjac-settle", workload, backend, n), cache,
                                    "calls until no race is due: fills the cache")
        rnd["batchjac_warm"] = go("batchjac (warm cache)",
                                  command("batchjac", workload, backend, n, calls=calls),
                                  cache, "the same directory again: warm cache")
        if backend == "jax" and not _second.is_second(workload):
            ok = {k: v for k, v in rnd["native"].items() if "error" not in v}
            best = min(ok, key=lambda k: ok[k]["first_s"]) if ok else native_name(
                backend, cost_model_variant(workload))
            variant = "jacfwd" if "jacfwd" in best else "jacrev"
            loop_cache = os.path.join(tmp, "loop-cache")
            os.makedirs(loop_cache)
            rnd["loop_variant"] = variant
            rnd["loop_batchjac"] = go("batchjac fresh-closure loop",
                                      command("batchjac-loop", workload, backend, n, loop=loop),
                                      loop_cache, "a second fresh directory; against the "
                                      "native function built once, called again above")
    return rnd


def precompile() -> None:
    """Write batchjac's bytecode, as installing a wheel does. The frameworks come with theirs;
    an editable install (``make install``) leaves batchjac's to the first import, and with
    PYTHONDONTWRITEBYTECODE set (as on the project's machine) every fresh process compiles
    the modules the first call imports inside the timed call: measured on W3 (JAX), 60-100
    ms of its ~240 ms, most of it a full garbage collection that compiling triggers."""
    import compileall

    import batchjac

    compileall.compile_dir(os.path.dirname(batchjac.__file__), quiet=1)


def run_all(workloads: dict[str, int], backends: list[str], *, rounds: int,
            log: Callable[[str], None], timeout: float = 900, loop: int = LOOP_CALLS,
            seconds: float = KTH_SECONDS) -> list[dict[str, Any]]:
    """Every cold case, ``rounds`` times, interleaved: round r runs every (workload, backend)
    before round r+1 starts, so drifting load hits all alike. One dict per (workload, backend)
    with the rounds' raw results under ``"rounds"``. batchjac's bytecode is written first
    (:func:`precompile`)."""
    precompile()
    keys = [(w, b) for w in workloads for b in backends]
    out: dict[tuple[str, str], dict[str, Any]] = {
        key: {"workload": key[0], "backend": key[1], "n": workloads[key[0]],
              "k": shapes(key[0])[0], "m": shapes(key[0])[1], "rounds": []} for key in keys}
    for r in range(rounds):
        for w, b in keys:
            log(f"cold {w} N={workloads[w]:,} {b} (round {r + 1}/{rounds}) ...")
            out[(w, b)]["rounds"].append(measure_round(w, b, workloads[w], timeout=timeout,
                                                       loop=loop, log=log, seconds=seconds))
    return list(out.values())


# --------------------------------------------------------------------------------------------
# summaries and rendering (pure: synthetic results render without any subprocess)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _firsts(rounds: list[dict[str, Any]], *path: str, field: str = "first_s") -> list[float]:
    """``field`` of the result at ``path`` (e.g. ``"native", "B2 ..."``) in every round where
    that case succeeded."""
    vals = []
    for rnd in rounds:
        res: Any = rnd
        for part in path:
            res = res.get(part) if isinstance(res, dict) else None
        if isinstance(res, dict) and "error" not in res and field in res:
            vals.append(res[field])
    return vals


def _errors(rounds: list[dict[str, Any]]) -> list[str]:
    errs: list[str] = []

    def add(res: dict[str, Any] | None, what: str) -> None:
        if res is not None and "error" in res:
            errs.append(f"{what}: {res['error']}")

    for rnd in rounds:
        add(rnd.get("batchjac"), "batchjac")
        add(rnd.get("batchjac_warm"), "batchjac (warm cache)")
        for name, res in rnd.get("native", {}).items():
            add(res, name)
        add(rnd.get("loop_batchjac"), "batchjac loop")
    return errs


def summarise(c: dict[str, Any]) -> dict[str, Any]:
    """Medians over rounds: batchjac's first call (cold and warm cache), each native variant's,
    the best native one, the ratios; for JAX the fresh-closure loop per call."""
    rounds = c["rounds"]
    t_bj = _median(_firsts(rounds, "batchjac"))
    t_bj2 = _median(_firsts(rounds, "batchjac", field="second_s"))
    t_warm = _median(_firsts(rounds, "batchjac_warm"))
    names = list(dict.fromkeys(name for r in rounds for name in r.get("native", {})))
    natives = {name: _median(_firsts(rounds, "native", name)) for name in names}
    natives_2 = {name: _median(_firsts(rounds, "native", name, field="second_s")) for name in names}
    timed = {k: v for k, v in natives.items() if v is not None}
    best = min(timed, key=lambda k: timed[k]) if timed else None
    t_nat = timed[best] if best else None
    errs = [e for r in rounds for e in r.get("max_rel_err", {}).values() if e is not None]
    s: dict[str, Any] = {
        "t": t_bj, "t_second": t_bj2, "t_warm": t_warm, "natives": natives,
        "natives_second": natives_2, "best_name": best, "t_best": t_nat,
        "ratio": t_bj / t_nat if t_bj is not None and t_nat else None,
        "ratio_warm": t_warm / t_nat if t_warm is not None and t_nat else None,
        "err": max(errs) if errs else None, "errors": _errors(rounds),
        "rounds": len(rounds), "loop": None,
    }
    # the steady call: a process's calls after the first STEADY_FROM (batchjac's warm-cache
    # process, whose tuning decisions are recalled), against the native variant fastest there
    steady_nat = [t for t in (_steady(rounds, "native", name) for name in names) if t is not None]
    s["steady"], s["steady_native"] = _steady(rounds, "batchjac_warm"), min(steady_nat, default=None)
    s["steady_ratio"] = s["steady"] / s["steady_native"] \
        if s["steady"] is not None and s["steady_native"] else None
    s["kth"] = kth(rounds, "batchjac")
    s["kth_warm"] = kth(rounds, "batchjac_warm")
    loops_bj = [r["loop_batchjac"]["calls_s"] for r in rounds
                if "loop_batchjac" in r and "error" not in r["loop_batchjac"]]
    # against the native function built once (the loop's variant), called again
    loops_nat = [r["native"][name]["calls_s"] for r in rounds
                 for name in r.get("native", {}) if r.get("loop_variant", "-") in name
                 and "error" not in r["native"][name] and "calls_s" in r["native"][name]]
    if loops_bj and loops_nat:
        bj1 = statistics.median(calls[0] for calls in loops_bj)
        nat1 = statistics.median(calls[0] for calls in loops_nat)
        bj_rest = _median([t for calls in loops_bj for t in calls[1:]])
        nat_rest = _median([t for calls in loops_nat for t in calls[1:]])
        s["loop"] = {
            "variant": next(r["loop_variant"] for r in rounds if "loop_variant" in r),
            "calls": len(loops_bj[0]), "bj_1": bj1, "native_1": nat1, "bj_rest": bj_rest,
            "native_rest": nat_rest, "ratio_1": bj1 / nat1,
            "ratio_rest": bj_rest / nat_rest if bj_rest is not None and nat_rest else None,
        }
    return s


#: calls of a process before its steady ones (compilation, first races)
STEADY_FROM = 10


def _steady(rounds: list[dict[str, Any]], *path: str) -> float | None:
    """The median over rounds of a process's median call after its first :data:`STEADY_FROM`."""
    runs: list[Any] = _firsts(rounds, *path, field="calls_s")  # (each a list of calls)
    return _median([statistics.median(c[STEADY_FROM:]) for c in runs if len(c) > STEADY_FROM])


def _cumulative(rounds: list[dict[str, Any]], *path: str) -> list[float]:
    """The median over rounds of the time to each answer (the sum of the first K calls), for
    the K every round reached."""
    runs = [np.cumsum(c) for c in _firsts(rounds, *path, field="calls_s")]
    if not runs:
        return []
    reached = min(len(c) for c in runs)
    return [float(np.median([c[k] for c in runs])) for k in range(reached)]


def kth(rounds: list[dict[str, Any]], side: str) -> dict[int, float]:
    """batchjac's time to the K-th answer over the native code's, for each K of :data:`KTH`
    both reached: the native code is, at each K, the faster of its variants (the mode an
    expert who knew would choose)."""
    mine = _cumulative(rounds, side)
    names = list(dict.fromkeys(name for r in rounds for name in r.get("native", {})))
    natives = [c for c in (_cumulative(rounds, "native", name) for name in names) if c]
    out: dict[int, float] = {}
    for k in KTH:
        theirs = [c[k - 1] for c in natives if len(c) >= k]
        if k > len(mine) or not theirs:
            break
        out[k] = mine[k - 1] / min(theirs)
    return out


def kth_lines(summaries: dict[tuple[str, int, str], dict[str, Any]]) -> list[str]:
    """The "time to the K-th answer" table: one row per case and cache (fresh, warm)."""
    rows = [(key, s) for key, s in summaries.items() if s.get("kth")]
    if not rows:
        return []
    ks = [k for k in KTH if any(k in s["kth"] for _, s in rows)]
    lines = ["", "Time to the K-th answer, batchjac / native code (each side's first K calls "
             "in one fresh process, summed; median over rounds; the native code is at each K "
             "the faster of its variants; bold: later than native; `-`: not reached in the "
             "time given to a case):", "",
             "| workload | N | backend | cache | " + " | ".join(f"K={k:,}" for k in ks)
             + " | worst |", "|---|---|---|---|" + "---|" * (len(ks) + 1)]
    for (w, n, b), s in rows:
        for cache, ratios in (("fresh", s["kth"]), ("warm", s.get("kth_warm") or {})):
            if not ratios:
                continue
            cells = [_kth_cell(ratios.get(k)) for k in ks]
            lines.append(f"| {w} | {n:,} | {b} | {cache} | " + " | ".join(cells) + " | "
                         + _kth_cell(max(ratios.values())) + " |")
    return lines


def _kth_cell(x: float | None) -> str:
    if x is None:
        return "-"
    return f"**{fmt_ratio(x)}**" if x > 1.0 else fmt_ratio(x)


def by_key(cold: list[dict[str, Any]]) -> dict[tuple[str, int, str], dict[str, Any]]:
    return {(c["workload"], c["n"], c["backend"]): summarise(c) for c in cold}


def fmt_s(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"


def fmt_ratio(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if x < 10 else f"{x:.3g}"


def headline_cells(s: dict[str, Any] | None) -> tuple[str, str]:
    """The cold and warm-cache cells of the summary table."""
    if s is None:
        return "-", "-"
    if s["ratio"] is None:
        return "failed", "-"
    return f"**{fmt_ratio(s['ratio'])}**", fmt_ratio(s["ratio_warm"])


def closure_lines(summaries: dict[tuple[str, int, str], dict[str, Any]]) -> list[str]:
    """The JAX fresh-closure rows under the summary table."""
    rows = [(key, s) for key, s in summaries.items() if key[2] == "jax" and s["loop"]]
    if not rows:
        return []
    calls = rows[0][1]["loop"]["calls"]
    lines = ["", f"JAX, a new function object per call ({calls} calls in a fresh process: "
             "`batchjac.jacobian(lambda z: model(z), ...)` against "
             "`jax.jit(jax.vmap(jax.jacrev(model)))` (or jacfwd) built once and called again), "
             "batchjac / native per call:", "",
             f"| workload | N | call 1 | calls 2-{calls} (median) | native variant |",
             "|---|---|---|---|---|"]
    for (w, n, _), s in rows:
        lp = s["loop"]
        lines.append(f"| {w} | {n:,} | **{fmt_ratio(lp['ratio_1'])}** | "
                     f"**{fmt_ratio(lp['ratio_rest'])}** | {lp['variant']} |")
    return lines


def section(cold: list[dict[str, Any]]) -> list[str]:
    """The "First call in a fresh process" section of BENCHMARKS.md."""
    if not cold:
        return []
    summaries = by_key(cold)
    rounds = max(s["rounds"] for s in summaries.values())
    lines = [
        "## First call in a fresh process", "",
        "Each figure is one call in its own fresh process (median of "
        f"{rounds} such process{'es' if rounds > 1 else ''} per case, rounds interleaved over "
        "the cases). The timer starts once the framework, batchjac, the model and the data "
        "exist, and stops when the numpy Jacobian is back: tracing, compilation, batchjac's "
        "probes and tuning are in it. Native is the steady table's expert baseline, built and "
        "called once (TensorFlow B2; torch B3 and JAX B4 both jacrev and jacfwd in separate "
        "processes, except where forward mode is hopeless, W2 and W4; the faster one counts "
        "and is named). batchjac runs with `BATCHJAC_CACHE_DIR` a fresh empty directory per "
        "(workload, backend, round); then a process calls batchjac until its tuning has settled "
        "(no race due: the decisions a user's repeated calls write to the cache), and a last "
        "fresh process's first call reads them (warm cache). \"Second call\" is a second "
        "call in the same process (the built native function called again); the steady call "
        f"is the median of a process's calls after its first {STEADY_FROM} (batchjac's "
        "warm-cache process; the native variant fastest there). The error is "
        "max |J_batchjac - J_native| / max |J_native| "
        f"over the first {CHECK_ROWS} rows. Each process collects its garbage (`gc.collect()`) "
        "before the timer starts, on both sides: CPython's first full collection after a "
        "framework's import takes 35-75 ms and falls in whichever call first crosses the "
        "threshold the imports left near. batchjac's bytecode is written before the cases "
        "(as a wheel install writes it; the frameworks have theirs): with an editable install "
        "and PYTHONDONTWRITEBYTECODE set, each process would compile batchjac's modules inside "
        "the timed call.",
        "",
        "| workload | N | backend | batchjac first call | batchjac second call | native "
        "| native first call | native second call | batchjac / native | warm-cache first call "
        "| warm / native | steady call: batchjac / native | max rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (w, n, b), s in summaries.items():
        if s["best_name"] is None or s["t"] is None:
            lines.append(f"| {w} | {n:,} | {b} | failed: {'; '.join(s['errors'])[:300]} "
                         "|||||||||")
            continue
        others = [f"{name}: {fmt_s(t)}" for name, t in s["natives"].items()
                  if name != s["best_name"] and t is not None]
        native = s["best_name"] + (f" (other: {', '.join(others)})" if others else "")
        err = "-" if s["err"] is None else f"{s['err']:.1e}"
        steady = "-" if s["steady_ratio"] is None else (
            f"{fmt_s(s['steady'])} / {fmt_s(s['steady_native'])}: {fmt_ratio(s['steady_ratio'])}")
        lines.append(
            f"| {w} | {n:,} | {b} | {fmt_s(s['t'])} | {fmt_s(s['t_second'])} | {native} | "
            f"{fmt_s(s['t_best'])} | {fmt_s(s['natives_second'][s['best_name']])} | "
            f"**{fmt_ratio(s['ratio'])}** | {fmt_s(s['t_warm'])} | {fmt_ratio(s['ratio_warm'])} | "
            f"{steady} | {err} |")
    loops = [(key, s) for key, s in summaries.items() if s["loop"]]
    if loops:
        lines += ["", "JAX fresh-closure loop (each call a new `lambda z: model(z)`; native: "
                  "`jax.jit(jax.vmap(jax.jac...))` built once, its calls above), per-call "
                  "seconds:", "",
                  "| workload | N | batchjac call 1 | native call 1 | ratio | batchjac calls 2+ "
                  "(median) | native calls 2+ (median) | ratio | native variant |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for (w, n, _), s in loops:
            lp = s["loop"]
            lines.append(f"| {w} | {n:,} | {fmt_s(lp['bj_1'])} | {fmt_s(lp['native_1'])} | "
                         f"**{fmt_ratio(lp['ratio_1'])}** | {fmt_s(lp['bj_rest'])} | "
                         f"{fmt_s(lp['native_rest'])} | **{fmt_ratio(lp['ratio_rest'])}** | "
                         f"{lp['variant']} |")
    lines += kth_lines(summaries)
    failures = [f"{w} {b}: {e}" for (w, _, b), s in summaries.items() for e in s["errors"]]
    if failures:
        lines += ["", "Failed cold cases: " + "; ".join(f[:300] for f in failures)]
    cmds = [cmd for c in cold for cmd in (c["rounds"][0].get("commands", []) if c["rounds"] else [])]
    if cmds:
        lines += ["", "The commands of one round (`$CACHE` is a fresh empty directory per "
                  "workload and backend, `$CACHE_LOOP` another one, `$CHECK` where `--check` "
                  "saves rows for the error column):", "", "```sh", *cmds, "```"]
    lines += ["", "A cProfile of one first call, top 25 by cumulative time: `python -m "
              f"{MODULE} batchjac W1 tensorflow 1000 --profile 25`."]
    return lines


if __name__ == "__main__":
    main()

# Measurement helper of the cold-start work (branch cold): see the report; not part of the package.
"""Alternate fresh-process cold cases; medians. usage: alt.py W BACKEND N REPS case[,case...]
case: bj (fresh cache) | bjwarm (second process on the same cache after settle) | noprobe | nat | natfwd"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

W, B, N, R = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
cases = sys.argv[5].split(",")
py = "/work/main/.venv/bin/python"
res = {c: [] for c in cases}
def run(args, env, src=None):
    e = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONWARNINGS": "ignore", **env}
    if src: e["PYTHONPATH"] = src
    p = subprocess.run([py, "-m", "batchjac._bench.cold", *args], capture_output=True, text=True, env=e)
    for line in p.stdout.splitlines():
        if line.startswith("COLD-JSON "):
            return json.loads(line[10:])
    raise SystemExit(p.stderr[-2000:])
for r in range(R):
    for c in cases:
        d = tempfile.mkdtemp()
        if c.startswith("main-"):
            src = "/work/main/src"; cc = c[5:]
        else:
            src = None; cc = c
        if cc == "bj":
            o = run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d}, src)
        elif cc == "bj2":
            run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d}, src)
            o = run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d}, src)
        elif cc == "bjwarm":
            run(["batchjac-settle", W, B, N], {"BATCHJAC_CACHE_DIR": d}, src)
            o = run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d}, src)
        elif c == "never":
            o = run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d})
        elif c == "bj2":
            run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d})
            o = run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d})
        elif c == "noprobe":
            o = run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d, "BATCHJAC_PROBES": "off"})
        elif c == "bjwarm":
            run(["batchjac-settle", W, B, N], {"BATCHJAC_CACHE_DIR": d})
            o = run(["batchjac", W, B, N], {"BATCHJAC_CACHE_DIR": d})
        elif c == "nat":
            o = run(["native", W, B, N, "--variant", "jacrev"] if B != "tensorflow" else ["native", W, B, N], {})
        elif c == "natfwd":
            o = run(["native", W, B, N, "--variant", "jacfwd"], {})
        res[c].append(o["first_s"])
for c, v in res.items():
    print(f"{c:12s} median {statistics.median(v)*1e3:8.1f} ms min {min(v)*1e3:6.1f}  all " + " ".join(f"{x*1e3:.0f}" for x in v))
base = [c for c in cases if c.startswith("nat")]
if base:
    nb = min(statistics.median(res[c]) for c in base)
    for c in cases:
        print(f"ratio {c}/best-native {statistics.median(res[c])/nb:.2f}")

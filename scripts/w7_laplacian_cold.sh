# Measurement helper of the forward-Laplacian work (branch lap3): see the report; not part of the package.
# usage: B=jax|tensorflow N=100000 bash scripts/w7_laplacian_cold.sh (main tree vs this one, fresh process each)
# fresh process per case, fresh cache dir per case; main's tree vs lap3's, interleaved
for r in 1 2 3; do
  for side in "lap3 batchjac" "main batchjac" "lap3 native"; do
    set -- $side
    d=$(mktemp -d /tmp/cache.XXXX)
    src=$(cd $(dirname $0)/.. && pwd)/src; [ $1 = main ] && src=/work/main/src
    out=$(cd /tmp && BATCHJAC_CACHE_DIR=$d TF_CPP_MIN_LOG_LEVEL=3 PYTHONWARNINGS=ignore PYTHONPATH=$src nice -n 19 /work/main/.venv/bin/python -m batchjac._bench.cold $2 W7 ${B:-jax} ${N:-100000} 2>/dev/null | grep COLD-JSON)
    echo "round $r $1 $2: $(echo $out | /work/main/.venv/bin/python -c 'import sys,json; d=json.loads(sys.stdin.read()[10:]); print(round(d["first_s"],3), "s")')"
    rm -rf $d
  done
done

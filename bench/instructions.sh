#!/bin/bash
# Instructions one bench run executes (callgrind), less those of the same process without the run: a figure that
# does not move with other tenants of a shared machine, for A/B comparisons where wall times are too noisy.
# usage: bench/instructions.sh ENGINE [REQUESTS] [TREE]   (TREE: a checkout to measure, default this one; needs
# valgrind; about 30 s per 1,000 requests of vLLM). Prints: ENGINE REQUESTS TREE giga-instructions
set -euo pipefail
engine=${1:?engine}; n=${2:-2000}
root=$(cd "$(dirname "$0")/.." && pwd); tree=${3:-$root}
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 PYTHONHASHSEED=0   # no spinning BLAS threads
run='import sys; sys.path[:0] = [sys.argv[1], sys.argv[1] + "/bench"]
from run import scenario_dict
from simengine.api import run_engine
from simengine.config.loader import from_dict
from simengine.config.scenario import Scenario
sc = from_dict(Scenario, scenario_dict(max(int(sys.argv[3]), 1), 17.7, sys.argv[2]), source="bench")
if int(sys.argv[3]):
    run_engine(sc, sc.engines[0])'
count() {
  valgrind --tool=callgrind --callgrind-out-file=/dev/null "$root/.venv/bin/python" -c "$run" "$tree" "$engine" "$1" \
    2>&1 >/dev/null | sed -n 's/.*Collected : \([0-9]*\).*/\1/p'
}
with=$(count "$n"); without=$(count 0)
echo "$engine $n $tree $(python3 -c "print(round(($with - $without) / 1e9, 3))")"

#!/usr/bin/env bash
# One prepared GPU check of kernels.py for a lent H200 (about 4 minutes, at most 6):
#   1. tests/test_kernels.py compiled for the GPU (not the interpreter), statistical tests at 20k samples;
#   2. bench_kernels.py at Kimi K3 sizes (batch 1 and 32, greedy and sampled): kernel vs reference vs naive
#      PyTorch vs the bandwidth bound, with a full-size kernel/reference agreement check;
#   3. a sweep of the sampler's tiling (MARKOV_TILING) at T = 1.
# Results go to $OUT (default benchmarks/results/); the last lines printed are the benchmark tables.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
unset TRITON_INTERPRET DSPARK_KERNELS
export PYTHONUNBUFFERED=1

{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import sys, torch, triton; print(sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/environment.txt"

timeout 170 python3 -m pytest tests/test_kernels.py -q -rs --durations=8 2>&1 | tee "$OUT/test_kernels.log"
echo "tests exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/test_kernels.log"

timeout 110 python3 benchmarks/bench_kernels.py --json "$OUT/bench_kernels.json" 2>&1 | tee "$OUT/bench_kernels.txt"
timeout 70 python3 benchmarks/bench_kernels.py --temperature 1 --skip-naive --sweep --json "$OUT/bench_sweep.json" \
    2>&1 | tee "$OUT/bench_sweep.txt"

#!/usr/bin/env bash
# One prepared GPU check of kernels.py and of generation through it, for a lent H200 (about 6 minutes, at most 9):
#   1. tests/test_kernels.py compiled for the GPU (not the interpreter), statistical tests at 20k samples;
#   2. bench_kernels.py at Kimi K3 sizes (batch 1 and 32, greedy and sampled): kernel vs reference vs naive
#      PyTorch vs the bandwidth bound, with a full-size kernel/reference agreement check;
#   3. a sweep of the sampler's tiling (MARKOV_TILING) at T = 1;
#   4. end to end on CUDA, where `target.generate(..., assistant_model=draft)` takes the Triton kernels: the
#      embedded pair's greedy DSpark output against the target's own in fp32 (must be identical) and bf16
#      (bench_precision.py), then tokens/s against the target alone, greedy and sampled (bench_generation.py).
# Everything printed goes to $OUT/gpu_check.log (default $OUT: benchmarks/results/), each benchmark's JSON beside it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
unset TRITON_INTERPRET DSPARK_KERNELS
export PYTHONUNBUFFERED=1
exec > >(tee "$OUT/gpu_check.log") 2>&1

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__)"

timeout 170 python3 -m pytest tests/test_kernels.py -q -rs --durations=8
echo "tests exit status: $?"

timeout 110 python3 benchmarks/bench_kernels.py --json "$OUT/bench_kernels.json"
timeout 70 python3 benchmarks/bench_kernels.py --temperature 1 --skip-naive --sweep --json "$OUT/bench_sweep.json"

timeout 90 python3 benchmarks/bench_precision.py --device cuda --json "$OUT/precision_cuda.json"
timeout 60 python3 benchmarks/bench_generation.py --target embedded/target --draft embedded/dspark --device cuda \
    --json "$OUT/generation_cuda_greedy.json"
timeout 60 python3 benchmarks/bench_generation.py --target embedded/target --draft embedded/dspark --device cuda \
    --do-sample --json "$OUT/generation_cuda_sampled.json"

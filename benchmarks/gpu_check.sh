#!/usr/bin/env bash
# Everything in uvic that needs a CUDA GPU, in one run: the GPU tests, then every benchmark (Cog against softmax
# side by side in the same run). CI has no GPU, so this is how the fused kernel is checked on real hardware. From
# the repository root of an installed checkout:
#
#     benchmarks/gpu_check.sh [LOG_DIR]          # logs and tables go to LOG_DIR (default: gpu_check_logs)
#     GPU_CHECK_FULL=1 benchmarks/gpu_check.sh   # every row of every benchmark, no time limits
#
# Each step's full output is kept in LOG_DIR; a failing step does not stop the later ones, and the script exits
# non-zero if any step failed. Each step has a hard time limit (`timeout`: SIGINT first, so that pytest still
# prints its summary, SIGKILL 10 s later), so the whole run takes at most the sum of the limits below, 465 s
# (525 s with the grace periods), for machines lent for 15 minutes including their start-up. The limits are
# budgets, not measurements: a step that reaches its limit ends with "exit 124" in its log, and the benchmarks
# print which of their rows they skipped. pytest-xdist (when installed) spreads the tests, whose time is mostly
# kernel compilation, over 8 processes.
set -uo pipefail
log=${1:-gpu_check_logs}
mkdir -p "$log"
py=${PYTHON:-python3}
full=${GPU_CHECK_FULL:-0}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # uvic from this checkout, installed or not
status=0

step() {  # step NAME LIMIT_S COMMAND...: run COMMAND (at most LIMIT_S seconds unless full), log it, note a failure
    local name=$1 limit=$2
    shift 2
    [ "$full" = 1 ] && limit=0  # timeout 0: no limit
    echo "== $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout -s INT -k 10 "$limit" "$@" 2>&1 | tee "$log/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

# 1. What ran: GPU, torch, triton (docs/benchmarks.md quotes them with every number).
step env 30 "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability())"

# 2. The GPU tests: the kernel against the float64 reference, launch plans, CUDA graphs, the device query.
xdist=()
"$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
step tests 150 "$py" -m pytest -q -p no:cacheprovider --timeout=120 "${xdist[@]}" \
    tests/kernels/test_triton_gpu.py tests/kernels/test_device.py

# 3. Host time of small calls (enqueue only): fused kernel against SDPA.
step bench_dispatch 25 "$py" benchmarks/bench_dispatch.py --device cuda --rounds 10

# 4. One training step and sampling, U-ViC against U-ViT, at the official per-GPU batches. Within the limit it
#    gets through the eager rows; GPU_CHECK_FULL=1 runs the torch.compile rows too.
budget=(--budget-s 90)
[ "$full" = 1 ] && budget=()
step bench_uvit_step 140 "$py" benchmarks/bench_uvit_step.py --device cuda --rounds 5 "${budget[@]}"

# 5. The kernel alone: TFLOP/s and time ratios against its softmax mode and SDPA flash, by head dim.
triton_args=(--head-dims 64 72 96 128 --lengths 4096 16384 --causal no)
[ "$full" = 1 ] && triton_args=(--head-dims 64 72 80 96 128 160 --causal both)
step bench_triton 60 "$py" benchmarks/bench_triton.py "${triton_args[@]}"

# 6. Attention alone at the U-ViT and LM shapes, and one Cogformer decode step.
step bench_attention 60 "$py" benchmarks/bench_attention.py --device cuda --what time --rounds 20
exit $status

#!/usr/bin/env bash
# Everything in uvic that needs a CUDA GPU, in one run of a few minutes: the GPU-only tests, then the
# side-by-side benchmarks (Cog vs softmax in the same run). CI has no GPU, so this is how the fused kernel is
# checked on real hardware. From the repository root of an installed checkout:
#
#     benchmarks/gpu_check.sh [LOG_DIR]        # logs and tables go to LOG_DIR (default: gpu_check_logs)
#
# Each step's full output is kept in LOG_DIR; a failing step does not stop the later ones, and the script exits
# non-zero if any step failed. pytest-xdist (when installed) spreads the tests, whose time is mostly kernel
# compilation, over 8 processes.
set -uo pipefail
log=${1:-gpu_check_logs}
mkdir -p "$log"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # uvic from this checkout, installed or not
status=0

step() {  # step NAME COMMAND...: run COMMAND, keep its output in LOG_DIR/NAME.txt, remember a failure
    local name=$1
    shift
    echo "== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$log/$name.txt"
    local rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0)) s"
    [ "$rc" -eq 0 ] || status=1
}

step env "$py" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
torch.cuda.get_device_name(), 'sm_%d%d' % torch.cuda.get_device_capability())"
xdist=()
"$py" -c "import xdist" 2>/dev/null && xdist=(-n 8)
step tests "$py" -m pytest -q -p no:cacheprovider --timeout=300 "${xdist[@]}" tests/kernels/test_triton_gpu.py tests/kernels/test_device.py
step bench_triton "$py" benchmarks/bench_triton.py
step bench "$py" benchmarks/bench_attention.py --device cuda --rounds 30
exit $status

#!/usr/bin/env bash
# KDA decode kernel check + cluster-size sweep on the H200, in one device call of under 3 minutes:
#   run(carry=[".devcarry/p0", ".devcarry/p1"], timeout_s=240,
#       command="source .devcarry/p1/env.sh && bash benchmarks/kda_sweep_device.sh")
# 1. GPU tests of the kernel (tests/gpu/test_kda_decode_gpu.py: every variant vs the reference,
#    incl. the runtime's PDL step in a CUDA graph) and of the runtime's fused decode step
#    (tests/gpu/test_decode_gpu.py).
# 2. Timing (benchmarks/kda_decode.py: CUDA-graph replay, median) for H in {12, 96} x B in {1, 64},
#    plain and PDL, the launcher's default (`choose_cluster`) beside each fixed cluster size
#    C = 1, 2, 4, 8 (--variants); fla/stock and the per-cluster JSON sweep are left out. A short
#    table is printed last; the JSON (kda_sweep.json) goes to $OUT (or /tmp).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp}
python3 -c "import pdserve.kernels.kda_decode" 2>/dev/null \
  || python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null
export CUTE_DSL_LOG_LEVEL=${CUTE_DSL_LOG_LEVEL:-0}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader || true

echo "== GPU tests"
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE \
  tests/gpu/test_kda_decode_gpu.py tests/gpu/test_decode_gpu.py 2>&1 | tail -30
tests_rc=${PIPESTATUS[0]}

echo "== timing"
timeout 100 python3 benchmarks/kda_decode.py --heads 12 96 --batches 1 64 --no-cluster-sweep \
  --no-stock --variants c1 c2 c4 c8 --out "$out" --name kda_sweep 2>&1 \
  | grep -v "^H[0-9]*_B[0-9]* {" | tail -30
bench_rc=${PIPESTATUS[0]}
echo "tests rc=$tests_rc bench rc=$bench_rc"
exit $(( tests_rc != 0 || bench_rc != 0 ))

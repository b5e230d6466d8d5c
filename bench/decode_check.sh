#!/usr/bin/env bash
# One GPU call that validates and times the decode kernels (kernels/raw_cuda/paged_decode.cu, gemv.cu;
# on by default since their first H200 check; OPENINFER_DECODE_KERNELS=none turns them off), from the repository root:
#   bash bench/decode_check.sh   (~5 min on an H200; every step has a hard timeout: 7.5 min at worst)
#  1. their GPU unit tests vs numpy (poisoned outputs, odd shapes, Gemm routing, new == default greedy),
#     then the accuracy gate through the executor with them on: tiny models vs HF float32 (prefill,
#     decode, chunked), batched == batch 1, CUDA graphs == eager;
#  2. bench/decode.py, Qwen3-4B, batch 1 and 32, on one executor: the old kernels ("none"), the new ones
#     with plain launches in the graphs ("all|nopdl": GEMV up to 16 rows with the fused norm / SiLU /
#     residual) and with programmatic dependent launches ("all", the default), plus the per-kernel
#     table (GEMVs in a graph plain vs PDL, single GEMMs at M = 1..32, attention at batch 1/32,
#     context 256/4096);
#  3. the real-shape Qwen3-4B gate (random bf16 weights, teacher-forced vs HF float32) with them on
#     (DECODE_CHECK_4B_GATE=0 skips it);
#  4. bench/decode.py for Qwen3-8B, as 2 without the per-kernel table.
# Logs, decode.md / decode.json per model and the gate table go to $OUT; the compact table prints last.
set -uo pipefail
source bench/gpu_env.sh
export OPENINFER_GATE_LOG=$OUT/gate.jsonl
rm -f "$OPENINFER_GATE_LOG"
status=0
step() {   # step NAME TIMEOUT_S CMD...: run with a hard timeout, log to $OUT/NAME.log, keep the worst status
  local name=$1 limit=$2; shift 2
  echo "=== $name (timeout ${limit}s) $(date -u +%H:%M:%S)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "passed|failed|error|Error|Traceback|^\[q|^FAILED|^ERROR" "$OUT/$name.log" | grep -vE "^GATE " | tail -12
  echo "=== $name: exit $rc"
  [ "$rc" -ne 0 ] && status=$rc
}
PYTEST=(python3 -m pytest -q -s -rfE -p no:cacheprovider)

step unit_and_tiny_gate 170 env OPENINFER_DECODE_KERNELS=all OPENINFER_GATE_4B=0 "${PYTEST[@]}" \
  tests/test_raw_cuda_fused.py tests/test_raw_cuda_decode.py tests/test_raw_cuda_kernels.py \
  tests/test_gpu_executor.py tests/test_gpu_graphs.py \
  -k "not gpu_equals_cpu and not deterministic"
KERNEL_SETS=${DECODE_CHECK_KERNELS:-"none;all|nopdl;all"}
step bench_qwen3_4b 120 python3 bench/decode.py --models qwen3-4b --batches 1,32 --hf-batches "" --steps 128 \
  --kernels "$KERNEL_SETS" --micro --out "$OUT/qwen3-4b"
if [ "${DECODE_CHECK_4B_GATE:-1}" = 1 ]; then
  step qwen3_4b_gate 70 env OPENINFER_DECODE_KERNELS=all OPENINFER_GATE_4B=1 "${PYTEST[@]}" \
    tests/test_gpu_executor.py -k qwen3_4b
fi
step bench_qwen3_8b 90 python3 bench/decode.py --models qwen3-8b --batches 1,32 --hf-batches "" --steps 128 \
  --kernels "$KERNEL_SETS" --out "$OUT/qwen3-8b"

for m in qwen3-4b qwen3-8b; do [ -f "$OUT/$m/decode.md" ] && { echo; echo "## $m"; cat "$OUT/$m/decode.md"; }; done
echo; echo "## Gate with the new decode kernels (HF float32 oracle)"
python3 bench/gate_table.py "$OPENINFER_GATE_LOG"
echo; echo "## Decode: old kernels (none) vs new, $(date -u +%H:%M:%S)"
python3 bench/decode.py --summary "$OUT/qwen3-4b/decode.json" "$OUT/qwen3-8b/decode.json"
exit "$status"

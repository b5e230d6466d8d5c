#!/usr/bin/env bash
# One GPU call that validates and times GPU decode, from the repository root:
#   bash bench/decode_check.sh   (~6 min on an H200 with the defaults; every step has a hard timeout)
#  1. the raw CUDA kernels' GPU unit tests vs numpy (DECODE_CHECK_UNITS=0 skips them) (poisoned outputs, odd shapes, fused GEMV variants,
#     fused rope + attention, PDL chains), then the accuracy gate through the executor: tiny models vs HF
#     float32 (prefill, decode, chunked), batched == batch 1, CUDA graphs == eager;
#  2. bench/decode.py, Qwen3-4B, batches $DECODE_CHECK_BATCHES (default 1,32), HF transformers peer at
#     $DECODE_CHECK_HF (default none), decode-kernel settings $DECODE_CHECK_KERNELS (default "all"; e.g.
#     "none;all|nopdl;all" adds the old kernels and plain launches), the per-kernel micro tables
#     ($DECODE_CHECK_MICRO, default "attention,gemv");
#  3. the real-shape Qwen3-4B gate (random bf16 weights, teacher-forced vs HF float32)
#     (DECODE_CHECK_4B_GATE=0 skips it);
#  4. bench/decode.py for Qwen3-8B, as 2 without the micro tables;
#  5. Nsight Compute per-kernel times of one graphed Qwen3-4B step at batch 1 and 32
#     (bench/decode_profile.py; DECODE_CHECK_NCU=0 skips it), and the GPU server test.
# Logs, decode.md / decode.json per model, the gate table and profile_b*.md go to $OUT; the compact
# table prints last.
set -uo pipefail
source bench/gpu_env.sh
export OPENINFER_GATE_LOG=$OUT/gate.jsonl
rm -f "$OPENINFER_GATE_LOG"
PYTEST=(python3 -m pytest -q -s -rfE -p no:cacheprovider)

UNIT_TESTS=(tests/kernels/test_raw_cuda_fused.py tests/kernels/test_raw_cuda_decode.py tests/kernels/test_raw_cuda_kernels.py
            tests/kernels/test_raw_cuda_rope_attention.py)
[ "${DECODE_CHECK_UNITS:-1}" = 1 ] || UNIT_TESTS=()
step unit_and_tiny_gate 200 env OPENINFER_DECODE_KERNELS=all OPENINFER_GATE_4B=0 "${PYTEST[@]}" \
  "${UNIT_TESTS[@]}" tests/gpu/test_gpu_executor.py tests/gpu/test_gpu_graphs.py \
  -k "not gpu_equals_cpu and not deterministic"
KERNEL_SETS=${DECODE_CHECK_KERNELS:-"all"}
BATCHES=${DECODE_CHECK_BATCHES:-1,32}
HF=${DECODE_CHECK_HF:-""}
step bench_qwen3_4b 180 python3 bench/decode.py --models qwen3-4b --batches "$BATCHES" --hf-batches "$HF" \
  --steps 128 --kernels "$KERNEL_SETS" --micro "${DECODE_CHECK_MICRO:-attention,gemv}" --out "$OUT/qwen3-4b"
if [ "${DECODE_CHECK_4B_GATE:-1}" = 1 ]; then
  step qwen3_4b_gate 70 env OPENINFER_DECODE_KERNELS=all OPENINFER_GATE_4B=1 "${PYTEST[@]}" \
    tests/gpu/test_gpu_executor.py -k qwen3_4b
fi
step bench_qwen3_8b 150 python3 bench/decode.py --models qwen3-8b --batches 1,32 --hf-batches "${HF:+1}" \
  --steps 128 --kernels "$KERNEL_SETS" --out "$OUT/qwen3-8b"
if [ "${DECODE_CHECK_NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  for b in ${DECODE_CHECK_NCU_BATCHES:-1 32}; do
    step ncu_b$b 120 ncu --clock-control none --profile-from-start off --metrics gpu__time_duration.sum --csv \
      --log-file "$OUT/ncu_b$b.csv" python3 bench/decode_profile.py --model qwen3-4b --batch $b
    python3 bench/decode_profile.py --parse "$OUT/ncu_b$b.csv" --model qwen3-4b > "$OUT/profile_b$b.md"
  done
fi
step gpu_server 90 "${PYTEST[@]}" tests/gpu/test_gpu_server.py

for m in qwen3-4b qwen3-8b; do [ -f "$OUT/$m/decode.md" ] && { echo; echo "## $m"; cat "$OUT/$m/decode.md"; }; done
for b in 1 32; do [ -f "$OUT/profile_b$b.md" ] && { echo; cat "$OUT/profile_b$b.md"; }; done
echo; echo "## Gate with the new decode kernels (HF float32 oracle)"
python3 bench/gate_table.py "$OPENINFER_GATE_LOG"
echo; echo "## Decode, $(date -u +%H:%M:%S)"
python3 bench/decode.py --summary "$OUT/qwen3-4b/decode.json" "$OUT/qwen3-8b/decode.json"
exit "$status"

#!/usr/bin/env bash
# One GPU call that checks multi-LoRA serving, from the repository root:
#   bash bench/lora_gpu_check.sh
#  1. the LoRA GPU tests (lora_shrink.cu / lora_expand.cu against numpy, each adapter's gate by the floor
#     method on both GEMM libraries, mixed batches, graphs vs eager, slot reloads, the engine) and NVRTC
#     builds of every kernel file;
#  2. the base executor's gate and graphs (LoRA off: the dense paths must be unchanged);
#  3. bench/lora.py: Qwen3-4B decode at batch 1 / 32 with 0, 1, 4 rank-16 adapters.
# Logs to $OUT; every step has a hard timeout.
set -uo pipefail
source bench/gpu_env.sh
export OPENINFER_GATE_LOG=$OUT/gate.jsonl
rm -f "$OPENINFER_GATE_LOG"
PYTEST=(python3 -m pytest -q -rfE -p no:cacheprovider --durations=8)
STEP_TAIL=25
step lora_tests 360 "${PYTEST[@]}" tests/gpu/test_gpu_lora.py tests/kernels/test_gpu_lora_plan.py tests/kernels/test_raw_cuda_compile.py
step base_tests 300 "${PYTEST[@]}" tests/gpu/test_gpu_executor.py tests/gpu/test_gpu_graphs.py
step bench_lora 240 python3 bench/lora.py --out "$OUT/lora"
python3 bench/gate_table.py "$OPENINFER_GATE_LOG" > "$OUT/gate.md" 2>&1
[ -f "$OUT/lora/lora.md" ] && cat "$OUT/lora/lora.md"
exit $status

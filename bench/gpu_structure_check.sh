#!/usr/bin/env bash
# One GPU call that checks the engine after a structural change, from the repository root:
#   bash bench/gpu_structure_check.sh
#  1. the GPU suite (raw kernels, sampler, executor gate on the tiny models, graphs, graph sampling,
#     eager async steps, 8192-token steps with 5,000-token prompts, prefill, host tier, server);
#  2. the real-shape Qwen3-4B gate; 3. bench/decode.py on Qwen3-4B at batches 1, 32, 128.
# Logs to $OUT; every step has a hard timeout.
set -uo pipefail
source bench/gpu_env.sh
export OPENINFER_GATE_LOG=$OUT/gate.jsonl
rm -f "$OPENINFER_GATE_LOG"
PYTEST=(python3 -m pytest -q -rfE -p no:cacheprovider --durations=8)
STEP_TAIL=25
step suite 330 "${PYTEST[@]}" tests/kernels/test_raw_cuda_kernels.py tests/kernels/test_raw_cuda_fused.py tests/kernels/test_raw_cuda_decode.py \
  tests/kernels/test_raw_cuda_rope_attention.py tests/gpu/test_gpu_sampler.py tests/gpu/test_gpu_executor.py tests/gpu/test_gpu_graphs.py \
  tests/gpu/test_gpu_graph_sampling.py tests/gpu/test_gpu_eager_async.py tests/gpu/test_gpu_long_steps.py tests/gpu/test_gpu_prefill_gpu.py \
  tests/gpu/test_gpu_host_tier.py tests/gpu/test_gpu_server.py ${GPU_CHECK_EXTRA:-}
step qwen3_4b_gate 90 env OPENINFER_GATE_4B=1 "${PYTEST[@]}" tests/gpu/test_gpu_executor.py -k qwen3_4b
step bench_qwen3_4b 150 python3 bench/decode.py --models qwen3-4b --batches 1,32,128 --hf-batches "" --steps 128 \
  --kernels all --out "$OUT/qwen3-4b"
python3 bench/gate_table.py "$OPENINFER_GATE_LOG" > "$OUT/gate.md" 2>&1
[ -f "$OUT/qwen3-4b/decode.md" ] && cat "$OUT/qwen3-4b/decode.md"
exit $status

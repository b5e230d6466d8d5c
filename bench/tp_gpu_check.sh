#!/usr/bin/env bash
# One call on a 2-GPU host that checks tensor parallelism, from the repository root:
#   bash bench/tp_gpu_check.sh
#  1. the TP tests (NCCL between two processes, eager and graph-captured; TP=2 vs TP=1 by the floor method
#     on the tiny lines and on Qwen3-8B real shapes with random bf16 weights; greedy with graphs; the engine
#     with async scheduling; kept FP8 / int4 folders and kept experts sharded quantized, TP=2 against TP=1) and
#     NVRTC builds of every kernel file;
#  2. the one-GPU gate, graphs and MoE tests (gpu.py, gpu_graphs.py and moe_align.cu changed under them);
#  3. bench/tp.py: Qwen3-8B decode at batch 1 / 32, TP=1 and TP=2, all-reduce latency and bus bandwidth,
#     and the serving benchmark at rate inf with --tensor-parallel-size 1 and 2.
# Logs to $OUT; every step has a hard timeout.
set -uo pipefail
source bench/gpu_env.sh
export OPENINFER_GATE_LOG=$OUT/gate.jsonl OPENINFER_GATE_8B=1
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}   # no NVLink multicast: the all-reduce measured is NCCL's over NVLink
rm -f "$OPENINFER_GATE_LOG"
PYTEST=(python3 -m pytest -q -s -rfE -p no:cacheprovider --durations=8)
STEP_TAIL=25
step tp_tests 1200 "${PYTEST[@]}" tests/gpu/test_gpu_parallel.py tests/kernels/test_raw_cuda_compile.py
step base_tests 600 "${PYTEST[@]}" tests/gpu/test_gpu_executor.py tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_moe_mla.py \
  tests/kernels/test_gpu_moe_mla_kernels.py
step bench_tp 1500 python3 bench/tp.py --out "$OUT/tp" --serve
python3 bench/gate_table.py "$OPENINFER_GATE_LOG" > "$OUT/gate.md" 2>&1
[ -f "$OUT/tp/tp.md" ] && cat "$OUT/tp/tp.md"
exit $status

#!/usr/bin/env bash
# The whole GPU suite in one call on the GPU host, from the repository root:
#   bash bench/gpu_suite.sh [pytest args...]
# Installs carried wheels (.whl: sanic & co, see /work/shared/device/gather-wheels.sh) when present,
# points the tiny test models at a carried tokenizer (.gpu_assets/qwen-tokenizer) when present,
# runs the raw-kernel (the fused decode kernels included), sampler, executor-gate (tiny models +
# real-shape Qwen3-4B with random bf16 weights) and GPU-server tests (extra pytest args, e.g.
# tests/kernels/test_cute_gpu.py, are added), and prints the gate table. Logs go to $OUT (default bench/out).
set -uo pipefail
source bench/gpu_env.sh
export OPENINFER_GATE_LOG=$OUT/gate.jsonl OPENINFER_GATE_4B=${OPENINFER_GATE_4B:-1}
rm -f "$OPENINFER_GATE_LOG"
python3 -m pytest -q -s -rfE -p no:cacheprovider "$@" \
  tests/kernels/test_raw_cuda_kernels.py tests/kernels/test_raw_cuda_fused.py tests/kernels/test_raw_cuda_decode.py tests/gpu/test_gpu_sampler.py tests/gpu/test_gpu_executor.py tests/gpu/test_gpu_graphs.py \
  tests/gpu/test_gpu_qwen35.py tests/gpu/test_gpu_server.py \
  2>&1 | tee "$OUT/pytest.log" | grep -vE "^GATE |^$"
status=${PIPESTATUS[0]}
python3 bench/gate_table.py "$OPENINFER_GATE_LOG"
exit "$status"

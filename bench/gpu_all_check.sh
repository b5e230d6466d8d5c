#!/usr/bin/env bash
# Every GPU correctness suite in one call, the groups run side by side on the one GPU (each its own
# process, hard timeout, log in $OUT/NAME.log), from the repository root:
#   bash bench/gpu_all_check.sh [group ...]     (default: every group)
# Groups: core (raw kernels, executor gate, graphs, async eager steps, long steps, prefill), serving
# (server, host tier, 64 requests under load, piecewise graphs, a lagging device, partial prefix hits), moe_mla, dsv3 (DeepSeek-V3 / Kimi-K2,
# FP8 / int4 folders), dsv4 (DeepSeek-V4: its kernels, graph decode, an FP8 / FP4 folder), qwen35, lora, structured,
# free_running (greedy decode vs transformers' full recompute, every line), spec (speculative decoding: the
# free-running gate with verify steps, the verify sampling against the CPU's), quant (kept-quantized weights,
# the FP8 KV cache, the quantized kernels). The gate table of every group lands in
# $OUT/gate.md. GPU_LOAD=1 also runs bench/gpu_load.py (products and copies from another process) the whole time:
# results must not depend on timing.
set -uo pipefail
source bench/gpu_env.sh
export OPENINFER_GATE_LOG=$OUT/gate.jsonl
rm -f "$OPENINFER_GATE_LOG"
LIMIT=${GPU_CHECK_LIMIT:-540}
PYTEST=(python3 -m pytest -v -rfE -p no:cacheprovider --durations=10)   # -v: a group cut off by its limit still names its last test
declare -A GROUPS_TESTS=(
  [core]="tests/kernels/test_raw_cuda_kernels.py tests/kernels/test_raw_cuda_fused.py tests/kernels/test_raw_cuda_decode.py tests/kernels/test_raw_cuda_rope_attention.py tests/gpu/test_gpu_executor.py tests/gpu/test_gpu_graphs.py tests/gpu/test_gpu_graph_sampling.py tests/gpu/test_gpu_eager_async.py tests/gpu/test_gpu_long_steps.py tests/gpu/test_gpu_prefill_gpu.py"
  [serving]="tests/gpu/test_gpu_server.py tests/gpu/test_gpu_host_tier.py tests/gpu/test_gpu_under_load.py tests/gpu/test_gpu_piecewise.py tests/gpu/test_gpu_lagging_device.py tests/gpu/test_gpu_partial_hit.py"
  [moe_mla]="tests/kernels/test_gpu_moe_mla_kernels.py tests/gpu/test_gpu_moe_mla.py tests/kernels/test_raw_cuda_sparse_compile.py"
  [dsv3]="tests/gpu/test_gpu_dsv3.py"
  [dsv4]="tests/gpu/test_gpu_dsv4_hc.py tests/gpu/test_gpu_dsv4_indexer.py tests/gpu/test_gpu_dsv4_compress.py tests/gpu/test_gpu_dsv4_attention.py tests/gpu/test_gpu_dsv4.py"
  [qwen35]="tests/gpu/test_gpu_qwen35.py"
  [lora]="tests/gpu/test_gpu_lora.py tests/kernels/test_gpu_lora_plan.py tests/kernels/test_raw_cuda_compile.py"
  [structured]="tests/structured/test_structured_gpu.py tests/gpu/test_gpu_sampler.py"
  [free_running]="tests/gpu/test_gpu_free_running.py tests/gpu/test_gpu_free_running_dsv4.py"
  [spec]="tests/gpu/test_gpu_spec.py tests/gpu/test_gpu_eagle3.py"
  [quant]="tests/gpu/test_gpu_quantized_linear.py tests/gpu/test_gpu_kv_fp8.py tests/kernels/test_gpu_quant_kernels.py tests/gpu/test_gpu_quant_experts.py"
)
groups=("$@"); [ ${#groups[@]} -eq 0 ] && groups=(core serving moe_mla dsv3 dsv4 qwen35 lora structured free_running spec quant)
load_pid=
if [ "${GPU_LOAD:-0}" = 1 ]; then
  python3 bench/gpu_load.py --seconds "$LIMIT" > "$OUT/gpu_load.log" 2>&1 &
  load_pid=$!
fi
pids=()
for g in "${groups[@]}"; do
  # shellcheck disable=SC2086
  ( timeout -k 5 "$LIMIT" "${PYTEST[@]}" ${GROUPS_TESTS[$g]} > "$OUT/$g.log" 2>&1; echo $? > "$OUT/$g.rc" ) &
  pids+=($!)
done
wait "${pids[@]}"
[ -n "$load_pid" ] && { kill "$load_pid" 2>/dev/null; wait "$load_pid" 2>/dev/null; echo "=== load: $(tail -1 "$OUT/gpu_load.log")"; }
for g in "${groups[@]}"; do
  rc=$(cat "$OUT/$g.rc"); echo "=== $g: exit $rc"
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/$g.log" | grep -vE "^GATE " | tail -15
  [ "$rc" -eq 124 ] && { echo "--- $g ran out of its ${LIMIT}s; its last lines:"; grep -E "::" "$OUT/$g.log" | tail -3; }
  [ "$rc" -ne 0 ] && status=$rc
done
python3 bench/gate_table.py "$OPENINFER_GATE_LOG" > "$OUT/gate.md" 2>&1
tar czf "$OUT/logs.tar.gz" -C "$OUT" --exclude=logs.tar.gz . 2>/dev/null
exit $status

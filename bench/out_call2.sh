set -uo pipefail
source bench/gpu_env.sh > /dev/null
STEP_TAIL=30
PYTEST=(python3 -m pytest -q -rfE -p no:cacheprovider --tb=short)
step suite 200 "${PYTEST[@]}" tests/test_gpu_executor.py tests/test_gpu_graphs.py tests/test_gpu_eager_async.py \
  tests/test_gpu_long_steps.py tests/test_gpu_graph_sampling.py tests/test_gpu_host_tier.py tests/test_gpu_server.py \
  tests/test_gpu_prefill_gpu.py tests/test_raw_cuda_decode.py
step serve 230 python3 bench/serve_gpu.py --models qwen3-4b --scenarios c1,inf --out-dir "$OUT/serve"
step bench_qwen3_4b 110 python3 bench/decode.py --models qwen3-4b --batches 1,32,128 --hf-batches "" --steps 64 --kernels all --out "$OUT/qwen3-4b"
cat $OUT/serve/serve-gpu-raw.json 2>/dev/null | head -c 3000
cat $OUT/qwen3-4b/decode.md 2>/dev/null | head -40

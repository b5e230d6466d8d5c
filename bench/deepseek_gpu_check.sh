#!/usr/bin/env bash
# The DeepSeek-V3 / Kimi-K2 and DeepSeek-V4 lines on the GPU, from the repository root, in stages that each fit one
# GPU call (the random checkpoints stay in /tmp while the machine is held):
#   bash bench/deepseek_gpu_check.sh tests     its GPU tests by the floor method (tests/gpu/test_gpu_dsv3.py: every
#                                              path on the tiny V3 / Kimi-K2 models, the biased sigmoid router on
#                                              the device, FP8 / int4 folders) and the MoE kernels' unit tests
#   bash bench/deepseek_gpu_check.sh write     Kimi-K2 real width, $DSV3_LAYERS layers (default 4), random
#                                              $DSV3_FORMAT (default int4) checkpoint
#   bash bench/deepseek_gpu_check.sh bench     bench/deepseek.py on it: decode batch 1 / 32 -> $OUT/deepseek.md/.json
#   bash bench/deepseek_gpu_check.sh v4tests   tests/gpu/test_gpu_dsv4_hc.py (the hyper-connection kernels) and
#                                              test_gpu_dsv4.py: the tiny DeepSeek-V4 in eager steps, an FP8 / FP4 folder
#   bash bench/deepseek_gpu_check.sh v4write   DeepSeek-V4-Flash real width, $DSV4_LAYERS layers (default 4: sliding,
#                                              sliding, compressed-sparse, heavily-compressed), random checkpoint in
#                                              its format (FP8 projections, FP4 experts; 16.4 GB at 4 layers)
#   bash bench/deepseek_gpu_check.sh v4bench   bench/deepseek.py on it: CUDA-graph decode batch 1 / 32 (prompt 128,
#                                              $DSV4_STEPS steps, default 256) and one eager step op by op
#                                              -> $OUT/deepseek-v4.md/.json
#   bash bench/deepseek_gpu_check.sh v4prefill eager prefill steps of 8 x 1024 and 1 x 8192 tokens on it: the CuPy
#                                              pool's peak against eager_pool_nbytes -> $OUT/deepseek-v4-prefill.md
#   bash bench/deepseek_gpu_check.sh v4prefillops one eager prefill step of 1 x 8192 tokens on it, op by op (the
#                                              serving bottleneck at rate inf) -> $OUT/deepseek-v4-prefill-ops.md
#   bash bench/deepseek_gpu_check.sh v4serve   `openinfer serve` of that checkpoint under bench/serve.py (random
#                                              1024/128, c1 and rate inf, $DSV4_SCALE of the prompts, default 0.25;
#                                              the folder's word-level tokenizer of the model's 129,280 ids)
set -uo pipefail
source bench/gpu_env.sh
PYTEST=(python3 -m pytest -q -s -rfE -p no:cacheprovider)
ARGS=(--out "$OUT" --layers "${DSV3_LAYERS:-4}" --format "${DSV3_FORMAT:-int4}")
V4ARGS=(--model deepseek-v4-flash --out "$OUT" --layers "${DSV4_LAYERS:-4}" --steps "${DSV4_STEPS:-256}")
case "${1:-tests}" in
  tests) step dsv3_gpu_tests 560 "${PYTEST[@]}" tests/gpu/test_gpu_dsv3.py tests/kernels/test_gpu_moe_mla_kernels.py ;;
  write) step dsv3_write 560 python3 bench/deepseek.py "${ARGS[@]}" --write-only ;;
  bench) step dsv3_bench 560 python3 bench/deepseek.py "${ARGS[@]}"; cat "$OUT/deepseek.md" 2>/dev/null ;;
  v4tests) step dsv4_gpu_tests 560 "${PYTEST[@]}" tests/gpu/test_gpu_dsv4_hc.py tests/gpu/test_gpu_dsv4.py ;;
  v4write) step dsv4_write 560 python3 bench/deepseek.py "${V4ARGS[@]}" --write-only ;;
  v4bench) step dsv4_bench 560 python3 bench/deepseek.py "${V4ARGS[@]}" --op-times; cat "$OUT/deepseek-v4.md" 2>/dev/null ;;
  v4prefill) step dsv4_prefill 560 python3 bench/deepseek.py "${V4ARGS[@]}" --batches "" --eager --max-tokens 8192 \
               --prefill-memory 8x1024,1x8192 --stem deepseek-v4-prefill; cat "$OUT/deepseek-v4-prefill.md" 2>/dev/null ;;
  v4prefillops) step dsv4_prefill_ops 560 python3 bench/deepseek.py "${V4ARGS[@]}" --batches "" --eager --max-tokens 8192 \
               --prefill-op-times 1x8192 --stem deepseek-v4-prefill-ops; cat "$OUT/deepseek-v4-prefill-ops.md" 2>/dev/null ;;
  v4serve) V4=/tmp/deepseek-v4-flash-L${DSV4_LAYERS:-4}-fp8
           step dsv4_serve 560 python3 bench/serve_gpu.py --models deepseek-v4-flash --folder "$V4" --tokenizer "$V4" \
             --scenarios c1,inf --scale "${DSV4_SCALE:-0.25}" --out-dir "$OUT/deepseek-v4-serve" ;;
esac
exit $status

#!/usr/bin/env bash
# The DeepSeek-V3 / Kimi-K2 line on the GPU, from the repository root, in stages that each fit one GPU call
# (the random checkpoint stays in /tmp while the machine is held):
#   bash bench/deepseek_gpu_check.sh tests   its GPU tests by the floor method (tests/test_gpu_dsv3.py: every
#                                            path on the tiny V3 / Kimi-K2 models, the biased sigmoid router on
#                                            the device, FP8 / int4 folders) and the MoE kernels' unit tests
#   bash bench/deepseek_gpu_check.sh write   Kimi-K2 real width, $DSV3_LAYERS layers (default 4), random
#                                            $DSV3_FORMAT (default int4) checkpoint
#   bash bench/deepseek_gpu_check.sh bench   bench/deepseek.py on it: decode batch 1 / 32 -> $OUT/deepseek.md/.json
set -uo pipefail
source bench/gpu_env.sh
PYTEST=(python3 -m pytest -q -s -rfE -p no:cacheprovider)
ARGS=(--out "$OUT" --layers "${DSV3_LAYERS:-4}" --format "${DSV3_FORMAT:-int4}")
case "${1:-tests}" in
  tests) step dsv3_gpu_tests 560 "${PYTEST[@]}" tests/test_gpu_dsv3.py tests/test_gpu_moe_mla_kernels.py ;;
  write) step dsv3_write 560 python3 bench/deepseek.py "${ARGS[@]}" --write-only ;;
  bench) step dsv3_bench 560 python3 bench/deepseek.py "${ARGS[@]}"; cat "$OUT/deepseek.md" 2>/dev/null ;;
esac
exit $status

#!/usr/bin/env bash
# One GPU call for the DeepSeek-V3 / Kimi-K2 line, from the repository root: bash bench/deepseek_gpu_check.sh
#  1. its GPU tests by the floor method (tests/test_gpu_dsv3.py: every path on the tiny V3 / Kimi-K2 models,
#     the biased sigmoid router on the device, FP8 / int4 folders) and the MoE kernels' unit tests;
#  2. bench/deepseek.py: Kimi-K2 real width, $DSV3_LAYERS layers (default 4), $DSV3_FORMAT (default int4)
#     checkpoint, decode batch 1 / 32; deepseek.md / deepseek.json to $OUT.
set -uo pipefail
source bench/gpu_env.sh
PYTEST=(python3 -m pytest -q -s -rfE -p no:cacheprovider)
step dsv3_gpu_tests 500 "${PYTEST[@]}" tests/test_gpu_dsv3.py tests/test_gpu_moe_mla_kernels.py
step dsv3_bench 1500 python3 bench/deepseek.py --out "$OUT" --layers "${DSV3_LAYERS:-4}" --format "${DSV3_FORMAT:-int4}"
cat "$OUT/deepseek.md" 2>/dev/null
exit $status

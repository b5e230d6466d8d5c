#!/usr/bin/env bash
# The LoRA decode overhead's A/B in one GPU call, from the repository root: bench/lora.py (Qwen3-4B real shape,
# 4 rank-16 adapters, batch 1 and 32) per path, results in $OUT/<path>/lora.{md,json}, then their tables:
#   bash bench/lora_ab.sh [more bench/lora.py flags]
# Paths: the default; the split-K LoRA norms on 512 threads (--norm-threads 512).
set -uo pipefail
source bench/gpu_env.sh
for path in "default:" "threads512:--norm-threads 512"; do
  name=${path%%:*}
  # shellcheck disable=SC2086
  step "lora_$name" 240 python3 bench/lora.py --batches 1,32 --adapters 0,4 --out "$OUT/$name" ${path#*:} "$@"
done
for f in "$OUT"/*/lora.md; do echo "== $f"; grep "^| [0-9]" "$f"; done
exit $status

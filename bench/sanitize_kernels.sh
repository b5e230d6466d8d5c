#!/usr/bin/env bash
# compute-sanitizer (racecheck: shared-memory hazards; initcheck: reads of device memory never written)
# over the kernels that keep state across steps or share tiles between threads: the Gated DeltaNet conv and
# delta rule (recurrent state, the chunked form's shared tiles), and paged decode attention with its split
# partials. From the repository root on a GPU host; logs in $OUT/sanitize-TOOL.log:
#   bash bench/sanitize_kernels.sh
set -uo pipefail
source bench/gpu_env.sh
CASES=(
  "tests/gpu/test_gpu_qwen35.py -k conv_and_delta_rule_kernels and idle and plain"
  "tests/kernels/test_raw_cuda_decode.py -k paged_decode_attention"
)
for tool in racecheck initcheck; do
  : > "$OUT/sanitize-$tool.log"
  for case in "${CASES[@]}"; do
    file=${case%% -k *}; sel=${case#* -k }
    echo "=== $tool: $file -k '$sel' $(date -u +%H:%M:%S)" | tee -a "$OUT/sanitize-$tool.log"
    timeout -k 5 "${SANITIZE_LIMIT:-240}" compute-sanitizer --tool "$tool" --target-processes all \
      --print-limit 20 python3 -m pytest -q -p no:cacheprovider "$file" -k "$sel" >> "$OUT/sanitize-$tool.log" 2>&1
    echo "exit $?" | tee -a "$OUT/sanitize-$tool.log"
    grep -E "ERROR SUMMARY|passed|failed|Race reported|Uninitialized" "$OUT/sanitize-$tool.log" | tail -4
  done
done

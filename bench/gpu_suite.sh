#!/usr/bin/env bash
# The whole GPU suite in one call on the GPU host, from the repository root:
#   bash bench/gpu_suite.sh [pytest args...]
# Installs carried wheels (.whl: sanic & co, see /work/shared/device/gather-wheels.sh) when present,
# points the tiny test models at a carried tokenizer (.gpu_assets/qwen-tokenizer) when present,
# runs the raw-kernel, sampler, executor-gate (tiny models + real-shape Qwen3-4B with random bf16
# weights) and GPU-server tests (extra pytest args, e.g. tests/test_cute_gpu.py, are added), and prints
# the gate table. Logs go to $OUT (default bench/out).
set -uo pipefail
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
[ -f .gpu_assets/qwen-tokenizer/tokenizer.json ] && export OPENINFER_TEST_TOKENIZER=$PWD/.gpu_assets/qwen-tokenizer
export OPENINFER_GATE_LOG=$OUT/gate.jsonl OPENINFER_GATE_4B=${OPENINFER_GATE_4B:-1}
rm -f "$OPENINFER_GATE_LOG"
date -u +"date: %Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cupy, torch, transformers; print('cupy', cupy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m pytest -q -s -rfE -p no:cacheprovider "$@" \
  tests/test_raw_cuda_kernels.py tests/test_gpu_sampler.py tests/test_gpu_executor.py tests/test_gpu_graphs.py \
  tests/test_gpu_server.py \
  2>&1 | tee "$OUT/pytest.log" | grep -vE "^GATE |^$"
status=${PIPESTATUS[0]}
python3 - "$OPENINFER_GATE_LOG" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])] if __import__("os").path.exists(sys.argv[1]) else []
print("\n| case | pos | tie tol | agree | agree@0.02 | strict | mean abs dlogprob | p99 | mean bound "
      "| HF bf16 agree | HF bf16 agree@0.02 | HF bf16 mean | HF bf16 p99 |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['case']} | {r['positions']} | {r['tie_tol']:.3f} | {r['agree']:.4f} | {r['agree_002']:.4f} | "
          f"{r['strict']:.4f} | {r['mean']:.4f} | {r['p99']:.4f} | {r['bound']:.4f} | {r['hf_bf16_agree']:.4f} | "
          f"{r['hf_bf16_agree_002']:.4f} | {r['hf_bf16_mean']:.4f} | {r['hf_bf16_p99']:.4f} |")
PY
exit "$status"

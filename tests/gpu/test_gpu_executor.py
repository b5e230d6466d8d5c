"""Accuracy gate of the GPU executor, with Hugging Face transformers on the same GPU as the oracle.

Teacher-forced logits through several KV paths (batched mixed-length prefill, prefill-then-decode,
chunked prefill) against HF float32, with HF bf16 vs HF float32 beside it as the bf16 noise floor:
  * argmax agreement by regret >= 99%: our pick is within the tie tolerance of the oracle's best, in
    the oracle's own logprobs; the tolerance is max(0.02, p99 of |Δlogprob| of HF bf16 vs HF float32
    on the same positions), i.e. a flip counts as a tie when the two tokens are closer than the bf16
    error of a single logprob. Measured on the tiny models (CPU, transformers 5.24): that p99 is
    0.04-0.49 nats (logit spread 1.5-8), and HF bf16 itself agrees with float32 on only 95-99% of
    positions at a flat 0.02 tolerance, so a flat 0.02 would fail the reference implementation;
    the strict and the 0.02 agreements are printed beside it;
  * mean |Δlogprob| over the full vocabulary <= max(0.02, 2 × the measured floor) (DESIGN.md: where
    the named bound is below the floor, the bound comes from the floor, and the report says so).
Plus: batch-1 determinism, batched == batch-1 greedy, GPU == CPU greedy over 64 steps, and the
real-shape Qwen3-4B with random bf16 weights (OPENINFER_GATE_4B=1; bench/gpu_suite.sh sets it).
Each gate row is printed and appended as JSON to $OPENINFER_GATE_LOG when set.
"""
from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep
from engine.loader import load_model
from engine.request import SamplingParams
from harness.executors import new_gpu_executor
from harness.free_running_models import hf_autocast
from harness.models import TINY_MODELS, engine_logits, log_softmax, random_sequences, tiny_model_path, write_random_qwen3

pytestmark = pytest.mark.gpu
MIN_TIE_TOL = 0.02
MIN_AGREEMENT = 0.99
MAX_MEAN_DLOGPROB = 0.02
CHAOTIC_P99 = 0.5        # nats: HF bf16's p99 error of a logprob above which a model's argmax flips are noise
REAL_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench", "configs")
QWEN3_4B_CONFIG = os.path.join(REAL_CONFIGS, "qwen3-4b", "config.json")


# ---- oracle and metrics ------------------------------------------------------------------------
def hf_gpu_models(path: str):
    import torch
    from transformers import AutoModelForCausalLM

    m32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    m16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager")
    return m32.cuda().eval(), m16.cuda().eval()


def hf_run(model, ids: list[int]) -> np.ndarray:
    """HF's logits of one sequence (DeepSeek-V4 in bf16 under bf16 autocast: harness.free_running_models.hf_autocast)."""
    import torch

    with torch.no_grad(), hf_autocast(model):
        return model(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()


def tiny_oracle(name: str):
    """A tiny model (TINY_MODELS / SPARSE_MODELS), 4 random sequences (96, 61, 80, 33 tokens) and HF's float32
    and bf16 logits of them: (model, seqs, o32, o16)."""
    path = tiny_model_path(name)
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=1)
    m32, m16 = hf_gpu_models(path)
    o32, o16 = [hf_run(m32, s) for s in seqs], [hf_run(m16, s) for s in seqs]
    del m32, m16
    return model, seqs, o32, o16


def gate_row(name: str, engine: list[np.ndarray], o32: list[np.ndarray], o16: list[np.ndarray]) -> dict:
    e, a, b = (np.concatenate(x) for x in (engine, o32, o16))
    le, l32, l16 = log_softmax(e), log_softmax(a), log_softmax(b)
    best = l32.argmax(-1)
    rows = np.arange(len(best))

    d, floor = np.abs(le - l32), np.abs(l16 - l32)
    tie_tol = max(MIN_TIE_TOL, float(np.percentile(floor, 99)))

    def agreement(lp, tol):
        return float(np.mean(l32[rows, best] - l32[rows, lp.argmax(-1)] <= tol))

    row = dict(case=name, positions=int(len(best)), tie_tol=tie_tol, agree=agreement(le, tie_tol),
               agree_002=agreement(le, MIN_TIE_TOL), strict=float(np.mean(le.argmax(-1) == best)),
               mean=float(d.mean()), p99=float(np.percentile(d, 99)),
               hf_bf16_agree=agreement(l16, tie_tol), hf_bf16_agree_002=agreement(l16, MIN_TIE_TOL),
               hf_bf16_mean=float(floor.mean()), hf_bf16_p99=float(np.percentile(floor, 99)))
    row["bound"] = max(MAX_MEAN_DLOGPROB, 2 * row["hf_bf16_mean"])
    print("GATE " + json.dumps(row))
    if os.environ.get("OPENINFER_GATE_LOG"):
        with open(os.environ["OPENINFER_GATE_LOG"], "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def assert_gate(row: dict) -> None:
    """99% of positions agree with float32 up to a tie, and a short case (under 100 positions) may miss one:
    the bf16 floor flips a near-tie now and then, in HF's bf16 forward as in ours. Where HF's own bf16
    forward is chaotic (a single logprob's p99 error over 0.5 nats: the tiny DeepSeek-V3 / Kimi-K2 models,
    whose sigmoid routing x 2.5-2.8 lets a bf16 rounding flip an expert; HF bf16 agrees on 97.4% of 270
    positions, CPU and H200 alike), the count of flips is itself noise: ours may miss as many as HF bf16 does
    plus two standard deviations of a count that size (2 sqrt(n), at least 2). Measured on an H100 with the
    tiny DeepSeek-V3's FP8 experts (2026-12-07): HF bf16 missed 9 of 270, HF bf16 without the activation
    quantization 8, and the engine 7 to 14 over its three paths and three executor settings, every one with a
    mean |dlogprob| at or below HF bf16's (0.213-0.223 against 0.227); the mean bound still catches a real error."""
    misses = round((1 - row["agree"]) * row["positions"])
    hf_misses = round((1 - row["hf_bf16_agree"]) * row["positions"])
    chaotic = row["hf_bf16_p99"] > CHAOTIC_P99
    allowed = hf_misses + max(2, math.ceil(2 * math.sqrt(hf_misses))) if chaotic else 1
    assert row["agree"] >= MIN_AGREEMENT or misses <= allowed, row
    assert row["mean"] <= row["bound"], row


# ---- tiny models -------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(TINY_MODELS))
def tiny(request):
    path = tiny_model_path(request.param)
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [96, 61, 80, 33], seed=1)
    m32, m16 = hf_gpu_models(path)
    o32 = [hf_run(m32, s) for s in seqs]
    o16 = [hf_run(m16, s) for s in seqs]
    del m32, m16
    ex = new_gpu_executor(model)
    yield request.param, model, ex, seqs, o32, o16
    ex.close()


PATHS = {
    "prefill": dict(),
    "decode": dict(prefill=[20, 7, 33, 1], chunks=1),
    "chunked": dict(chunks=[7, 16, 5, 9], seed=3),
}


@pytest.mark.parametrize("path_name", sorted(PATHS))
def test_tiny_gate(tiny, path_name):
    name, _, ex, seqs, o32, o16 = tiny
    engine = engine_logits(ex, seqs, **PATHS[path_name])
    assert_gate(gate_row(f"{name}/{path_name}", engine, o32, o16))


@pytest.mark.parametrize("backend", ["cute", "cublas"])
def test_tiny_gate_gemm_library(tiny, backend):
    """Each GEMM library for every product (the default "auto" splits them by rows): "cute", prefill
    products on its tile plans with o_proj / down_proj accumulating into the residual stream in
    their epilogue, chunked steps on split-K plans (the reduction adds the residual), CUDA-graph
    decode; "cublas", the same steps on cuBLAS (beta = 1 for the residual). The same gate against
    HF float32."""
    from openinfer_kernels.cute import available

    if backend == "cute" and not available():
        pytest.skip(f"CuTe kernels unavailable: {available().reason}")
    name, model, _, seqs, o32, o16 = tiny
    ex = new_gpu_executor(model, gemm=backend)
    try:
        assert (ex.gemm.cute is not None) == (backend == "cute")
        for path_name in sorted(PATHS):
            engine = engine_logits(ex, seqs, **PATHS[path_name])
            assert_gate(gate_row(f"{name}/{backend}/{path_name}", engine, o32, o16))
    finally:
        ex.close()


def test_tiny_batch1_deterministic(tiny):
    _, _, ex, seqs, _, _ = tiny
    first = engine_logits(ex, [seqs[0]])[0]
    again = engine_logits(ex, [seqs[0]])[0]
    assert np.array_equal(first, again)


def greedy(executor, prompts: list[list[int]], steps: int, seed: int = 0,
           lora_slots: list[int | None] | None = None) -> list[list[int]]:
    """Free-running greedy decode of every prompt together (prefill, then one token a step); lora_slots:
    per prompt, the executor's LoRA slot it runs with (None: the base model); prompt i keeps its state (a line
    with state slots) in slot i."""
    rng = random.Random(seed)
    free = list(range(executor.num_kv_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(len(p) + steps) // BLOCK_SIZE))] for p in prompts]
    toks, start = [list(p) for p in prompts], [0] * len(prompts)
    for _ in range(steps):
        batch = [SeqStep(seq_id=i, token_ids=toks[i][start[i]:], start_pos=start[i], block_table=tables[i],
                         sample=True, params=SamplingParams(temperature=0.0), prompt_len=len(p),
                         history=list(toks[i]), num_generated=len(toks[i]) - len(p),
                         lora_id=0 if not lora_slots or lora_slots[i] is None else lora_slots[i] + 1,
                         state_slot=i if executor.num_state_slots else -1)
                 for i, p in enumerate(prompts)]
        slots = {s + 1: s for s in lora_slots or [] if s is not None}
        out = executor.execute(ModelBatch.build(batch, slots or None))
        for i, t in enumerate(out.sampled):
            start[i] = len(toks[i])
            toks[i].append(t.token_id)
    return [t[len(p):] for t, p in zip(toks, prompts)]


def assert_same_or_tie(reference_executor, prompt, ours, theirs, tol: float, what: str,
                       lora_slot: int | None = None) -> bool:
    """Two greedy continuations are identical, or first differ where our token is within `tol` nats of
    the best in the reference's own logprobs (teacher-forced on the shared prefix, with the LoRA slot
    the sequence ran with): a genuine tie. Returns whether they were identical."""
    if ours == theirs:
        return True
    j = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
    lp = log_softmax(engine_logits(reference_executor, [prompt + theirs[:j]], lora_slots=[lora_slot])[0][-1:])[0]
    regret = float(lp.max() - lp[ours[j]])
    print(f"{what}: greedy diverges at step {j}, regret {regret:.4f} (tie tolerance {tol})")
    assert regret <= tol, (what, j, regret)
    return False


def test_tiny_batched_equals_batch1(tiny):
    """Batched eager decode (mixed prompt lengths, 4 sequences) gives batch 1's greedy tokens; the
    only allowed difference is a flip inside a tie: 0.02 nats, or the gate's tie tolerance (the p99 of
    HF bf16's error) on a model whose bf16 floor is wider (MoE routing and the products' kernels change
    with the batch, so the activations round differently from the first layer on). A greedy run's first
    divergence is the worst of ~100 positions (4 prompts x 24 steps), so its tolerance is the floor's p99.9
    (the p99 of a single position's error is exceeded once in a hundred positions by HF bf16 itself)."""
    name, _, ex, seqs, o32, o16 = tiny
    floor = np.abs(log_softmax(np.concatenate(o16)) - log_softmax(np.concatenate(o32)))
    tol = max(MIN_TIE_TOL, float(np.percentile(floor, 99.9)))
    prompts = [s[:n] for s, n in zip(seqs, [5, 17, 33, 2])]
    batched = greedy(ex, prompts, 24)
    same = sum(assert_same_or_tie(ex, p, b, greedy(ex, [p], 24)[0], tol, f"{name} batched vs batch-1")
               for p, b in zip(prompts, batched))
    print(f"{name}: batched == batch-1 greedy for {same}/{len(prompts)} sequences over 24 steps")


# GPU (bf16 activations) vs CPU (float32 activations, bf16-rounded weights) on qwen3_untied: the p99
# bf16 error of one logprob on this model is 0.044 nats (HF bf16 vs float32), so a flip with regret
# under 0.1 is a tie, not a bug.
GPU_CPU_TIE_TOL = 0.1


def test_prompt_logprobs_and_ranks(tiny):
    """The eager path's prompt logprobs (echo, prompt_logprobs): within the bf16 floor of HF float32, and each
    token's rank consistent with the top-k."""
    from test_golden import assert_prompt_ranks
    name, model, ex, seqs, o32, o16 = tiny
    steps, start = [], 0
    for i, p in enumerate(seqs):
        n = -(-len(p) // BLOCK_SIZE)
        steps.append(SeqStep(seq_id=i, token_ids=p, start_pos=0, block_table=list(range(start, start + n)),
                             sample=True, params=SamplingParams(temperature=0.0, prompt_logprobs=5),
                             want_prompt_logprobs=True))
        start += n
    out = ex.execute(ModelBatch.build(steps))
    for i, (p, o, o_bf16) in enumerate(zip(seqs, o32, o16)):
        got, lp = out.prompt_logprobs[i], log_softmax(o)
        floor = np.abs(log_softmax(o_bf16) - lp)[np.arange(len(p) - 1), p[1:]].max()
        err = np.abs(np.asarray(got.logprobs) - lp[np.arange(len(p) - 1), p[1:]]).mean()
        assert err <= max(MAX_MEAN_DLOGPROB, 2 * floor), (name, err, floor)
        assert_prompt_ranks(got, p, None, 0.0)


def test_gpu_equals_cpu_greedy_64_steps():
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of

    model = load_model(tiny_model_path("qwen3_untied"))
    gpu = new_gpu_executor(model)
    cpu = CpuExecutor(model, options_of(num_kv_blocks=96, max_model_len=512, dtype="bfloat16"))
    prompts = [[1, 2, 3, 4, 5], list(range(100, 137))]
    g, c = greedy(gpu, prompts, 64), greedy(cpu, prompts, 64)
    same = sum(assert_same_or_tie(cpu, p, a, b, GPU_CPU_TIE_TOL, "GPU vs CPU") for p, a, b in zip(prompts, g, c))
    print(f"GPU == CPU greedy: {same}/{len(prompts)} sequences identical over 64 steps")
    gpu.close()


# ---- real-shape Qwen3-4B, random bf16 weights --------------------------------------------------
@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("OPENINFER_GATE_4B") != "1", reason="set OPENINFER_GATE_4B=1 (bench/gpu_suite.sh)")
def test_qwen3_4b_random_gate():
    out_dir = os.environ.get("OPENINFER_QWEN3_4B_DIR", "/tmp/qwen3-4b-random")
    real_shape_gate(QWEN3_4B_CONFIG, out_dir, "qwen3-4b-random",
                    {"prefill": {}, "decode": dict(prefill=[40, 13, 1], chunks=1)})


def real_shape_gate(config_path: str, out_dir: str, label: str, paths: dict[str, dict]) -> None:
    """A real-shape model with random bf16 weights (written once into out_dir) against HF float32, HF bf16
    beside it as the floor, on 3 sequences (128, 97, 64 tokens) through each engine_logits path."""
    import copy

    import torch

    m16 = write_random_qwen3(config_path, out_dir)
    m32 = copy.deepcopy(m16).float().eval()
    seqs = random_sequences(151000, [128, 97, 64], seed=2)
    o32 = [hf_run(m32, s) for s in seqs]
    o16 = [hf_run(m16, s) for s in seqs]
    del m32, m16
    torch.cuda.empty_cache()
    ex = new_gpu_executor(load_model(out_dir), max_model_len=1024, num_kv_blocks=64)
    try:
        for path_name, kw in paths.items():
            assert_gate(gate_row(f"{label}/{path_name}", engine_logits(ex, seqs, **kw), o32, o16))
    finally:
        ex.close()

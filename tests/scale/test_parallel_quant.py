"""Tensor-parallel ranks keep quantized weights quantized (engine/parallel/kept_shards.py): each rank holds its
shard of the codes with their scales (and zeros), never a dequantized copy, and scores as one executor does.

* Logits: two numpy ranks against one executor on the same kept folder, teacher-forced through a prefill, then
  decode and chunked prefill. int4 (exact to its dequantized weights on both): argmax equal and max |Δlogprob|
  <= 1e-4 over the vocabulary (float32 against float32, the ranks summing the same products in another order).
  FP8 W8A8: the row-parallel cuts fall on the activations' 128-groups, so each rank quantizes its activations as
  one executor does, but the next layer's activation quantization turns that float32 summation order into a
  whole e4m3 step now and then (measured: 2 of 81 positions at 0.22 nats on the block folder, the rest <= 4e-6):
  the median position within 1e-4 of one executor, and TP=2 passes the gate one executor passes
  (tests/kernels/test_fp8_w8a8.py floor_gate: against transformers with its activations quantized, the floor
  the worst of that oracle's float64 and jittered float32 realizations; the MoE folder's, float64 alone). Folders: FP8 block-scaled (quant_method
  fp8, [128, 128]), FP8 channel-scaled (compressed-tensors float-quantized), AWQ, GPTQ and compressed-tensors
  pack-quantized int4 (group 128), and Qwen3-MoE with FP8 block-scaled experts (and attention) or compressed-tensors int4 experts (group 32).
* Bytes: every split kept weight's rank shards are the whole weight's codes (and scales) cut, each rank holding
  1 / N of the codes, still kept (not dequantized).
* Refusal at start (before any rank is built): a cut inside a 128-row block (q / k / v of 32-wide heads), inside
  a 128-column block or an int4 group (o_proj's K of 128 over 2 ranks), naming the weight and the sizes.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.executor.cpu import CpuExecutor
from engine.executor.options import options_of
from engine.loader import load_model
from engine.models.quant_experts import KEPT, Fp8Experts, W4Experts
from engine.models.quant_linear import Fp8Linear, W4Linear
from engine.parallel.launch import create_parallel_executor, start_cpu_ranks
from engine.parallel.sharding import COLS, EXPERTS, ROWS, Shard, shard_model, split_of
from harness.models import engine_logits, log_softmax, test_prompts
from harness.quant_models import (fp8_moe_tiny, fp8_tiny, hf_w8a8_floors, hf_w8a8_logits, hf_w8a8_moe_logits,
                                  int4_tiny, moe_source)
from harness.quantized import int4_experts_folder
from test_fp8_w8a8 import floor_gate

MAX_DLOGPROB = 1e-4
PATHS = {"prefill": {}, "prefill_then_decode": dict(prefill=[5, 9, 3, 12], chunks=1),
         "chunked_prefill": dict(chunks=5, seed=3)}


def int4_moe_tiny() -> str:
    src = moe_source("qwen3_moe", tp2=True)
    return int4_experts_folder(src, src + "-int4", src + "-int4-ref", group=32)[0]


FOLDERS = {   # case -> (folder, the kept type it must load)
    "fp8-block": (lambda: fp8_tiny("qwen3", "block", tp2=True)[0], Fp8Linear),
    "fp8-channel": (lambda: fp8_tiny("qwen3", "channel", tp2=True)[0], Fp8Linear),
    "awq": (lambda: int4_tiny("qwen3", "awq", tp2=True)[0], W4Linear),
    "gptq": (lambda: int4_tiny("qwen3", "gptq", tp2=True)[0], W4Linear),
    "compressed-tensors": (lambda: int4_tiny("qwen3", "compressed-tensors", tp2=True)[0], W4Linear),
    "fp8-experts": (lambda: fp8_moe_tiny("qwen3_moe", tp2=True)[0], Fp8Experts),
    "int4-experts": (int4_moe_tiny, W4Experts),
}


def options(n: int = 1):
    return options_of(num_kv_blocks=48, max_model_len=512, tensor_parallel_size=n)


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def case(request):
    folder, kind = FOLDERS[request.param]
    model = load_model(folder())
    assert any(isinstance(w, kind) for w in model.weights.values()), request.param
    parallel = start_cpu_ranks(model, options(2))
    yield request.param, model, CpuExecutor(model, options()), parallel
    parallel.close()


@pytest.mark.parametrize("path", sorted(PATHS))
def test_kept_ranks_score_as_one_executor(case, path):
    name, model, single, parallel = case
    prompts = test_prompts(model.tokenizer)
    got, want = (engine_logits(ex, prompts, **PATHS[path]) for ex in (parallel, single))
    rows = np.concatenate([np.abs(log_softmax(g) - log_softmax(w)).max(-1) for g, w in zip(got, want)])
    agree = np.mean(np.concatenate([g.argmax(-1) == w.argmax(-1) for g, w in zip(got, want)]))
    print(f"\n{name} {path}: argmax {agree:.3f}, max |dlogprob| {rows.max():.2e}, median {np.median(rows):.1e}")
    if not name.startswith("fp8"):
        assert agree == 1.0 and rows.max() <= MAX_DLOGPROB
        return
    assert np.median(rows) <= MAX_DLOGPROB
    ref = FOLDERS[name][0]() + "-ref"
    if name == "fp8-experts":
        oracle, floor = ([hf_w8a8_moe_logits(ref, p, "qwen3_moe", d) for p in prompts] for d in (False, True))
        floors = [floor]
    else:
        oracle, floors = [hf_w8a8_logits(ref, p) for p in prompts], hf_w8a8_floors(ref, prompts)
    row = floor_gate(got, oracle, floors)
    assert row["mean"] <= row["bound"] and row["misses"] <= row["floor_misses"] + 1, row


def _codes(w) -> np.ndarray:
    return w.w4.codes if isinstance(w, (W4Linear, W4Experts)) else np.asarray(w.codes)


def _scales(w) -> np.ndarray:
    return w.w4.scales if isinstance(w, (W4Linear, W4Experts)) else w.scale


def test_each_rank_holds_its_shard_of_the_codes(case):
    """Every split kept weight: each rank's shard is kept (the same type), its codes 1 / N of the whole's bytes,
    and the ranks' codes and scales put back together are the whole weight's."""
    _, model, _, _ = case
    ranks = [shard_model(model, Shard(r, 2)).weights for r in range(2)]
    specs = {s.name: s for s in model.model.weight_specs()}
    split = {n: split_of(n, model.config).kind for n, w in model.weights.items() if isinstance(w, KEPT)}
    assert {ROWS, COLS} <= set(split.values()) or EXPERTS in split.values()
    for name, kind in split.items():
        whole, shards = model.weights[name], [r[name] for r in ranks]
        assert all(type(s) is type(whole) for s in shards), name
        assert all(_codes(s).nbytes * 2 == _codes(whole).nbytes for s in shards), name
        if kind == COLS:
            np.testing.assert_array_equal(np.concatenate([_codes(s) for s in shards], axis=-1), _codes(whole))
        elif kind == EXPERTS:
            for get in (_codes, _scales):
                np.testing.assert_array_equal(np.concatenate([get(s) for s in shards]), get(whole))
        else:        # q, k, v (and gate, up) rows: each part's rows split, so check by dequantizing the parts back
            rows = [np.asarray(s) for s in shards]
            halves = [np.split(r, len(specs[name].parts)) for r in rows]
            joined = np.concatenate([np.concatenate(parts) for parts in zip(*halves)])
            np.testing.assert_array_equal(joined, np.asarray(whole))


@pytest.mark.parametrize("folder,words", [
    (lambda: fp8_tiny("qwen3", "block")[0], ["layers.0.qkv_proj", "rows 0..64", "128-row"]),
    (lambda: int4_tiny("qwen3", "awq")[0], ["layers.0.o_proj", "columns 0..64", "128-column", "group 128"]),
])
def test_a_cut_inside_a_scale_block_or_group_is_refused_at_start(folder, words):
    model = load_model(folder())
    with pytest.raises(ValueError, match="tensor_parallel_size 2") as e:
        create_parallel_executor(model, options(2), "cpu")
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize("name", ["fp8-block", "int4-experts"])
def test_a_gpu_rank_dequantizes_its_kept_shard(name):
    """A GPU rank builds its executor over dequantized_model(shard): no kept weight left, each the float32 of its
    codes and scales; a model without kept weights passes through as it is."""
    from engine.parallel.kept_shards import dequantized_model
    model = load_model(FOLDERS[name][0]())
    shard = shard_model(model, Shard(0, 2))
    plain = dequantized_model(shard)
    kept = [n for n, w in shard.weights.items() if isinstance(w, KEPT)]
    assert kept and not any(isinstance(w, KEPT) for w in plain.weights.values())
    for n in kept:
        np.testing.assert_array_equal(plain.weights[n], shard.weights[n].dequantized())
    assert dequantized_model(plain) is plain

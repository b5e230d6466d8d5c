"""GPU accuracy gate of the DeepSeek-V4 line (the tiny model of harness DSV4_MODELS: one sliding, one
compressed-sparse and one heavily-compressed layer, a hash-routed MLP first, 3 hyper-connection streams) by the
DESIGN.md floor method, as test_gpu_moe_mla / test_gpu_dsv3 run it (HF float32 the oracle, HF bf16 vs float32 the
floor): prefill, decode, chunked prefill, each GEMM library, batch 1 twice bit-identical, batched == batch 1, mixed
steps, a prefix-cache hit's replay into fresh compressor rings equal to the recompute. Plus the line's real
checkpoint format on the GPU (dequantized at load, uploaded as bf16): FP8 projections and FP4 experts
(bench/deepseek_weights.py's writer, at a small width) against transformers on the dequantized weights.

Decode steps replay CUDA graphs (DeepseekV4ForCausalLM.cuda_graphs; gpu_dsv4_ops.device_attention): every bucket
warmed up, then free-running greedy batches that straddle the buckets against an executor built with graphs off
(the same device path launched op by op), eager prefills between the replays (the graphs' temporaries in their own
memory pool); the gate tests above run with graphs on, so their decode is the graphed one.
"""
from __future__ import annotations

import numpy as np
import pytest

import test_gpu_moe_mla as moe_mla
from engine.loader import load_model
from harness.executors import new_gpu_executor
from harness.models import DSV4_MODELS, engine_logits, random_sequences, tiny_model_path
from test_gpu_executor import (MIN_TIE_TOL, assert_gate, assert_same_or_tie, gate_row, greedy,  # noqa: F401
                               hf_gpu_models, hf_run, test_tiny_batch1_deterministic, test_tiny_batched_equals_batch1,
                               test_tiny_gate, test_tiny_gate_gemm_library)
from test_gpu_moe_mla import test_tiny_mixed_steps_gate  # noqa: F401

pytestmark = pytest.mark.gpu
NAMES = sorted(DSV4_MODELS)


@pytest.fixture(scope="module", params=NAMES)
def tiny(request):
    yield from moe_mla.tiny_case(request.param)


@pytest.mark.parametrize("name", NAMES)
def test_prefix_hit_replay_equals_recompute(name):
    """A prefix hit of 48 tokens (3 blocks) as the scheduler runs it: the hit's sequence in a state slot of its
    own whose rings hold NaN (bf16 0x7FC0: a read of a row the replay did not write shows), replaying the
    replay_tokens(48) tokens before the hit (KV slots -1: the restored K rows and entries kept) and the rest in
    chunks that read the rings (CSA's window closing at 55 reads 48..52 there, HCA's at 63 56..60) scores as
    the sequence computed from 0 in the same chunks."""
    from engine.batch import ModelBatch, SeqStep

    model = load_model(tiny_model_path(name))
    ex = new_gpu_executor(model, cuda_graphs=False)
    try:
        seq = random_sequences(model.config.vocab_size, [70], seed=5)[0]
        start = 48 - model.model.replay_tokens(48)
        cuts = [(0, start), (start, 53), (53, 61), (61, 70)]

        def run(seq_id, slot, table, steps, kv_from=0):
            return np.concatenate([ex.forward_logits(ModelBatch.build([SeqStep(
                seq_id, seq[a:b], a, table, False, state_slot=slot, kv_from=kv_from)])) for a, b in steps])

        want = run(0, 0, [0, 1, 2, 3, 4], cuts)[48:]
        run(1, 1, [5, 6, 7], [(0, 48)])                                     # the cached prefix
        for ring in ex.state.values():
            ring[:, 2] = 0x7FC0
        got = run(2, 2, [5, 6, 7, 8, 9], cuts[1:], kv_from=48)[48 - start:]
        moe_mla.assert_same_scores(got, want)
    finally:
        ex.close()


@pytest.mark.parametrize("name", NAMES)
def test_graph_decode_matches_eager_in_every_bucket(name):
    """Every bucket captured at warm-up (on padded rows: no KV written), then decode steps replayed in batches of
    1..9 sequences give the greedy tokens of an executor built with graphs off; a step is graphed."""
    from engine.batch import ModelBatch, SeqStep
    from engine.request import SamplingParams

    model = load_model(tiny_model_path(name))
    assert model.model.cuda_graphs
    graphed, eager = new_gpu_executor(model), new_gpu_executor(model, cuda_graphs=False)
    try:
        while graphed.warm_up():
            pass
        assert sorted(graphed.graphs.graphs) == sorted(graphed.graphs.sampling_graphs) == graphed.graphs.buckets
        assert graphed.graphs.buckets[0] == 1 and graphed.graphs.buckets[-1] >= 9
        identical = total = 0
        for n in (1, 3, 5, 9):
            prompts = random_sequences(model.config.vocab_size, [3 + 7 * i % 29 for i in range(n)], seed=n)
            g, e = greedy(graphed, prompts, 10), greedy(eager, prompts, 10)
            for p, a, b in zip(prompts, g, e):
                identical += assert_same_or_tie(eager, p, a, b, MIN_TIE_TOL, f"{name} graph vs eager, batch {n}")
                total += 1
        print(f"{name}: graph == eager greedy {identical}/{total} sequences over 10 steps")
        step = SeqStep(seq_id=0, token_ids=[5], start_pos=0, block_table=[0], sample=True,
                       params=SamplingParams(temperature=0.0), state_slot=0)
        graphed.execute(ModelBatch.build([step]))
        assert graphed.last_step_graphed is True
    finally:
        graphed.close()
        eager.close()


@pytest.mark.parametrize("name", NAMES)
def test_an_eager_step_stays_within_the_memory_left_outside_the_arena(name):
    """The eager steps' float32 temporaries come from CuPy's pool, outside the arena: a prefill step of the plan's
    max_num_batched_tokens (four prompts, and one prompt of them all: its attention chunked) takes at most what the
    executor leaves free for it (gpu_arena_sizes.eager_pool_nbytes), fragmentation included."""
    import cupy

    from engine.batch import ModelBatch, SeqStep
    from engine.executor.gpu_arena_sizes import eager_pool_nbytes

    model = load_model(tiny_model_path(name))
    ex = new_gpu_executor(model, cuda_graphs=False, num_kv_blocks=160, max_model_len=1024,
                          max_num_batched_tokens=1024)
    pool = cupy.get_default_memory_pool()
    try:
        declared = eager_pool_nbytes(ex.plan)
        for lens in ([256] * 4, [1024]):
            seqs = random_sequences(model.config.vocab_size, lens, seed=len(lens))
            per_seq = -(-lens[0] // 16)                      # whole blocks: 1024 tokens fill max_model_len
            steps = [SeqStep(i, s, 0, list(range(i * per_seq, (i + 1) * per_seq)), False, state_slot=i)
                     for i, s in enumerate(seqs)]
            ex.stream.synchronize()
            pool.free_all_blocks()
            held = pool.used_bytes()
            ex.forward_logits(ModelBatch.build(steps))
            ex.stream.synchronize()
            assert pool.total_bytes() - held <= declared, (lens, pool.total_bytes() - held, declared)
    finally:
        ex.close()


def test_fp8_checkpoint_with_fp4_experts_gate(tmp_path):
    """A DeepSeek-V4 folder in the line's real format (FP8 projections with ue8m0 block scales, FP4 experts; the
    benchmark config's 4-layer cut at a small width, tests/models/test_quantized_weights.py) on the GPU against HF float32 /
    bf16 on the same weights dequantized (the floor method)."""
    from bench.deepseek_weights import write_random_quantized
    from harness.quantized import dequantized_copy
    from test_quantized_weights import tiny_v4_config

    path = str(tmp_path / "fp8")
    write_random_quantized(tiny_v4_config(tmp_path), path, "fp8", device="cpu")
    oracle = dequantized_copy(path, str(tmp_path / "ref"))
    model = load_model(path)
    seqs = random_sequences(model.config.vocab_size, [64, 29], seed=3)
    m32, m16 = hf_gpu_models(oracle)
    o32, o16 = [hf_run(m32, s) for s in seqs], [hf_run(m16, s) for s in seqs]
    del m32, m16
    ex = new_gpu_executor(model)
    try:
        assert_gate(gate_row("deepseek_v4/fp8-fp4/chunked", engine_logits(ex, seqs, prefill=5, chunks=[1, 7]),
                             o32, o16))
    finally:
        ex.close()

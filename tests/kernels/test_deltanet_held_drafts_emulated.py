"""Speculative decoding over Gated DeltaNet state on the GPU kernels (causal_conv1d.cu, gated_delta_rule.cu held
drafts; engine/executor/gpu_held_drafts.py's codes), run by the host emulation through their GPU ops, against the
numpy executor's ops (cpu_deltanet_ops.py NumpyDeltaNetOps with its HeldDrafts), the reference: a run of steps in
which sequences prefill, verify drafts, accept some, all or none of them, decode plainly in between, and one slot is
taken over by a new sequence. Every step's conv and delta-rule outputs and the states after it agree; with the held
drafts' buffer bit flipped (the accepted rows read from the wrong buffer), they do not."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from deltanet_kernel_cases import bf16, bits, from_bits, spec_of
from test_deltanet_kernels_emulated import EmulatedOps, back, host

from engine.executor.cpu_deltanet_ops import NumpyDeltaNetOps
from engine.executor.gpu_held_drafts import HeldDraftSlots
from engine.executor.gpu_inputs import GpuStepContext

K_DRAFTS, SLOTS = 3, 4
# Each step: (seq_id, start_pos, own rows, drafts, slot) per sequence. Seq 7 prefills 6 tokens, verifies 3
# drafts (accepts 2), 3 more (accepts all 3), decodes, verifies 2 (accepts none); seq 8 decodes and verifies
# beside it; seq 9 takes seq 8's slot from position 0 while seq 8's drafts are still held there.
STEPS = [
    [(7, 0, 6, 0, 1), (8, 0, 1, 0, 3)],
    [(7, 6, 1, 3, 1), (8, 1, 1, 2, 3)],
    [(7, 9, 1, 3, 1), (8, 2, 1, 0, 3)],
    [(7, 13, 1, 0, 1), (8, 3, 1, 2, 3)],
    [(7, 14, 1, 2, 1), (9, 0, 5, 0, 3)],
    [(7, 15, 1, 0, 1), (9, 5, 1, 1, 3)],
]


def batch_of(step) -> SimpleNamespace:
    lens = [own + drafts for _, _, own, drafts, _ in step]
    seqs = [SimpleNamespace(seq_id=s, start_pos=p, num_drafts=d) for s, p, _, d, _ in step]
    positions = np.concatenate([np.arange(p, p + n) for (_, p, _, _, _), n in zip(step, lens)]).astype(np.int32)
    return SimpleNamespace(seqs=seqs, cu_seqlens=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
                           state_slots=np.array([slot for *_, slot in step], np.int32), positions=positions)


def gpu_context(batch, codes) -> GpuStepContext:
    T, B = int(batch.cu_seqlens[-1]), len(batch.seqs)
    return GpuStepContext(num_tokens=T, input_ids=None, positions=host(batch.positions), slot_mapping=None,
                          token_seq=None, block_tables=np.zeros((B, 1)), sample_rows=None, num_splits=1,
                          batch=batch, state_slots=host(batch.state_slots), cu_seqlens=host(batch.cu_seqlens),
                          held=host(codes))


def run(spec, flip_buffer: bool = False):
    """Both ops over STEPS: per step (conv, delta-rule outputs) of each, and the final states."""
    rng = np.random.default_rng(5)
    C, Hv, L = spec.conv_dim, spec.num_v_heads, spec.proj_size + 8
    conv0 = bf16(rng.standard_normal((1, SLOTS, spec.conv_kernel - 1, C)))
    rec0 = rng.standard_normal((1, SLOTS, Hv, spec.k_dim, spec.v_dim)).astype(np.float32)
    conv_w = bf16(0.5 * rng.standard_normal((C, 1, spec.conv_kernel)))
    a_log, dt_bias = bf16(np.log(rng.uniform(0.02, 0.5, Hv))), bf16(0.5 * rng.standard_normal(Hv))
    ref = NumpyDeltaNetOps({"conv": conv0.copy(), "recurrent": rec0.copy()})
    gpu = EmulatedOps()
    gpu.state = {"conv": host(bits(conv0)), "recurrent": host(rec0.copy()),
                 "held_conv": host(np.zeros((1, SLOTS, K_DRAFTS, C), np.uint16)),
                 "held_delta": host(np.zeros((1, SLOTS, 2, K_DRAFTS, C + 2 * Hv), np.uint16))}
    gpu.holds_drafts = True
    slots, outputs = HeldDraftSlots(K_DRAFTS), []
    for step in STEPS:
        batch = batch_of(step)
        T = int(batch.cu_seqlens[-1])
        proj, x = bf16(rng.standard_normal((T, L))), bf16(rng.standard_normal((T, C)))
        codes = slots.codes(batch)
        if flip_buffer:                         # the accepted drafts read from the other buffer
            codes = np.where(codes & 0xFF00, codes ^ (1 << 16), codes).astype(np.int32)
        ctx = gpu_context(batch, codes)
        got_conv = from_bits(back(gpu.causal_conv1d(host(bits(proj)), host(bits(conv_w)), spec, ctx)))
        got_o = from_bits(back(gpu.gated_delta_rule(host(bits(x)), host(bits(proj)), host(bits(a_log)),
                                                    host(bits(dt_bias)), spec, ctx)))
        rctx = SimpleNamespace(batch=batch)
        want_conv = ref.causal_conv1d(proj, conv_w, spec, rctx)
        want_o = ref.gated_delta_rule(x, proj, a_log, dt_bias, spec, rctx)
        outputs.append(((got_conv, got_o), (want_conv, want_o)))
    states = ((from_bits(back(gpu.state["conv"])), back(gpu.state["recurrent"])),
              (ref.state["conv"], ref.state["recurrent"]))
    return outputs, states


def assert_agree(outputs, states) -> None:
    for i, ((conv, o), (want_conv, want_o)) in enumerate(outputs):
        np.testing.assert_allclose(conv, want_conv, rtol=2e-2, atol=2e-3, err_msg=f"step {i} conv")
        np.testing.assert_allclose(o, want_o, rtol=3e-2, atol=3e-3, err_msg=f"step {i} delta rule")
    (conv, rec), (want_conv, want_rec) = states
    live = [1, 3]
    np.testing.assert_allclose(conv[:, live], want_conv[:, live], rtol=1e-2, atol=1e-3, err_msg="conv state")
    np.testing.assert_allclose(rec[:, live], want_rec[:, live], rtol=2e-2, atol=2e-3, err_msg="recurrent state")


@pytest.mark.parametrize("shape", [(1, 3, 16, 8, 4), (2, 4, 32, 40, 3)], ids=str)
def test_held_drafts_match_the_numpy_executor(shape):
    assert_agree(*run(spec_of(*shape)))


def test_the_wrong_buffer_is_caught():
    with pytest.raises(AssertionError):
        assert_agree(*run(spec_of(1, 3, 16, 8, 4), flip_buffer=True))


def test_a_step_outside_the_held_drafts_is_refused():
    slots = HeldDraftSlots(K_DRAFTS)
    slots.codes(batch_of([(7, 6, 1, 3, 1)]))
    with pytest.raises(RuntimeError, match="outside the drafts"):
        slots.codes(batch_of([(7, 11, 1, 0, 1)]))
    with pytest.raises(ValueError, match="at most 3 drafts"):       # past the held buffers' rows
        slots.codes(batch_of([(8, 4, 1, 4, 2)]))

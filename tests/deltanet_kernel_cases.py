"""Inputs and numpy expectations for the Gated DeltaNet GPU ops (engine/executor/gpu_deltanet_ops.py),
shared by the host-emulated kernel test and the GPU test. The expectations mirror the kernels' bf16
roundings (they round where HF's bf16 forward rounds) on top of the float32 reference of
engine/executor/cpu_deltanet_ops.py. Arrays are plain numpy; bf16 values travel as uint16 bits."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from engine.executor.cpu_deltanet_ops import (_l2norm, _sigmoid, _silu, _softplus, chunked_gated_delta_rule,
                                              delta_rule_step)
from engine.models.ops import LinearAttentionSpec

BF16 = ml_dtypes.bfloat16


def bf16(a) -> np.ndarray:
    """float32 values rounded to bf16 (nearest even), kept as float32."""
    return np.asarray(a, np.float32).astype(BF16).astype(np.float32)


def bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).astype(BF16).view(np.uint16)


def from_bits(a) -> np.ndarray:
    return np.asarray(a).view(BF16).astype(np.float32)


@dataclass
class Step:
    """A step's sequences: token counts, first positions, state slots (-1: a padding row)."""
    lens: list[int]
    starts: list[int]
    slots: list[int]

    @property
    def cu(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int32)

    @property
    def positions(self) -> np.ndarray:
        return np.concatenate([np.arange(s, s + n) if slot >= 0 else np.full(n, -1)
                               for n, s, slot in zip(self.lens, self.starts, self.slots)]).astype(np.int32)

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.lens)


# (Hk, Hv, Dk, Dv, conv width; the last has Qwen3.5-4B's head dims), and steps: mixed (a 70-token
# sequence: two delta-rule chunks), decode (one fresh sequence, one padding row)
SHAPES = [(1, 3, 16, 8, 4), (2, 4, 32, 40, 3), (1, 2, 128, 128, 4)]
STEPS = {"mixed": Step(lens=[1, 70, 5], starts=[9, 0, 4], slots=[2, 0, 3]),
         "decode": Step(lens=[1, 1, 1, 1], starts=[5, 0, 12, 0], slots=[1, 3, 0, -1])}


def spec_of(Hk: int, Hv: int, Dk: int, Dv: int, K: int = 4) -> LinearAttentionSpec:
    return LinearAttentionSpec(layer=0, num_k_heads=Hk, num_v_heads=Hv, k_dim=Dk, v_dim=Dv, conv_kernel=K,
                               rms_eps=1e-6)


def random_inputs(spec: LinearAttentionSpec, step: Step, num_slots: int, seed: int = 0) -> dict:
    """bf16 proj [T, proj_size + 8] (a row stride past its columns), conv weight, A_log, dt_bias, the
    conv output x [T, conv_dim], norm weight, float32 recurrent and bf16 conv states of num_slots slots."""
    rng = np.random.default_rng(seed)
    T = int(sum(step.lens))
    C, Hv = spec.conv_dim, spec.num_v_heads
    proj = bf16(rng.standard_normal((T, spec.proj_size + 8)))
    return dict(
        proj=proj, x=bf16(rng.standard_normal((T, C))),
        conv_w=bf16(0.5 * rng.standard_normal((C, 1, spec.conv_kernel))),
        a_log=bf16(np.log(rng.uniform(0.02, 0.5, Hv))), dt_bias=bf16(0.5 * rng.standard_normal(Hv)),
        norm_w=bf16(1 + 0.2 * rng.standard_normal(spec.v_dim)),
        conv_state=bf16(rng.standard_normal((num_slots, spec.conv_kernel - 1, C))),
        rec_state=rng.standard_normal((num_slots, Hv, spec.k_dim, spec.v_dim)).astype(np.float32))


def context(step: Step, dev):
    """The GpuStepContext the ops read, its arrays put where the ops run by dev (host or device)."""
    from engine.executor.gpu_inputs import GpuStepContext
    T, B = int(sum(step.lens)), len(step.lens)
    return GpuStepContext(num_tokens=T, input_ids=None, positions=dev(step.positions), slot_mapping=None,
                          token_seq=None, block_tables=np.zeros((T if step.decode_only else B, 1)),
                          sample_rows=None, num_splits=1, state_slots=dev(np.array(step.slots, np.int32)),
                          cu_seqlens=dev(step.cu))


def run_conv_and_delta_rule(ops, spec, step: Step, inp: dict, dev, back) -> dict:
    """The conv and the delta rule through `ops` (state from inp, in slot layout [1, slots, ...]); dev puts
    an array where the ops run, back brings one to numpy. Returns outputs and states as numpy."""
    ops.state = {"conv": dev(bits(inp["conv_state"])[None]), "recurrent": dev(inp["rec_state"][None].copy())}
    ctx = context(step, dev)
    conv = ops.causal_conv1d(dev(bits(inp["proj"])), dev(bits(inp["conv_w"])), spec, ctx)
    o = ops.gated_delta_rule(dev(bits(inp["x"])), dev(bits(inp["proj"])), dev(bits(inp["a_log"])),
                             dev(bits(inp["dt_bias"])), spec, ctx)
    return dict(conv=from_bits(back(conv)), conv_state=from_bits(back(ops.state["conv"][0])), o=from_bits(back(o)),
                rec_state=back(ops.state["recurrent"][0]))


def check_conv_and_delta_rule(spec, step: Step, inp: dict, got: dict) -> None:
    """The ops' results against numpy: conv and delta-rule outputs within a bf16 ulp or two (rows of live
    sequences), the conv state exactly, the float32 recurrent state to 1e-4."""
    live = step.positions >= 0
    want_conv, want_conv_state = expect_conv(spec, step, inp)
    np.testing.assert_allclose(got["conv"][live], want_conv[live], rtol=1e-2, atol=1e-3)
    np.testing.assert_array_equal(got["conv_state"], want_conv_state)
    want_o, want_state = expect_delta_rule(spec, step, inp)
    np.testing.assert_allclose(got["o"][live], want_o[live], rtol=2e-2, atol=2e-3)
    np.testing.assert_allclose(got["rec_state"], want_state, rtol=1e-4, atol=1e-4)


def check_gated_rms_norm_and_sigmoid_gate(ops, spec, gate_width: int, dev, back) -> None:
    """gated_rms_norm and sigmoid_gate through `ops` against numpy, on the mixed step's token count."""
    step = STEPS["mixed"]
    inp = random_inputs(spec, step, num_slots=4)
    T = int(sum(step.lens))
    o = from_bits(bits(np.random.default_rng(1).standard_normal((T, spec.value_size))))
    got = back(ops.gated_rms_norm(dev(bits(o)), dev(bits(inp["proj"])), dev(bits(inp["norm_w"])), spec))
    np.testing.assert_allclose(from_bits(got), expect_gated_rms_norm(spec, o, inp), rtol=1e-2, atol=1e-3)
    x, gate = (from_bits(bits(np.random.default_rng(s).standard_normal((T, gate_width)))) for s in (2, 3))
    got = back(ops.sigmoid_gate(dev(bits(x)), dev(bits(gate))))
    np.testing.assert_array_equal(from_bits(got), expect_sigmoid_gate(x, gate))


def expect_conv(spec, step: Step, inp: dict) -> tuple[np.ndarray, np.ndarray]:
    """(out [T, C] bf16-valued, conv state after): bf16(silu(bf16(sum_j w_j x_{t-K+1+j})))."""
    C, K = spec.conv_dim, spec.conv_kernel
    x, w = inp["proj"][:, :C], inp["conv_w"].reshape(C, K)
    state = inp["conv_state"].copy()
    out = np.zeros((x.shape[0], C), np.float32)
    for q0, q1, start, slot in zip(step.cu[:-1], step.cu[1:], step.starts, step.slots):
        if slot < 0:
            continue
        prev = np.zeros((K - 1, C), np.float32) if start == 0 else state[slot]
        window = np.concatenate([prev, x[q0:q1]])
        for t in range(q1 - q0):
            acc = np.zeros(C, np.float32)
            for j in range(K):
                acc += w[:, j] * window[t + j]
            out[q0 + t] = bf16(_silu(bf16(acc)))
        state[slot] = window[q1 - q0:]
    return out, state


def expect_delta_rule(spec, step: Step, inp: dict) -> tuple[np.ndarray, np.ndarray]:
    """(o [T, Hv·Dv] bf16-valued, recurrent state after); beta rounded to bf16 as the kernels do."""
    Hk, Hv, Dk, Dv, ks = spec.num_k_heads, spec.num_v_heads, spec.k_dim, spec.v_dim, spec.key_size
    x, proj = inp["x"], inp["proj"]
    T = x.shape[0]
    rep = Hv // Hk
    q = np.repeat(_l2norm(x[:, :ks].reshape(T, Hk, Dk)), rep, axis=1) * np.float32(Dk ** -0.5)
    k = np.repeat(_l2norm(x[:, ks:2 * ks].reshape(T, Hk, Dk)), rep, axis=1)
    v = x[:, 2 * ks:].reshape(T, Hv, Dv)
    beta = bf16(_sigmoid(proj[:, spec.b_offset:spec.b_offset + Hv]))
    g = -np.exp(inp["a_log"]) * _softplus(proj[:, spec.a_offset:spec.a_offset + Hv] + inp["dt_bias"])
    state = inp["rec_state"].copy()
    out = np.zeros((T, Hv, Dv), np.float32)
    for q0, q1, start, slot in zip(step.cu[:-1], step.cu[1:], step.starts, step.slots):
        if slot < 0:
            continue
        S0 = np.zeros_like(state[slot]) if start == 0 else state[slot]
        if q1 - q0 == 1:
            o, S = delta_rule_step(q[q0:q1], k[q0:q1], v[q0:q1], g[q0:q1], beta[q0:q1], S0[None])
            o, S = o, S[0]
        else:
            o, S = chunked_gated_delta_rule(q[q0:q1], k[q0:q1], v[q0:q1], g[q0:q1], beta[q0:q1], S0)
        out[q0:q1], state[slot] = o, S
    return bf16(out.reshape(T, Hv * Dv)), state


def expect_gated_rms_norm(spec, o: np.ndarray, inp: dict) -> np.ndarray:
    """bf16(bf16(w · bf16(x · rstd)) · silu(z)) per value head."""
    T, Hv, Dv = o.shape[0], spec.num_v_heads, spec.v_dim
    h = o.reshape(T, Hv, Dv)
    z = inp["proj"][:, spec.z_offset:spec.z_offset + spec.value_size].reshape(T, Hv, Dv)
    rstd = np.float32(1.0) / np.sqrt(np.mean(h * h, axis=-1, keepdims=True) + np.float32(spec.rms_eps))
    y = bf16(inp["norm_w"] * bf16(h * rstd))
    return bf16(y * _silu(z)).reshape(T, Hv * Dv)


def expect_sigmoid_gate(x: np.ndarray, gate: np.ndarray) -> np.ndarray:
    return bf16(x * bf16(_sigmoid(gate)))

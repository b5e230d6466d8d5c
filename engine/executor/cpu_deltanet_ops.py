"""The hybrid lines' op family (Gated DeltaNet + gated attention: ops.deltanet, models/ops.py DeltaNetOps) in
numpy, float32: the reference the GPU kernels are checked against.

State (memory/state_slots.py), set by the executor: state["conv"] [L, slots, K - 1, conv_dim] (the
last K - 1 inputs of the conv, oldest first) and state["recurrent"] [L, slots, Hv, Dk, Dv].

The delta rule, per value head, with q, k l2-normalized (q also scaled by Dk^-1/2):
    S_t = e^{g_t} S_{t-1} + k_t (beta_t (v_t - (e^{g_t} S_{t-1})ᵀ k_t))ᵀ,    o_t = S_tᵀ q_t.
`recurrent_gated_delta_rule` runs it token by token (decode); `chunked_gated_delta_rule` runs chunks of
CHUNK tokens at once (prefill): within a chunk, with gamma the cumulative log decay from the chunk's start,
the UT transform (I + L)^-1 (L = strictly lower (beta_i k_i·k_j e^{gamma_i - gamma_j})) turns the chunk's
updates into matrix products, and one state read / write per chunk carries the recurrence (as HF's
torch_chunk_gated_delta_rule and flash-linear-attention's chunk kernels do).
"""
from __future__ import annotations

import numpy as np

CHUNK = 64                      # tokens per chunk of the chunk-parallel delta rule (HF's default)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return np.float32(1.0) / (np.float32(1.0) + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    """torch.nn.functional.softplus (beta 1, threshold 20)."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20)))).astype(np.float32)


def _l2norm(x: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + np.float32(eps))


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Token by token. q, k [n, H, Dk] (normalized, q scaled, one per value head), v [n, H, Dv],
    g, beta [n, H], state [H, Dk, Dv] (not modified). Returns (o [n, H, Dv], new state)."""
    S = state.astype(np.float32).copy()
    o = np.empty(v.shape, np.float32)
    for t in range(q.shape[0]):
        o_t, S_t = delta_rule_step(q[t][None], k[t][None], v[t][None], g[t][None], beta[t][None], S[None])
        o[t], S = o_t[0], S_t[0]
    return o, S


def delta_rule_step(q, k, v, g, beta, S):
    """One token of B sequences at once: q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H], S [B, H, Dk, Dv].
    Returns (o [B, H, Dv], new S)."""
    S = S * np.exp(g)[..., None, None]
    kv = np.einsum("bhkv,bhk->bhv", S, k)
    delta = (v - kv) * beta[..., None]
    S = S + k[..., :, None] * delta[..., None, :]
    return np.einsum("bhkv,bhk->bhv", S, q), S


def _solve_unit_lower(L: np.ndarray, B: np.ndarray) -> np.ndarray:
    """X with (I + L) X = B, L strictly lower [..., C, C], B [..., C, N]: forward substitution."""
    X = np.array(B, np.float32)
    for i in range(1, L.shape[-1]):
        X[..., i, :] -= np.einsum("...j,...jn->...n", L[..., i, :i], X[..., :i, :])
    return X


def chunked_gated_delta_rule(q, k, v, g, beta, state, chunk: int = CHUNK):
    """The chunk-parallel form; same arguments and result as recurrent_gated_delta_rule."""
    n, H, Dk = k.shape
    Dv = v.shape[-1]
    pad = -n % chunk
    N = (n + pad) // chunk

    def chunks(a):                                  # [n, H, ...] -> [H, N, C, ...], zero-padded
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), np.float32)]) if pad else a
        return np.moveaxis(a.reshape(N, chunk, *a.shape[1:]), 2, 0).astype(np.float32)

    q, k, v, g, beta = chunks(q), chunks(k), chunks(v), chunks(g), chunks(beta)
    gamma = np.cumsum(g, axis=-1)                                   # [H, N, C]
    lower = np.tril(np.ones((chunk, chunk), bool))
    diff = np.where(lower, gamma[..., :, None] - gamma[..., None, :], -np.inf)
    decay = np.exp(diff).astype(np.float32)                         # e^{gamma_i - gamma_j}, j <= i
    k_beta = k * beta[..., None]
    L = np.tril((k_beta @ np.swapaxes(k, -1, -2)) * decay, -1)
    rhs = np.concatenate([v * beta[..., None], k_beta * np.exp(gamma)[..., None]], axis=-1)
    sol = _solve_unit_lower(L, rhs)
    u, w = sol[..., :Dv], sol[..., Dv:]                             # (I+L)^-1 beta v, (I+L)^-1 beta k e^gamma
    attn = (q @ np.swapaxes(k, -1, -2)) * decay                     # causal within the chunk
    q_decayed = q * np.exp(gamma)[..., None]
    last = gamma[..., -1:]
    k_decayed = k * np.exp(last - gamma)[..., None]
    chunk_decay = np.exp(last)[..., None]                           # [H, N, 1, 1]
    S = state.astype(np.float32).copy()
    o = np.empty((H, N, chunk, Dv), np.float32)
    for c in range(N):
        v_new = u[:, c] - w[:, c] @ S                               # [H, C, Dv]
        o[:, c] = q_decayed[:, c] @ S + attn[:, c] @ v_new
        S = S * chunk_decay[:, c] + np.swapaxes(k_decayed[:, c], -1, -2) @ v_new
    return np.moveaxis(o, 0, 2).reshape(N * chunk, H, Dv)[:n], S


class NumpyDeltaNetOps:
    """ops.deltanet of the numpy executor over its state slots (memory/state_slots.py host_state)."""
    chunk = CHUNK

    def __init__(self, state: dict[str, np.ndarray]):
        self.state = state

    @staticmethod
    def _seq_spans(ctx):
        """(row, first token, end token, state slot, starts fresh) per sequence of the step."""
        b = ctx.batch
        cu = b.cu_seqlens
        for i, s in enumerate(b.seqs):
            yield i, int(cu[i]), int(cu[i + 1]), int(b.state_slots[i]), s.start_pos == 0

    def causal_conv1d(self, proj, weight, spec, ctx):
        C, K = spec.conv_dim, spec.conv_kernel
        x = proj[:, :C]
        w = weight.reshape(C, K)
        conv = self.state["conv"][spec.layer]                       # [slots, K - 1, C]
        out = np.empty((x.shape[0], C), np.float32)
        for _, q0, q1, slot, fresh in self._seq_spans(ctx):
            prev = np.zeros((K - 1, C), np.float32) if fresh else conv[slot]
            window = np.concatenate([prev, x[q0:q1]])              # inputs t - K + 1 ... t, oldest first
            n = q1 - q0
            y = sum(window[j:j + n] * w[:, j] for j in range(K))
            conv[slot] = window[n:]
            out[q0:q1] = _silu(y)
        return out

    def gated_delta_rule(self, x, proj, a_log, dt_bias, spec, ctx):
        T = x.shape[0]
        Hk, Hv, Dk, Dv = spec.num_k_heads, spec.num_v_heads, spec.k_dim, spec.v_dim
        ks = spec.key_size
        rep = Hv // Hk
        q = np.repeat(_l2norm(x[:, :ks].reshape(T, Hk, Dk)), rep, axis=1) * np.float32(Dk ** -0.5)
        k = np.repeat(_l2norm(x[:, ks:2 * ks].reshape(T, Hk, Dk)), rep, axis=1)
        v = x[:, 2 * ks:].reshape(T, Hv, Dv)
        beta = _sigmoid(proj[:, spec.b_offset:spec.b_offset + Hv])
        g = -np.exp(a_log.astype(np.float32)) * _softplus(proj[:, spec.a_offset:spec.a_offset + Hv] + dt_bias)
        rec = self.state["recurrent"][spec.layer]                   # [slots, Hv, Dk, Dv]
        out = np.empty((T, Hv, Dv), np.float32)
        decode = [(q0, slot, fresh) for _, q0, q1, slot, fresh in self._seq_spans(ctx) if q1 - q0 == 1]
        if decode:                                                   # one-token sequences: one batched step
            rows = np.array([r for r, _, _ in decode])
            slots = np.array([s for _, s, _ in decode])
            S = rec[slots] * np.array([not f for _, _, f in decode], np.float32)[:, None, None, None]
            out[rows], rec[slots] = delta_rule_step(q[rows], k[rows], v[rows], g[rows], beta[rows], S)
        for _, q0, q1, slot, fresh in self._seq_spans(ctx):
            if q1 - q0 > 1:
                S0 = np.zeros_like(rec[slot]) if fresh else rec[slot]
                out[q0:q1], rec[slot] = chunked_gated_delta_rule(q[q0:q1], k[q0:q1], v[q0:q1], g[q0:q1],
                                                                 beta[q0:q1], S0, self.chunk)
        return out.reshape(T, Hv * Dv)

    def gated_rms_norm(self, x, proj, weight, spec):
        T, Hv, Dv = x.shape[0], spec.num_v_heads, spec.v_dim
        z = proj[:, spec.z_offset:spec.z_offset + spec.value_size].reshape(T, Hv, Dv)
        h = x.reshape(T, Hv, Dv)
        var = np.mean(np.square(h), axis=-1, keepdims=True, dtype=np.float32)
        y = (h * (np.float32(1.0) / np.sqrt(var + np.float32(spec.rms_eps)))) * weight * _silu(z)
        return y.reshape(T, Hv * Dv).astype(np.float32)

    def sigmoid_gate(self, x, gate):
        return x * _sigmoid(gate)

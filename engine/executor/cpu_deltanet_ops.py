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

Speculative decoding (engine/batch.py SeqStep.num_drafts): a verify step's draft tokens run after the sequence's
own tokens one by one (the decode recurrence, as plain decoding runs them), from the state those left, and are
held out of the slot (HeldDrafts, per state array, layer and slot). The sequence's next step starts right after
its accepted tokens: the held drafts before that position are applied to the slot first (the same one-token
recurrence; the conv window shifted over their inputs), the rejected ones dropped; a step from position 0 drops
them all (a new sequence in the slot, or a preempted one recomputing).
"""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class HeldDrafts:
    """A verify step's draft tokens held out of one layer's state array of a slot: their rows of the inputs
    that advance it (the conv's inputs; the delta rule's q, k, v, g, beta), the first at position start_pos."""
    seq_id: int
    start_pos: int
    inputs: tuple[np.ndarray, ...]

    def accepted(self, seq_id: int, start_pos: int) -> tuple[np.ndarray, ...]:
        """The rows of the drafts before start_pos, where the sequence's next step starts (its accepted ones)."""
        n = start_pos - self.start_pos
        if seq_id != self.seq_id or not 0 <= n <= len(self.inputs[0]):
            raise RuntimeError(f"seq {seq_id} steps from position {start_pos}, outside the drafts its state slot "
                               f"holds (seq {self.seq_id}, {len(self.inputs[0])} from position {self.start_pos})")
        return tuple(a[:n] for a in self.inputs)


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's rows [q0, q1) of a step: its own tokens, then its last `drafts` rows, draft tokens."""
    seq_id: int
    q0: int
    q1: int
    slot: int
    start_pos: int
    drafts: int

    @property
    def own_end(self) -> int:
        return self.q1 - self.drafts


def _shift_window(window: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The conv window [K - 1, C] after the inputs rows."""
    return np.concatenate([window, rows])[len(rows):]


def _advance_state(S: np.ndarray, q, k, v, g, beta) -> np.ndarray:
    """The recurrent state after the rows, one token at a time (the decode recurrence)."""
    return recurrent_gated_delta_rule(q, k, v, g, beta, S)[1]


class NumpyDeltaNetOps:
    """ops.deltanet of the numpy executor over its state slots (memory/state_slots.py host_state)."""
    chunk = CHUNK

    def __init__(self, state: dict[str, np.ndarray]):
        self.state = state
        self.held: dict[tuple[str, int, int], HeldDrafts] = {}     # (state array, layer, slot) -> its drafts

    @staticmethod
    def _spans(ctx) -> list[SeqSpan]:
        b = ctx.batch
        cu = b.cu_seqlens
        return [SeqSpan(s.seq_id, int(cu[i]), int(cu[i + 1]), int(b.state_slots[i]), s.start_pos, s.num_drafts)
                for i, s in enumerate(b.seqs)]

    def _settle(self, name: str, layer: int, span: SeqSpan, advance) -> None:
        """The slot's state array at the span's start: zeros where the sequence starts (position 0), else
        advanced (advance(state, *rows)) over the held drafts it accepted; the other held drafts dropped."""
        state = self.state[name][layer]
        held = self.held.pop((name, layer, span.slot), None)
        if span.start_pos == 0:
            state[span.slot] = 0
        elif held is not None:
            accepted = held.accepted(span.seq_id, span.start_pos)
            if len(accepted[0]):
                state[span.slot] = advance(state[span.slot], *accepted)

    def _hold(self, name: str, layer: int, span: SeqSpan, inputs: tuple[np.ndarray, ...]) -> None:
        """Hold the span's draft rows of inputs until its next step (nothing without drafts)."""
        if span.drafts:
            rows = slice(span.own_end, span.q1)
            self.held[(name, layer, span.slot)] = HeldDrafts(
                span.seq_id, span.start_pos + span.own_end - span.q0, tuple(a[rows].copy() for a in inputs))

    def causal_conv1d(self, proj, weight, spec, ctx):
        C, K = spec.conv_dim, spec.conv_kernel
        x = proj[:, :C]
        w = weight.reshape(C, K)
        conv = self.state["conv"][spec.layer]                       # [slots, K - 1, C]
        out = np.empty((x.shape[0], C), np.float32)
        for span in self._spans(ctx):
            self._settle("conv", spec.layer, span, _shift_window)
            window = np.concatenate([conv[span.slot], x[span.q0:span.q1]])   # inputs t - K + 1 ... t, oldest first
            n, own = span.q1 - span.q0, span.own_end - span.q0
            y = sum(window[j:j + n] * w[:, j] for j in range(K))
            conv[span.slot] = window[own:own + K - 1]
            self._hold("conv", spec.layer, span, (x,))
            out[span.q0:span.q1] = _silu(y)
        return out

    @staticmethod
    def _delta_inputs(x, proj, a_log, dt_bias, spec) -> tuple[np.ndarray, ...]:
        """q, k [T, Hv, Dk] (normalized, q scaled), v [T, Hv, Dv], g, beta [T, Hv] of the step's rows."""
        T = x.shape[0]
        Hk, Hv, Dk, Dv = spec.num_k_heads, spec.num_v_heads, spec.k_dim, spec.v_dim
        ks = spec.key_size
        rep = Hv // Hk
        q = np.repeat(_l2norm(x[:, :ks].reshape(T, Hk, Dk)), rep, axis=1) * np.float32(Dk ** -0.5)
        k = np.repeat(_l2norm(x[:, ks:2 * ks].reshape(T, Hk, Dk)), rep, axis=1)
        v = x[:, 2 * ks:].reshape(T, Hv, Dv)
        g = -np.exp(a_log.astype(np.float32)) * _softplus(proj[:, spec.a_offset:spec.a_offset + Hv] + dt_bias)
        return q, k, v, g, _sigmoid(proj[:, spec.b_offset:spec.b_offset + Hv])

    def gated_delta_rule(self, x, proj, a_log, dt_bias, spec, ctx):
        """A sequence's own rows: one token batched with the step's others in one recurrence step, more in the
        chunked form; its draft rows after them one by one, held (HeldDrafts)."""
        inputs = self._delta_inputs(x, proj, a_log, dt_bias, spec)
        rec = self.state["recurrent"][spec.layer]                   # [slots, Hv, Dk, Dv]
        spans = self._spans(ctx)
        for span in spans:
            self._settle("recurrent", spec.layer, span, _advance_state)
        out = np.empty(inputs[2].shape, np.float32)
        single = [s for s in spans if s.own_end - s.q0 == 1]
        if single:                                                   # one own token: one batched step
            rows, slots = np.array([s.q0 for s in single]), np.array([s.slot for s in single])
            out[rows], rec[slots] = delta_rule_step(*(a[rows] for a in inputs), rec[slots])
        for s in spans:
            own, drafts = slice(s.q0, s.own_end), slice(s.own_end, s.q1)
            if s.own_end - s.q0 > 1:
                out[own], rec[s.slot] = chunked_gated_delta_rule(*(a[own] for a in inputs), rec[s.slot], self.chunk)
            if s.drafts:
                out[drafts] = recurrent_gated_delta_rule(*(a[drafts] for a in inputs), rec[s.slot])[0]
                self._hold("recurrent", spec.layer, s, inputs)
        return out.reshape(x.shape[0], -1)

    def gated_rms_norm(self, x, proj, weight, spec):
        T, Hv, Dv = x.shape[0], spec.num_v_heads, spec.v_dim
        z = proj[:, spec.z_offset:spec.z_offset + spec.value_size].reshape(T, Hv, Dv)
        h = x.reshape(T, Hv, Dv)
        var = np.mean(np.square(h), axis=-1, keepdims=True, dtype=np.float32)
        y = (h * (np.float32(1.0) / np.sqrt(var + np.float32(spec.rms_eps)))) * weight * _silu(z)
        return y.reshape(T, Hv * Dv).astype(np.float32)

    def sigmoid_gate(self, x, gate):
        return x * _sigmoid(gate)

"""The numpy executor's step cost (engine/step_budget.py StepCost) for a model, from its shape.

One token's linear layers cost a multiply-add per layer weight. One key of a sequence's context costs
reading its K and V out of the paged pool (float32, every layer; staged a group of blocks at a time and
read there by the two products, engine/executor/cpu_attention.py: memory-bound), KV_BYTE_MACS
multiply-adds' worth per byte. One (new token, key) pair costs its
score and its share of the output, 2 x head_dim multiply-adds per head and layer, and the softmax's
passes over the scores, SOFTMAX_MACS' worth.

Measured with SmolLM2-135M (106.2 M layer multiply-adds a token, 46,080 KV bytes a key, 30 layers x 9
heads of 64) on the 2-core machine, one BLAS thread, whole steps (`bench/cpu_step_cost.py`: CPU time, best
of 4; the KV blocks scattered over the pool as a server's are; 2026-12-06): a token 3.3-3.6 ms, a key
9.7-11 us (15-22 us before the staged attention), a pair 1.7-2.4 us; taken as 3.5 ms, 10 us (1/350
token) and 2.2 us (1/1,600 token). A step
may hold MIN_STEP_S of work at that core's rate (MAC_RATE) whatever its token budget: the CPU default's 76
tokens of SmolLM2 (engine/limits.py), so a smaller model's steps are not cut finer.
"""
from __future__ import annotations

import numpy as np

from engine.limits import DEFAULT_LIMITS
from engine.step_budget import StepCost

KV_BYTE_MACS = 6.6           # 106.2e6 / 350 / 46,080
SOFTMAX_MACS = 118.0         # per (head, pair), beyond 2 x head_dim: 106.2e6 / 1,600 / 270 - 128
MAC_RATE = 106.2e6 / 3.5e-3  # multiply-adds a second of one core
MIN_STEP_S = DEFAULT_LIMITS["cpu"][1] * 3.5e-3   # the work a step may hold at least (the default's SmolLM2 tokens)


def layer_macs(config, weights: dict[str, np.ndarray]) -> float:
    """Multiply-adds of one token through the decoder layers: every layer matrix once, a stack of
    experts (3-D) at num_experts_per_tok of its experts (embedding and lm_head are not per token of
    a chunk: the lm_head runs for sampled rows only)."""
    raw = config.raw
    total = 0.0
    for name, w in weights.items():
        if not name.startswith("layers.") or w.ndim < 2:
            continue
        if w.ndim == 3:
            total += w.size * min(1.0, (raw.get("num_experts_per_tok") or w.shape[0]) / w.shape[0])
        else:
            total += w.size
    return max(total, 1.0)


def cpu_step_cost(config, weights: dict[str, np.ndarray], kv_bytes_per_token: int) -> StepCost:
    """StepCost of the numpy executor for a model (config: its ModelConfig; kv_bytes_per_token: what one
    token keeps in the float32 KV pool, every layer)."""
    token = layer_macs(config, weights)
    pair = config.num_hidden_layers * config.num_attention_heads * (2 * config.head_dim + SOFTMAX_MACS)
    return StepCost(key=kv_bytes_per_token * KV_BYTE_MACS / token, pair=pair / token,
                    min_work=MIN_STEP_S * MAC_RATE / token)

"""The numpy executor's step cost (engine/step_budget.py StepCost) for a model, from its shape: bytes
read and multiply-adds, at rates measured on the 2-core machine (one BLAS thread).

The linear layers read their float32 weights once a step: at one row as matrix-vector products
(GEMV_BYTES_S); from two rows on as OpenBLAS's matrix products, which pack the weights first and read them
at a third of that rate (GEMM_BYTES_S), plus each row's multiply-adds (GEMM_MACS_S); the lm_head
likewise over the rows a step samples. A step's other calls (embedding, norms, activations, sampling)
cost STEP_LAYER_S a layer, and a sequence's attention calls SEQ_LAYER_S a layer; one key of its context,
reading its K and V out of the paged pool (staged a group of blocks at a time,
engine/executor/cpu_attention.py: memory-bound), costs its bytes at KV_BYTES_S; one (new token, key)
pair its score and share of the output, 2 x head_dim multiply-adds per head and layer, and the softmax's
passes over the scores, SOFTMAX_MACS' worth, at ATTENTION_MACS_S. A step aims at TARGET_S.

Measured with SmolLM2-135M (Q4_1 GGUF dequantized to float32: 424.8 MB of layer weights, 113.2 MB of
lm_head; 46,080 KV bytes a key; 30 layers x 9 heads of 64) on the 2-core Xeon @ 2.80 GHz, shared,
2026-12-06 17:17-17:25 UTC, CPU time, medians of 9 (bench/results/reliability.md):
`python -m bench.cpu_step_cost --products 1,2,3,4,6,8,12,16,24,32,48,64,80,96 --reps 9`, twice (load
114 -> 46, then 16 -> 9): the layers at one row 32.7 / 34.1 ms (13.0 / 12.5 GB/s), from two rows
93.1 / 101.6 ms (4.6 / 4.2 GB/s) + 2.17 / 1.92 ms a row (49 / 55 G multiply-adds/s); the lm_head 7.3 /
8.0 ms, then 31.5 / 34.1 ms + 0.44 / 0.40 ms a row. Whole steps (`python -m bench.cpu_step_cost`, 18
shapes, medians of 5) gave the rest: ~8 ms a step beyond the products, a pair 1.63 us (the slope in
chunk tokens after 8,000 less a row: 40 G multiply-adds/s); a key 10 us and a sequence's calls 1.8 ms
(30 layers) fit as measured earlier that day. In the server (`python -m bench.long_prompt_gaps`) steps ran at
0.95-1.00x their modelled time (medians), up to 1.4-1.55x under other load: 0.40 s let 1.4-2% of the steps
pass 0.5 s, 0.35 none.
"""
from __future__ import annotations

import numpy as np

from engine.step_budget import Products, StepCost

GEMV_BYTES_S = 12.5e9        # weights read by matrix-vector products (one row)
GEMM_BYTES_S = 4.4e9         # weights read by matrix products (two rows or more: OpenBLAS packs them)
GEMM_MACS_S = 50e9           # a matrix product's multiply-adds
STEP_LAYER_S = 0.27e-3       # a step's calls besides the products and attention, a layer
SEQ_LAYER_S = 60e-6          # a sequence's attention calls, a layer
KV_BYTES_S = 46_080 / 10e-6  # a key's K and V read out of the pool
SOFTMAX_MACS = 118.0         # per (head, pair), beyond 2 x head_dim
ATTENTION_MACS_S = 40e9      # a pair's products and softmax
TARGET_S = 0.35              # a step's aim: under 0.5 s though the shared machine runs steps up to ~1.4x slower


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


def products(macs: float) -> Products:
    """Products over `macs` float32 weights (4 bytes each, read once a step) at this machine's rates."""
    return Products(one=4 * macs / GEMV_BYTES_S, many=4 * macs / GEMM_BYTES_S, row=macs / GEMM_MACS_S)


def cpu_step_cost(config, weights: dict[str, np.ndarray], kv_bytes_per_token: int) -> StepCost:
    """StepCost of the numpy executor for a model (config: its ModelConfig; kv_bytes_per_token: what one
    token keeps in the float32 KV pool, every layer)."""
    layers = config.num_hidden_layers
    pair = layers * config.num_attention_heads * (2 * config.head_dim + SOFTMAX_MACS)
    head = weights.get("lm_head", weights.get("embed_tokens"))
    return StepCost(base=layers * STEP_LAYER_S, layers=products(layer_macs(config, weights)),
                    head=products(head.size if head is not None else 0), seq=layers * SEQ_LAYER_S,
                    key=kv_bytes_per_token / KV_BYTES_S, pair=pair / ATTENTION_MACS_S, target=TARGET_S)

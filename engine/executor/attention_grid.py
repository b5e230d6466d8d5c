"""How the paged attention kernels' grids are sized: the KV split count of a step (attention_splits), the
query heads per CTA of paged_decode.cu (decode_heads_per_cta), whether a model's group fits that kernel
(decode_attention_fits), qk_norm_rope_cache.cu's heads per warp (rope_heads_per_warp), DeepSeek-V4's
sparse_decode heads per CTA (sparse_heads_per_cta), and the limits they share. Pure functions of the step's shape, so the CPU tests
check them without a GPU; GpuOps (gpu_ops.py) applies them."""
from __future__ import annotations

MAX_SPLITS = 16
MAX_DECODE_SPLITS = 64      # paged_decode.cu path (its splits are cheap: no serial key walk)
MAX_GROUP = 16            # query heads per KV head (paged_attention.cu MAX_G)
MAX_HEAD_DIM = 256
# Larger decode grids than this many CTAs per SM run rope + attention as two kernels (one more wave
# repeats the fused prologue: slower at batch 32, bench/results/rope_attention.md).
FUSED_ROPE_CTAS_PER_SM = 2


def attention_splits(num_tokens: int, num_kv_heads: int, max_context: int, max_splits: int, num_sms: int,
                     groups: int = 1) -> int:
    """KV splits per (token, KV head): enough blocks to fill the SMs twice, none shorter than one
    16-token block (a split walks its keys serially, so short contexts want many short splits:
    batch-1 decode at 129 tokens with one split per head took 116 µs per layer, latency-bound).
    paged_decode.cu (max_splits == MAX_DECODE_SPLITS) walks 32 keys per CTA pass and merges the splits
    itself: it takes one split once the (token, KV head) CTAs fill the SMs once, and none shorter than
    32 keys (H200, Qwen3-4B in a decode graph: batch 32 at 256 tokens 28.1 -> 20.3 µs per layer with
    1 split instead of 2; batch 1 at 256 tokens 10.0 -> 9.0 µs with 8 instead of 16). groups: CTAs per
    (token, KV head) beside the splits (paged_decode.cu's head groups, decode_heads_per_cta)."""
    fast = max_splits == MAX_DECODE_SPLITS
    rows = num_tokens * num_kv_heads * groups
    if rows >= (1 if fast else 2) * num_sms:
        return 1
    want = -(-2 * num_sms // rows)
    return max(1, min(max_splits, want, -(-max_context // (32 if fast else 16))))


def decode_heads_per_cta(num_tokens: int, num_kv_heads: int, group: int, num_sms: int) -> int:
    """Query heads per CTA of paged_decode.cu (its HEADS): 2 where the step's (token, KV head) rows are
    fewer than a quarter of the SMs (batch-1-like grids, whose CTAs are latency-bound serial chains of
    dots, P·V and merges over `group` heads), else the whole group. H200, batch 1 in a decode graph
    (bench/results/moe.md, 2026-12-04 14:18 UTC), µs a layer at 1k / 2k / 8k keys: Qwen3-30B-A3B (group 8)
    64 splits x 8 heads 31.9 / 32.9 / 39.4, 16 splits x 2 heads 10.0 / 11.5 / 21.0; Qwen3-4B (group 4) 33
    x 4 13.3 / 15.3 / 24.5, 16 x 2 10.0 / 11.8 / 21.9. The other head groups' CTAs read each K/V row
    again, from L2."""
    if group > 2 and group % 2 == 0 and 4 * num_tokens * num_kv_heads < num_sms:
        return 2
    return group


SPARSE_CTAS_PER_SM = 1.5


def sparse_heads_per_cta(rows: int, heads: int, pieces: int, num_sms: int) -> int:
    """Query heads per CTA of dsv4_attention.cu's sparse_decode (its ATT_G; DeepSeek-V4's one K = V head): the
    largest group (4, 2) that still gives SPARSE_CTAS_PER_SM CTAs an SM, so that fewer CTAs read each key from L2,
    else one (batch 1: the keys' loads spread over the most warps); at most 16 accumulator pieces a lane
    (ATT_G · ceil(d / 128)). H100, V4-Flash's 64 heads (bench/dsv4_sparse_decode.py, 2026-12-07), CSA µs for
    G1 / G2 / G4: 1 row 28 / 43 / 86; 8 rows 74 / 59 / 87 (G2 at 1.9 CTAs an SM beats G1 at 3.9, G4 at 0.97
    loses); 32 rows 290 / 230 / 221; 64 rows 621 / 466 / 446. The full sweep of 1-64 rows (2026-12-07 21:10
    UTC): the fastest or within 1% at 1, 2, 4, 8, 16, 32, 64 rows; 5-14% off at 6 rows (G2 wins) and 24 (G2 over
    G4, likely the waves' quantization, which no threshold captures) (bench/results/deepseek.md)."""
    for group in (4, 2):
        if heads % group == 0 and group * pieces <= 16 and rows * heads / group >= SPARSE_CTAS_PER_SM * num_sms:
            return group
    return 1


def decode_attention_fits(group: int, head_dim: int) -> bool:
    """paged_decode.cu holds group x head_dim/8/lanes-per-key 16-byte slices of q and of the
    accumulators per lane in registers: at most 8 (Qwen3 GQA 4 x D 128: 4)."""
    dv = head_dim // 8
    lanes = dv if dv <= 16 and dv & (dv - 1) == 0 else 16
    return head_dim % 8 == 0 and 0 < head_dim <= MAX_HEAD_DIM and group * -(-dv // lanes) <= 8


def rope_heads_per_warp(head_dim: int) -> int:
    """Heads a warp of qk_norm_rope_cache.cu serves at once: 32 / (D/8) where D/8 is a power of two from
    2 to 32 (rope.cuh's rope_piece_lanes: 16-byte pieces, D/8 lanes a head), else 1 (a warp a head)."""
    lanes = head_dim // 8
    fits = head_dim % 8 == 0 and 2 <= lanes <= 32 and lanes & (lanes - 1) == 0
    return 32 // lanes if fits else 1


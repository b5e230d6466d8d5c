"""Where a LoRA site's slots live on the GPU and which small steps take which path (plan-time, no GPU): every
slot's A in rows after the site's weight (the N-extended product), or, for gate_up with
GpuTuning.lora_gate_up_in_k, every slot's B in columns after each of its rows (the K-extension); gpu_lora_ops.py
runs them."""
from __future__ import annotations

import re

FUSED_MAX_ROWS = 64         # steps of at most this many rows take the extended product
FUSED_MAX_EXTRA = 0.25      # ... at sites whose extra columns (max_loras · slices · R) are at most this of N
KEXT_MAX_EXTRA = 0.08       # gate_up's K-extension where the slots' columns are at most this of K (its bytes)
KEXT_MAX_NR = 64            # ... and a slot's shrunk rows at most this (one warp of rms_norm.cu's 32 each)
SPLITK_LORA_MAX_R = 256     # rms_norm.cu LORA_MAX_R
SPLITK_LORA_MAX_HIDDEN = 8192   # rms_norm.cu LORA_MAX_HIDDEN: the widest o / down output it reduces


def padded_rank(rank: int) -> int:
    return -(-rank // 8) * 8


def slot_rows(site, options) -> int:
    """Every slot's shrunk rows at a site (max_loras · slices · R): A's rows, or the K-extension's columns."""
    return options.max_loras * len(site.slices) * padded_rank(options.max_lora_rank)


def fused_site(site, options) -> bool:
    """Whether steps of at most FUSED_MAX_ROWS rows take the extended product at this site."""
    return (slot_rows(site, options) <= FUSED_MAX_EXTRA * site.n and padded_rank(options.max_lora_rank) <= SPLITK_LORA_MAX_R
            and (len(site.slices) > 1 or site.n <= SPLITK_LORA_MAX_HIDDEN))   # o / down: rms_norm.cu's delta row


def norm_site_before(name: str) -> str | None:
    """The o_proj site whose split-K norm feeds a dense layer's gate_up site (None for other names)."""
    m = re.fullmatch(r"layers\.(\d+)\.gate_up_proj", name)
    return None if m is None else f"layers.{m.group(1)}.o_proj"


def k_extended(name: str, sites: dict, options) -> bool:
    """Whether small steps take a gate_up site's delta as a K-extension of its product
    (GpuTuning.lora_gate_up_in_k): where its layer's o_proj takes the extended product (its split-K norm
    writes each row's shrink beside the normed row), the slots' columns are at most KEXT_MAX_EXTRA of K
    and a slot's shrunk rows at most KEXT_MAX_NR (rms_norm.cu's shrink_row)."""
    before = norm_site_before(name)
    if before is None or not options.gpu.lora_gate_up_in_k:
        return False
    site, o = sites[name], sites.get(before)
    return (o is not None and fused_site(o, options) and fused_site(site, options) and site.k <= SPLITK_LORA_MAX_HIDDEN
            and len(site.slices) * padded_rank(options.max_lora_rank) <= KEXT_MAX_NR
            and slot_rows(site, options) <= KEXT_MAX_EXTRA * site.k)


def extra_rows(name: str, sites: dict, options) -> int:
    """The rows after a LoRA site's weight that hold every slot's A (none where it is K-extended)."""
    return 0 if k_extended(name, sites, options) else slot_rows(sites[name], options)


def extra_cols(name: str, sites: dict, options) -> int:
    """The columns after each row of a K-extended site's weight that hold every slot's B."""
    return slot_rows(sites[name], options) if k_extended(name, sites, options) else 0


def extended_shape(name: str, sites: dict, options) -> tuple[int, int]:
    """A LoRA site's weight as uploaded: [N + extra rows, K + extra columns]."""
    site = sites[name]
    return site.n + extra_rows(name, sites, options), site.k + extra_cols(name, sites, options)

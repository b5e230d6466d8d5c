"""Where a LoRA site's slots live on the GPU and which small steps take which path (plan-time, no GPU): every
slot's A in rows after the site's weight (the extended product); gpu_lora_ops.py runs them."""
from __future__ import annotations

FUSED_MAX_ROWS = 64         # steps of at most this many rows take the extended product
FUSED_MAX_EXTRA = 0.25      # ... at sites whose extra columns (max_loras · slices · R) are at most this of N
SPLITK_LORA_MAX_R = 256     # rms_norm.cu LORA_MAX_R
SPLITK_LORA_MAX_HIDDEN = 8192   # rms_norm.cu LORA_MAX_HIDDEN: the widest o / down output it reduces


def padded_rank(rank: int) -> int:
    return -(-rank // 8) * 8


def slot_rows(site, options) -> int:
    """Every slot's shrunk rows at a site (max_loras · slices · R): A's rows after the site's weight."""
    return options.max_loras * len(site.slices) * padded_rank(options.max_lora_rank)


def fused_site(site, options) -> bool:
    """Whether steps of at most FUSED_MAX_ROWS rows take the extended product at this site."""
    return (slot_rows(site, options) <= FUSED_MAX_EXTRA * site.n and padded_rank(options.max_lora_rank) <= SPLITK_LORA_MAX_R
            and (len(site.slices) > 1 or site.n <= SPLITK_LORA_MAX_HIDDEN))   # o / down: rms_norm.cu's delta row


def extra_rows(name: str, sites: dict, options) -> int:
    """The rows after a LoRA site's weight that hold every slot's A."""
    return slot_rows(sites[name], options)


def extended_shape(name: str, sites: dict, options) -> tuple[int, int]:
    """A LoRA site's weight as uploaded: [N + extra rows, K]."""
    site = sites[name]
    return site.n + extra_rows(name, sites, options), site.k

"""LoRA on the CPU executor: the adapter slots in host memory and the lora_add op in numpy (float32), the
reference the GPU kernels (lora_shrink.cu, lora_expand.cu) are checked against.

Per slot and site, A of every slice stacked [slices·r, K] and B block-diagonal [N, slices·r] (scaling
folded in), so one product shrinks all slices of a packed projection (q/k/v, gate/up) and one expands
them. A step's rows are grouped by slot through the token -> slot map; the batch stays in its order.
"""
from __future__ import annotations

import numpy as np

from engine.lora import LoRAAdapter, Site


def stack_site(site: Site, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(A [slices·r, K], block-diagonal B [N, slices·r]) of one adapter at one site (SiteLoRA's a, b)."""
    slices, r, k = a.shape
    bd = np.zeros((site.n, slices * r), np.float32)
    row = 0
    for j, n in enumerate(site.slices):
        bd[row:row + n, j * r:(j + 1) * r] = b[row:row + n]
        row += n
    return np.ascontiguousarray(a.reshape(slices * r, k)), bd


class CpuLoRASlots:
    """The executor's adapter slots: slot -> site -> (A, B) of the adapter loaded there."""

    def __init__(self, sites: dict[str, Site], num_slots: int):
        self.sites = sites
        self.slots: list[dict[str, tuple[np.ndarray, np.ndarray]] | None] = [None] * num_slots

    def set(self, slot: int, adapter: LoRAAdapter | None) -> None:
        self.slots[slot] = None if adapter is None else {
            name: stack_site(self.sites[name], w.a, w.b) for name, w in adapter.sites.items()}


class NumpyLoRAOps:
    """Mixed into NumpyOps: `lora_slots` (the executor's CpuLoRASlots) and, per step, `lora_groups`
    ([(slot, rows)]: the step's tokens of each adapter; empty: none) set by use_lora."""
    lora_slots: CpuLoRASlots | None = None
    lora_groups: list[tuple[int, np.ndarray]] = []

    def use_lora(self, token_slots: np.ndarray | None) -> None:
        """The step's token -> slot map (-1: no adapter) grouped by slot, for every lora_add of its forward."""
        if token_slots is None:
            self.lora_groups = []
            return
        if self.lora_slots is None or int(token_slots.max(initial=-1)) >= len(self.lora_slots.slots):
            raise ValueError("the step's LoRA slots are outside the executor's (max_loras)")
        self.lora_groups = [(int(s), np.flatnonzero(token_slots == s)) for s in np.unique(token_slots) if s >= 0]

    def lora_add(self, y, x, site):
        for slot, rows in self.lora_groups:
            w = self.lora_slots.slots[slot]
            if w is not None and site in w:
                a, b = w[site]
                y[rows] += (x[rows] @ a.T) @ b.T
        return y

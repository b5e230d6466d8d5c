"""LoRA on the CPU executor (ops.lora, models/ops.py LoRAOps): the adapter slots in host memory and the delta
in numpy (float32), the reference the GPU kernels (lora_shrink.cu, lora_expand.cu) are checked against.

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


class NumpyLoRAOps:
    """ops.lora of the numpy executor: slot -> site -> (A, B) of the adapter loaded there (None: empty), and
    per step `groups` ([(slot, rows)]: the step's tokens of each adapter; empty: none) set by use."""

    def __init__(self, sites: dict[str, Site], num_slots: int):
        self.sites = sites
        self.slots: list[dict[str, tuple[np.ndarray, np.ndarray]] | None] = [None] * num_slots
        self.groups: list[tuple[int, np.ndarray]] = []

    def set_slot(self, slot: int, adapter: LoRAAdapter | None) -> None:
        self.slots[slot] = None if adapter is None else {
            name: stack_site(self.sites[name], w.a, w.b) for name, w in adapter.sites.items()}

    def use(self, token_slots: np.ndarray | None) -> None:
        """The step's token -> slot map (-1: no adapter) grouped by slot, for every add of its forward."""
        if token_slots is None:
            self.groups = []
            return
        if int(token_slots.max(initial=-1)) >= len(self.slots):
            raise ValueError("the step's LoRA slots are outside the executor's (max_loras)")
        self.groups = [(int(s), np.flatnonzero(token_slots == s)) for s in np.unique(token_slots) if s >= 0]

    def add(self, y, x, site):
        for slot, rows in self.groups:
            w = self.slots[slot]
            if w is not None and site in w:
                a, b = w[site]
                y[rows] += (x[rows] @ a.T) @ b.T
        return y

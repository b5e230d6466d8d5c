"""PackedWeight: an engine weight concatenated from checkpoint tensors, kept as its parts."""
from __future__ import annotations

import numpy as np


class PackedWeight:
    """An engine weight concatenated from checkpoint tensors along dim 0, kept as its parts (memory-mapped
    views) until someone needs it whole: an executor copies each part straight into its place (the GPU
    upload, with no host-side concatenation), np.asarray() concatenates."""

    def __init__(self, parts: list[np.ndarray]):
        self.parts = parts
        self.dtype = np.result_type(*[a.dtype for a in parts])
        self.shape = (sum(a.shape[0] for a in parts), *parts[0].shape[1:])
        self.ndim = len(self.shape)
        self.size = int(np.prod(self.shape, dtype=np.int64))
        self.nbytes = self.size * self.dtype.itemsize

    def __array__(self, dtype=None, copy=None):
        whole = np.concatenate([np.asarray(a, dtype=self.dtype) for a in self.parts], axis=0)
        return whole if dtype is None else whole.astype(dtype)

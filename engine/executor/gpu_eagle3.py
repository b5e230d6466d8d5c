"""An EAGLE-3 head on the GPU executor (engine/eagle3_draft.py's draft, CuPy arrays on the compute stream).

The target's forward copies the residual stream entering each of the head's layers into a buffer of its own
(DeviceHiddenKeeper: one device-to-device copy per layer, in stream order, no allocation); after the step's
forward is queued the draft takes the step's rows from them (float32 copies, queued behind it on the same
stream), so the next step cannot overwrite them first. The head runs eagerly, CuPy arrays and cuBLAS, its
weights float32 outside the arena; the drafts come to the host once per head step.

With a head attached the target's steps run eager, kernel by kernel: the decode, verify and piecewise graphs pad
and reorder a step's rows (gpu_verify_graphs.py, gpu_piecewise.py), whose kept rows the draft does not map back
yet.
"""
from __future__ import annotations

import logging

import numpy as np

from engine.eagle3 import Eagle3Head
from engine.eagle3_draft import Eagle3Draft

log = logging.getLogger(__name__)


class DeviceHiddenKeeper:
    """Ops.keep_hidden's keeper on the GPU: the hidden states entering each of `layers`, bf16 bits, copied into
    buffers of the step's largest row count."""

    def __init__(self, layers, rows: int, hidden: int, shared):
        import cupy
        self.shared = shared
        self.buffers = {layer: cupy.empty((rows, hidden), np.uint16) for layer in sorted(set(layers))}

    def keep(self, layer: int, x) -> None:
        buf = self.buffers.get(layer)
        if buf is not None:
            self.shared.copy(buf[:x.shape[0]], x)

    def rows(self, count: int) -> dict:
        """The last step's first `count` rows by layer."""
        return {layer: buf[:count] for layer, buf in self.buffers.items()}


def attach_gpu_eagle3(executor, head: Eagle3Head) -> Eagle3Draft:
    """Keep the hidden states `head` reads on every step of the GPU executor from now on (its steps eager);
    the draft over them."""
    import cupy
    executor.graphs = executor.lora_graphs = executor.verify_graphs = executor.piecewise = None
    log.info("EAGLE-3 head attached: the target's steps run eager (no CUDA graphs)")
    keeper = DeviceHiddenKeeper(head.aux_layers, executor.plan.max_tokens, executor.config.hidden_size,
                                executor.ops.shared)
    executor.ops.keeper = keeper
    draft = Eagle3Draft(head, executor.weights["embed_tokens"], executor.max_model_len, xp=cupy,
                        stream=executor.stream)
    executor.stream.synchronize()
    return draft


def take_step_rows(executor, batch) -> None:
    """After a step's forward is queued: the draft takes its kept rows (queued on the compute stream)."""
    executor.draft.take(batch, executor.ops.keeper.rows(batch.num_tokens))

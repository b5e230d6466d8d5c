"""The GPU executor's host KV tier copies, a part it owns when options.host_kv_blocks > 0: pinned host slots
mirroring the KV pool (memory/host_kv_copy.py) and the copies the scheduler's host tier (engine/host_tier.py) asks
for, on the streams that keep them off the steps' path: it moves bytes, it decides nothing. Offloads run on the
compute stream ahead of the next step. Restores run on a stream of their own: for a line with `layerwise_restore`
(every KV read is GpuOps.attention / rope_attention of its layer) one layer at a time, an event after each, so the
next step's attention of layer l waits for layer l alone and its forward overlaps the copy; meanwhile the executor
uploads the step's inputs by a kernel (gpu_mapped_copy.py), since a memcpy would queue on the copy engine behind
the restore. With GpuTuning.async_host_tier the restores and the write-through copies go on two streams of their
own and come back as tickets (events) that the scheduler's host tier polls (engine/host_tier.py: LOADING
sequences, held blocks)."""
from __future__ import annotations

import logging

from memory.host_kv_copy import gpu_host_kv_copy, gpu_memcpy2d

log = logging.getLogger(__name__)


class GpuHostCopies:
    """num_slots pinned host blocks mirroring kv_cache; stream: the compute stream; async_copies: restores and
    write-throughs return tickets (GpuTuning.async_host_tier); layerwise: the line's `layerwise_restore`."""

    def __init__(self, kv_cache, num_slots: int, stream, async_copies: bool, layerwise: bool):
        import cupy

        self.stream, self.async_copies, self.layerwise = stream, async_copies, layerwise
        self.host_kv = gpu_host_kv_copy(kv_cache, num_slots, stream)
        self.restore_stream = cupy.cuda.Stream(non_blocking=True)
        self.host_kv_restore = self.host_kv.with_memcpy(gpu_memcpy2d(self.restore_stream))
        if async_copies:     # restores (host -> device) and write-throughs apart: in one stream a restore
            self.through_stream = cupy.cuda.Stream(non_blocking=True)    # would queue behind a long offload
            self.host_kv_through = self.host_kv.with_memcpy(gpu_memcpy2d(self.through_stream))
        self.layer_events: list | None = None     # the last layer-by-layer restore's events, until a step takes them
        log.info("host KV tier: %d blocks, %.2f GiB pinned", num_slots, num_slots * self.host_kv.block_bytes / 2**30)

    def copy_blocks(self, offloads: list[tuple[int, int]], restores: list[tuple[int, int]],
                    through: list[tuple[int, int]] = ()):
        """offloads (device block -> host slot), then restores (host slot -> device block), queued ahead of
        the next step (returns None; a layerwise line's restores layer by layer on the restore stream,
        _restore_by_layer, the others on the compute stream); the host does not wait for them. With
        async_copies the restores and the write-through copies (`through`: blocks that joined the
        prefix cache, held by the scheduler until they land) go on streams of their own (restores on one,
        write-throughs on the other: a restore never queues behind a long offload), behind everything
        queued on the compute stream so far (the offloads included: a block evicted and refilled in one
        step is saved first); the events after them are returned for copies_done / wait_copies."""
        import cupy

        if not self.async_copies:           # (no write-through without it)
            if restores and self.layerwise:
                self.host_kv.copy_blocks(offloads, [])
                self._restore_by_layer(restores)
            else:
                self.host_kv.copy_blocks(offloads, restores)
            return None
        if offloads:
            self.host_kv.copy_blocks(offloads, [])
        if not (restores or through):
            return None
        ready = compute_event(self.stream)
        landed = []
        for stream, copy, offload, restore in ((self.restore_stream, self.host_kv_restore, [], restores),
                                               (self.through_stream, self.host_kv_through, through, [])):
            if offload or restore:
                stream.wait_event(ready)
                copy.copy_blocks(offload, restore)
                landed.append(cupy.cuda.Event(disable_timing=True))
                landed[-1].record(stream)
        return tuple(landed)

    def _restore_by_layer(self, restores: list[tuple[int, int]]) -> None:
        """Restores on the restore stream (behind the compute stream's queue, offloads included), an event
        after each layer's copies: the next step's attention of layer l waits for layer l alone, so its
        forward runs while the later layers still copy (lines with `layerwise_restore`, whose every KV read is
        GpuOps.attention / rope_attention; other lines copy on the compute stream before the step)."""
        import cupy

        self.restore_stream.wait_event(compute_event(self.stream))
        events = []

        def layer_done(_: int) -> None:
            events.append(cupy.cuda.Event(disable_timing=True))
            events[-1].record(self.restore_stream)
        self.host_kv_restore.restore_layers(restores, layer_done)
        self.layer_events = events

    def landed(self, ops, layerwise: bool) -> None:
        """Before a step: the restores' per-layer events go to the ops (layerwise: its attention waits
        for each layer), or the compute stream waits for all of them (a step that cannot wait per layer)."""
        events, self.layer_events = self.layer_events, None
        if events:
            if layerwise:
                ops.kv_layer_events = events
            else:
                self.stream.wait_event(events[-1])


def layers_landed(ops, stream) -> None:
    """After a step's forward: nothing after it on `stream` runs before every restored layer has landed."""
    events, ops.kv_layer_events = ops.kv_layer_events, None
    if events:
        stream.wait_event(events[-1])


def events_done(ticket) -> bool:
    """Whether every event of copy_blocks' ticket has run (None: nothing in flight)."""
    return ticket is None or all(event.done for event in ticket)


def wait_events(ticket) -> None:
    for event in ticket or ():
        event.synchronize()


def compute_event(stream):
    """An event after everything queued on `stream` so far."""
    import cupy

    event = cupy.cuda.Event(disable_timing=True)
    event.record(stream)
    return event

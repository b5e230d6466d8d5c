"""Small host <-> device transfers without the copy engines (mapped_copy.cu): the step's sampled ids on
their way back, and its inputs on their way in while a host-tier restore copies. A copy engine serves its
queue in order, so a small memcpy queued behind a bulk one (an offload, a restore) waits for all of it
(bench/copy_contention.py); a kernel reading or writing pinned host memory through its mapping does not.
Where the device lacks unified addressing (no 64-bit Linux CUDA device does), memcpys serve."""
from __future__ import annotations

import numpy as np

from openinfer_kernels.raw_cuda import kernel

CUDA_DEV_ATTR_UNIFIED_ADDRESSING = 41
MAX_ARRAYS = 4


class MappedCopy:
    def __init__(self, stream):
        import cupy

        self.stream = stream
        self.mapped = bool(cupy.cuda.runtime.deviceGetAttribute(CUDA_DEV_ATTR_UNIFIED_ADDRESSING,
                                                                cupy.cuda.Device().id))
        self.kernel = kernel("mapped_copy", "mapped_copy") if self.mapped else None

    def __call__(self, pairs: list[tuple[np.ndarray, object, int]], to_host: bool) -> None:
        """Copy (pinned host array, device array, 32-bit words) pairs, at most MAX_ARRAYS, host -> device or
        device -> host, queued on the stream: one launch (or a memcpy each without unified addressing)."""
        import cupy

        rt = cupy.cuda.runtime
        if not self.mapped:
            for host, device, words in pairs:
                dst, src = (host.ctypes.data, device.data.ptr) if to_host else (device.data.ptr, host.ctypes.data)
                rt.memcpyAsync(dst, src, words * 4, rt.memcpyDeviceToHost if to_host else rt.memcpyHostToDevice,
                               self.stream.ptr)
            return
        if len(pairs) > MAX_ARRAYS:
            raise ValueError(f"mapped_copy takes at most {MAX_ARRAYS} arrays, got {len(pairs)}")
        args = []
        for host, device, words in pairs + [(None, None, 0)] * (MAX_ARRAYS - len(pairs)):
            h = np.uint64(0 if host is None else host.ctypes.data)
            d = np.uint64(0 if device is None else device.data.ptr)
            args += [d, h, np.int32(words)] if to_host else [h, d, np.int32(words)]
        most = max(words for _, _, words in pairs)
        blocks = max(1, min(1024, -(-most // 256)))      # reads from the host: one round trip per thread
        self.kernel((blocks, MAX_ARRAYS), (256,), tuple(args), stream=self.stream)

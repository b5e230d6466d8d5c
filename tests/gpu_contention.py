"""Make a missing ordering visible: hold a stream busy for a while, so that anything queued there (an upload,
a fill, a step) lands late while the host goes on. A kernel test that launches on a stream of its own and reads
inputs uploaded on CuPy's default stream without ordering, or an engine that rewrites a pinned buffer whose
upload is still queued, then fails every time instead of once under other GPU load."""
from __future__ import annotations

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


def hold_stream(stream, ms: float = 20.0) -> None:
    """Queue a one-thread kernel that spins about `ms` milliseconds on `stream`: what is queued after it waits,
    as on a GPU busy with other work, while the host goes on."""
    import cupy

    cycles = int(ms * 1e-3 * cupy.cuda.Device().attributes["ClockRate"] * 1e3)
    kernel = cupy.RawKernel(SPIN, "spin")
    with stream:
        kernel((1,), (1,), (cupy.int64(cycles),))


def hold_default_stream(ms: float = 20.0) -> None:
    """hold_stream on the legacy default stream."""
    import cupy

    hold_stream(cupy.cuda.Stream.null, ms)

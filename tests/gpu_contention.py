"""Make a missing stream ordering visible: hold CuPy's default (legacy) stream busy for a while, so
that anything queued there (an upload, a fill) lands late. A kernel test that launches on a stream of
its own and reads such inputs without ordering then fails every time instead of once under load."""
from __future__ import annotations

SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


def hold_default_stream(ms: float = 20.0) -> None:
    """Queue a one-thread kernel that spins about `ms` milliseconds on the legacy default stream."""
    import cupy

    cycles = int(ms * 1e-3 * cupy.cuda.Device().attributes["ClockRate"] * 1e3)
    kernel = cupy.RawKernel(SPIN, "spin")
    with cupy.cuda.Stream.null:
        kernel((1,), (1,), (cupy.int64(cycles),))

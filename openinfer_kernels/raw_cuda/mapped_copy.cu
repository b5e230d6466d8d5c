// 32-bit words between pinned host memory mapped into the device's address space (unified addressing: a
// pinned buffer's host pointer is its device pointer) and device memory, in either direction:
// dst[p][i] = src[p][i] for up to 4 arrays, blockIdx.y = p (a count of 0 skips it). No copy engine takes
// part, so a bulk copy in flight on one does not hold it up: a step's sampled ids read back behind a host-tier
// offload (a 4 KiB cudaMemcpyAsync D2H waited 78.9 ms behind a 4 GiB one on the H200, this kernel 0.25 ms:
// bench/copy_contention.py), or its inputs uploaded while a restore copies. Roofline: KBs over PCIe (posted
// writes to the host; reads from it one round trip per thread, ~1-2 µs).
#include "common.cuh"

extern "C" __global__ void mapped_copy(const int* __restrict__ src0, int* __restrict__ dst0, int n0,
                                       const int* __restrict__ src1, int* __restrict__ dst1, int n1,
                                       const int* __restrict__ src2, int* __restrict__ dst2, int n2,
                                       const int* __restrict__ src3, int* __restrict__ dst3, int n3) {
    pdl_wait();
    const int p = blockIdx.y;
    const int* src = p == 0 ? src0 : p == 1 ? src1 : p == 2 ? src2 : src3;
    int* dst = p == 0 ? dst0 : p == 1 ? dst1 : p == 2 ? dst2 : dst3;
    const int n = p == 0 ? n0 : p == 1 ? n1 : p == 2 ? n2 : n3;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) dst[i] = src[i];
}

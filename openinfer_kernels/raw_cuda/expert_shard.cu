// Expert parallelism (engine/parallel): a rank holds the routed experts [first, first + count) of the
// router's E. Its view of the router's ids [T, top_k]:
//   local[a] = ids[a] - first where that expert is the rank's, else -1 (moe_align.cu drops it, so
//   moe_combine.cu adds nothing for it; the rank's partial sums meet the others' in the all-reduce).
// Roofline: 8·T·top_k bytes (decode batch 32, top 8: 2 KB): launch-bound, like the other routing kernels.
#include "common.cuh"

extern "C" __global__ void local_expert_ids(const int* __restrict__ ids, int* __restrict__ local, int n, int first,
                                            int count) {
    pdl_begin();
    for (int a = blockIdx.x * blockDim.x + threadIdx.x; a < n; a += gridDim.x * blockDim.x) {
        const int e = ids[a] - first;
        local[a] = (e >= 0 && e < count) ? e : -1;
    }
}

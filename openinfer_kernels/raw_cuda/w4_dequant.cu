// The bf16 weights [N, K] of a 4-bit weight in gemv_w4.cu's layout (openinfer_kernels/quant/w4_layout.py), for the
// products the GEMV does not take (prefill): dequantized into a scratch buffer, then the bf16 GEMM (CuTe or
// cuBLAS) runs on it. Each value is w4.cuh's: the exact product rounded once to bf16, so the prefill product
// is bit for bit the one of the load-time dequantization's weights. A thread takes one lane piece of the
// layout (16 bytes: 32 k of one row) and writes its 64 bytes; a warp's reads are 512 contiguous bytes.
// Grid (ceil(pieces / 256), experts), 256 threads; out [experts][N][ld] (ld >= K, a multiple of 8).
// Roofline: N·K/2 + scales read, N·K·2 written: Qwen3-8B gate_up (24576 x 4096) 252 MB, 53 µs at 4.8 TB/s —
// against 0.5 ms for its bf16 GEMM at M = 2048, the price of reusing the bf16 tensor-core path as it is.
#include "common.cuh"
#include "w4.cuh"

extern "C" __global__ void w4_dequant(const uint4* __restrict__ wq, const unsigned* __restrict__ scales,
                                      const unsigned short* __restrict__ zeros, bf16_t* __restrict__ out, int N,
                                      int K, int group, int ld) {
    pdl_begin();
    const int T = (N + 15) / 16, S = (K + 127) / 128, G = (S * 128 + group - 1) / group;
    const size_t e = blockIdx.y;
    const long long piece = (long long)blockIdx.x * blockDim.x + threadIdx.x;   // ((tile·S + step)·2 + half)·32 + lane
    if (piece >= (long long)T * S * 64) return;
    const int lane = piece % 32, half = piece / 32 % 2, step = piece / 64 % S, tile = piece / 64 / S;
    const int g = lane >> 2, t = lane & 3;
    const int row = tile * 16 + g + 8 * half, k0 = step * 128 + t * 32;
    if (row >= N || k0 >= K) return;
    const int grp = k0 / group;
    const size_t at = ((size_t)tile * G + grp) * 8 + g;
    const unsigned sc = __ldg(scales + e * T * G * 8 + at);
    const unsigned zr = W4_ZERO ? (unsigned)__ldg(zeros + e * T * G * 8 + at) : 0u;
    const W4Group q = w4_group(half ? sc >> 16 : sc & 0xFFFFu, half ? zr >> 8 : zr & 0xFFu);
    const uint4 c = __ldg(wq + e * T * S * 64 + piece);
    const unsigned words[4] = {c.x, c.y, c.z, c.w};
    uint4* dst = reinterpret_cast<uint4*>(out + (e * N + row) * (size_t)ld + k0);
    #pragma unroll
    for (int w = 0; w < 4; ++w) {                       // K % 32 == 0: a piece is whole or past K
        unsigned p[4];
        w4_dequant(words[w], q, p);
        dst[w] = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

// The compile-time shape of the attention kernels built per (GQA, HEAD_DIM) (paged_decode.cu,
// paged_chunk.cu): -DGQA= / -DHEAD_DIM= from the executor, these defaults for a standalone build; 4 warps a CTA.
#pragma once

#ifndef GQA
#define GQA 4
#endif
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#define WARPS 4
#define NTHREADS (WARPS * 32)

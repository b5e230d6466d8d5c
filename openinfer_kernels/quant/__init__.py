"""Quantized weights kept quantized on the GPU: the formats' readers and the one 4-bit layout the W4A16 kernel
reads (w4_formats, w4_layout: numpy, used at load), the W8A8 FP8 references (fp8_ref) and the launches of
the raw CUDA kernels (ops: gemv_w4.cu, fp8_quant.cu, gemv_fp8.cu; CuPy at call time)."""

"""Per-kernel decode timings with each kernel's HBM roofline fraction (bytes it must read ÷ the
device-copy bandwidth of the run), as a decode graph sees them: `graph_attention_rows` (q/k norm + rope
+ KV write + decode attention of every layer captured back to back, per KV split count),
`graph_chain_rows` (one projection of every layer, distinct weights far beyond L2: cuBLAS vs gemv.cu at
several weight-batch depths, plain vs programmatic dependent launches); and `attention_rows`, decode
attention launched alone (paged_attention_split + attention_merge vs paged_decode.cu), which includes
launch latency and ramp-up. Called by bench/decode.py --micro."""
from __future__ import annotations

import numpy as np

GEMM_ROWS = (1, 8, 16, 32)
ATTENTION_CASES = ((1, 256), (1, 4096), (32, 256), (32, 4096))


def rand_bf16(shape):
    """Random positive bf16 bits in [2^-7, 1), made on the device."""
    import cupy
    return cupy.random.randint(0x3c00, 0x3f80, shape, dtype=np.int32).astype(np.uint16)


def time_ms(stream, fn, reps: int = 20) -> float:
    import cupy

    cupy.cuda.Device().synchronize()          # inputs made on the default stream are ready
    fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        fn()
        e1.record(stream)
        e1.synchronize()
        times.append(cupy.cuda.get_elapsed_time(e0, e1))
    return float(np.median(times))


def attention_rows(ex, cfg, bw: float) -> list[dict]:
    import cupy

    from engine.executor.attention_grid import MAX_DECODE_SPLITS, MAX_SPLITS, attention_splits
    from openinfer_kernels.raw_cuda import kernel

    Hq, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    G, ops, rows = Hq // Hkv, ex.ops, []
    new = kernel("paged_decode", "paged_decode_attention", GQA=G, HEAD_DIM=D)
    for B, ctx in ATTENTION_CASES:
        blocks = -(-ctx // 16)
        kc, vc = rand_bf16((B * blocks * 16, Hkv, D)), rand_bf16((B * blocks * 16, Hkv, D))
        tables = cupy.asarray(np.random.default_rng(B + ctx).permutation(B * blocks).astype(np.int32).reshape(B, blocks))
        seq = cupy.arange(B, dtype=np.int32)
        pos = cupy.full(B, ctx - 1, np.int32)
        q = rand_bf16((B, Hq * D))
        out = cupy.empty((B, Hq * D), np.uint16)
        parts = (ops.part_out, ops.part_max, ops.part_sum)
        s_old, s_new = attention_splits(B, Hkv, ctx, MAX_SPLITS), attention_splits(B, Hkv, ctx, MAX_DECODE_SPLITS)
        common = (q, kc, vc, tables, np.int32(blocks), seq, pos) + parts
        scale = np.float32(D ** -0.5)

        def old():
            ops.k_attn((s_old, Hkv, B), (128,), common + (np.int32(Hq), np.int32(Hkv), np.int32(D), scale),
                       stream=ex.stream)
            ops.k_merge((B * Hq,), (128,), parts + (out, np.int32(s_old), np.int32(D)), stream=ex.stream)

        def fast():
            new((B, s_new, Hkv), (128,), common + (out, ops.split_counters, np.int32(Hkv), scale), stream=ex.stream)

        floor = B * ctx * Hkv * D * 2 * 2 / bw * 1e3
        rows.append(dict(kernel="attention", case=f"B={B} ctx={ctx} splits {s_old}/{s_new}",
                         old_ms=time_ms(ex.stream, old), new_ms=time_ms(ex.stream, fast), roofline_ms=floor))
        del kc, vc
    return rows


def graph_chain_rows(ex, cfg, bw: float, rows_m=(1, 16, 32), unrolls=(2, 4, 8), reps: int = 10) -> list[dict]:
    """Per projection, M and k steps per weight batch (gemv.cu GEMV_U): µs per GEMV inside a captured
    graph of that projection for all layers, old = plain launches, new = programmatic dependent
    launches; and cuBLAS (plain launches) for comparison."""
    import cupy

    from engine.executor.gpu_gemm import Gemm

    gemms = {u: Gemm(ex.stream, gemv_max_m=32, gemv_unroll=(u, u)) for u in unrolls}
    blas, rows = Gemm(ex.stream), []

    def per_call(fn, ws, pdl):
        for w in ws[:2]:                      # load the kernel outside the capture
            fn(w, pdl)
        ex.stream.synchronize()
        ex.stream.begin_capture()
        for w in ws:
            fn(w, pdl)
        graph = ex.stream.end_capture()
        return time_ms(ex.stream, lambda: graph.launch(stream=ex.stream), reps) / len(ws)

    for label in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        ws = [ex.weights[f"layers.{i}.{label}"] for i in range(cfg.num_hidden_layers)]
        N, K = ws[0].shape
        floor = N * K * 2 / bw * 1e3
        for M in rows_m:
            x, out = rand_bf16((M, K)), cupy.empty((M, N), np.uint16)
            cupy.cuda.Device().synchronize()
            t_blas = per_call(lambda w, pdl: blas(x, w, out), ws, False)
            rows.append(dict(kernel=f"graph.{label} {N}x{K} x{len(ws)}", case=f"M={M} cuBLAS",
                             old_ms=t_blas, new_ms=t_blas, roofline_ms=floor))
            for p, gemm in gemms.items():
                t = {pdl: per_call(lambda w, pdl: gemm.gemv(x, w, out, pdl=pdl), ws, pdl) for pdl in (False, True)}
                rows.append(dict(kernel=f"graph.{label} {N}x{K} x{len(ws)}", case=f"M={M} U={p} plain/PDL",
                                 old_ms=t[False], new_ms=t[True], roofline_ms=floor))
    for g in [blas, *gemms.values()]:
        g.close()
    return rows


def graph_attention_rows(ex, cfg, bw: float, cases=((1, 128), (1, 256), (1, 1024), (1, 2048), (1, 8192), (1, 32768), (4, 8192),
                                                    (32, 256)), reps: int = 10) -> list[dict]:
    """µs per decode attention layer (rope_attention: q/k norm + rope + KV write + attention, as in a
    decode step) inside a captured graph of all layers with programmatic dependent launches, per KV split
    count and query heads per CTA (paged_decode.cu's HEADS): the executor's choice and a sweep around it.
    Reads a random-content paged cache."""
    import dataclasses

    from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep
    from engine.executor.attention_grid import decode_heads_per_cta
    from engine.models.decoder import attention_specs
    from engine.request import SamplingParams

    ops, specs, rows = ex.ops, attention_specs(cfg), []
    width = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    qnorms = [ex.weights.get(f"layers.{s.layer}.q_norm") for s in specs]
    knorms = [ex.weights.get(f"layers.{s.layer}.k_norm") for s in specs]
    for B, ctx_len in cases:
        per_seq = -(-ctx_len // BLOCK_SIZE)
        if B * per_seq > ex.num_kv_blocks or ctx_len > ex.max_model_len or B > ex.options.max_num_seqs:
            continue
        seqs = [SeqStep(seq_id=j, token_ids=[1], start_pos=ctx_len - 1, sample=True,
                        params=SamplingParams(temperature=0.0),
                        block_table=list(range(j * per_seq, (j + 1) * per_seq))) for j in range(B)]
        ctx = ex.upload(ModelBatch.build(seqs))
        qkv = rand_bf16((B, width))
        chosen, group = ctx.num_splits, cfg.num_attention_heads // cfg.num_key_value_heads
        heads_list = [h for h in (group, group // 2, group // 4, 1) if h >= 1 and group % h == 0]
        for S, heads in [(S, h) for S in sorted({1, 2, 4, 8, 16, 32, 48, 64, chosen}
                                                & set(range(1, -(-ctx_len // 16) + 1))) for h in dict.fromkeys(heads_list)]:
            c = dataclasses.replace(ctx, num_splits=S)
            ops.shared.pdl, ops.decode_heads = True, heads
            rule = decode_heads_per_cta(B, cfg.num_key_value_heads, group, ops.shared.num_sms)

            def layers():
                ops.reset()
                for spec, qn, kn in zip(specs, qnorms, knorms):
                    ops.rope_attention(qkv, spec, c, q_norm=qn, k_norm=kn)
            layers()
            ex.stream.synchronize()
            ex.stream.begin_capture()
            layers()
            graph = ex.stream.end_capture()
            ops.shared.pdl, ops.decode_heads = False, 0
            t = time_ms(ex.stream, lambda: graph.launch(stream=ex.stream), reps) / len(specs)
            floor = B * ctx_len * cfg.num_key_value_heads * cfg.head_dim * 2 * 2 / bw * 1e3
            rows.append(dict(kernel="graph.rope_attention", case=f"B={B} ctx={ctx_len} splits {S} heads {heads}"
                             + (" (chosen)" if S == chosen and heads == rule else ""), old_ms=t, new_ms=t,
                             roofline_ms=floor))
    return rows


def micro_bench(ex, cfg, bw: float, parts=("attention", "gemv", "single")) -> list[dict]:
    make = {"attention": graph_attention_rows, "gemv": graph_chain_rows, "single": attention_rows}
    unknown = set(parts) - set(make)
    if unknown:
        raise ValueError(f"--micro parts {sorted(unknown)}: want some of {sorted(make)}")
    rows = [r for part in parts for r in make[part](ex, cfg, bw)]
    for r in rows:
        print(f"[micro] {r}", flush=True)
    return rows


def micro_table(rows: list[dict]) -> list[str]:
    lines = ["| kernel | case | old µs | new µs | roofline µs | old fraction | new fraction |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['case']} | {r['old_ms'] * 1e3:.1f} | {r['new_ms'] * 1e3:.1f} | "
                     f"{r['roofline_ms'] * 1e3:.1f} | {r['roofline_ms'] / r['old_ms']:.2f} | "
                     f"{r['roofline_ms'] / r['new_ms']:.2f} |")
    return lines

"""dsv4_attention.cu's sparse_decode alone at DeepSeek-V4-Flash's width (64 heads of 512, window 128, contexts
~4,000; CSA layers with the indexer's top-512 entries, HCA with every entry of 128 tokens) for 1 to 512 rows: the
heads a CTA it chooses (attention_grid.sparse_heads_per_cta) and each forced (1 / 2 / 4), beside dsv4_sparse_mma.cu's
sparse_prefill (column "mma": where it overtakes sparse_decode is gpu_dsv4_ops.SPARSE_MMA_ROWS), 50 launches
captured in one CUDA graph, the time of a launch. On the GPU, from the repository root:
`python3 bench/dsv4_sparse_decode.py [--rows 1,8,32,64,128,256]` (bench/results/deepseek.md)."""
import os
import sys
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu")]
import cupy as cp  # noqa: E402
from dsv4_attention_cases import heads_per_cta, random_inputs  # noqa: E402
from test_gpu_dsv4_indexer import ops  # noqa: E402

from engine.executor.gpu_graphs import capture_mode  # noqa: E402


def main(rows=(1, 2, 4, 6, 8, 12, 16, 24, 32, 64, 128, 256, 512)) -> None:
    for name, rate, topk in (("csa", 4, 512), ("hca", 128, 0)):
        for T in rows:
            inp = random_inputs(64, 512, 128, rate, topk, tuple(4000 + 7 * i for i in range(T)), seed=T)
            o = ops(inp)
            with o.shared.stream:
                q, tables, pos, sinks = (cp.asarray(a) for a in (inp.q, inp.tables, inp.pos, inp.sinks))
                ids = None if inp.ids is None else cp.asarray(inp.ids)
                row = []
                for g in (0, 1, 2, 4, "mma"):
                    o.sparse_mma_rows = 1 if g == "mma" else None
                    with heads_per_cta(g) if g and g != "mma" else nullcontext():
                        for _ in range(3):
                            o.sparse_decode(q, tables, pos, ids, sinks, inp.spec)
                        o.shared.stream.synchronize()
                        o.shared.stream.begin_capture(*capture_mode())
                        for _ in range(50):
                            o.sparse_decode(q, tables, pos, ids, sinks, inp.spec)
                        graph = o.shared.stream.end_capture()
                        graph.launch(o.shared.stream)
                        a, b = cp.cuda.Event(), cp.cuda.Event()
                        a.record(o.shared.stream)
                        graph.launch(o.shared.stream)
                        b.record(o.shared.stream); b.synchronize()
                        row.append(f"G{g or 'auto'} {cp.cuda.get_elapsed_time(a, b) / 50 * 1000:7.1f}us")
                print(f"{name} T={T:3d}", " ".join(row), flush=True)


if __name__ == "__main__":
    if "--rows" in sys.argv:
        main(tuple(int(r) for r in sys.argv[sys.argv.index("--rows") + 1].split(",")))
    else:
        main()

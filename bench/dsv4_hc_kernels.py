"""dsv4_hc.cu's kernels alone at DeepSeek-V4-Flash's width (4 streams of 4096): hc_pre (hyper_connection), hc_head
(hyper_head) and hc_merge for T rows, 50 launches captured in one CUDA graph with programmatic dependent launches, the
time of a launch. On the GPU, from the repository root: `python3 bench/dsv4_hc_kernels.py [LABEL]`
(bench/results/deepseek.md)."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "gpu")]
import cupy as cp  # noqa: E402
from dsv4_hc_cases import HC_EPS, ITERS, NORM_EPS, random_inputs  # noqa: E402
from test_gpu_dsv4_hc import ops  # noqa: E402

from engine.executor.gpu_graphs import capture_mode  # noqa: E402


def launch_us(o, call, launches: int = 50) -> float:
    for _ in range(3):
        call()
    o.shared.stream.synchronize()
    o.shared.stream.begin_capture(*capture_mode())
    for _ in range(launches):
        call()
    graph = o.shared.stream.end_capture()
    graph.launch(o.shared.stream)
    a, b = cp.cuda.Event(), cp.cuda.Event()
    a.record(o.shared.stream)
    graph.launch(o.shared.stream)
    b.record(o.shared.stream)
    b.synchronize()
    return cp.cuda.get_elapsed_time(a, b) / launches * 1000


def main(label: str = "") -> None:
    for T in (1, 4, 32):
        o = ops()
        o.shared.pdl = True
        inp = random_inputs(T, 4, 4096, seed=T)
        with o.shared.stream:
            s, fn, base, scale, out = (cp.asarray(a) for a in (inp.streams, inp.fn, inp.base, inp.scale, inp.out_bf16))
            hfn, hb, hs = (cp.asarray(a) for a in (inp.head_fn, inp.head_base, inp.head_scale))
            post, comb, _ = o.hyper_connection(s, fn, base, scale, ITERS, HC_EPS, NORM_EPS)
            pre = launch_us(o, lambda: o.hyper_connection(s, fn, base, scale, ITERS, HC_EPS, NORM_EPS))
            head = launch_us(o, lambda: o.hyper_head(s, hfn, hb, hs, HC_EPS, NORM_EPS))
            merge = launch_us(o, lambda: o.hc_merge(out, s, post, comb))
        print(f"{label} T={T:3d} hc_pre {pre:6.1f}us hc_head {head:6.1f}us hc_merge {merge:6.1f}us", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])

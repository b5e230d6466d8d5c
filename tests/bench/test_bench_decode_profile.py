"""bench/decode_profile.py --parse: Nsight Compute's CSV (ncu's own lines before the header skipped,
thousands separators, any time unit, templated names) summed per kernel, GEMVs named by their grid."""
from __future__ import annotations

from bench.decode_profile import summarize

HEADER = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
          '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')


def row(i: int, name: str, grid: int, unit: str, value: str, metric: str = "gpu__time_duration.sum") -> str:
    return (f'"{i}","604","python3.12","h","{name}","1","14","(256, 1, 1)","({grid}, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{metric}","{unit}","{value}"')


def test_summarize_sums_per_kernel_and_names_the_gemvs(tmp_path):
    # Qwen3-4B: qkv_proj has (32 + 2 * 8) * 128 = 6144 rows -> 384 CTAs of gemv.cu
    lines = ["==PROF== Connected to process 604", HEADER,
             row(0, "embedding_gather", 1, "ns", "4,096"),
             row(1, "gemv_norm_n1(const unsigned short *, int)", 384, "ns", "11,500"),
             row(2, "gemv_norm_n1(const unsigned short *, int)", 384, "usecond", "12.5"),
             row(3, "void nvjet<8>(float)", 8, "ns", "150,000"),
             row(4, "void nvjet<8>(float)", 8, "byte", "999", metric="dram__bytes.sum")]
    path = tmp_path / "ncu.csv"
    path.write_text("\n".join(lines) + "\n")
    text = summarize(str(path), "qwen3-4b")
    assert "4 kernels, 178 µs summed" in text
    assert "| gemv_norm_n1 qkv_proj | 2 | 12.5 | 24 |" in text
    assert "| void nvjet | 1 | 150.0 | 150 |" in text
    assert "| embedding_gather | 1 | 4.1 | 4 |" in text

"""bench/ncu_table.py: Nsight Compute's CSV (the lines ncu prints before the header skipped, thousands
separators, any time unit) summed per kernel name in graph order."""
from __future__ import annotations

import pytest

from bench.ncu_table import kernel_times, table

CSV = '''==PROF== Connected to process 604
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","604","python3.12","h","embedding_gather","1","14","(128, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","4,096"
"1","604","python3.12","h","gemv_norm_n1(const unsigned short *, int)","1","14","(256, 1, 1)","(320, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","ns","11,500"
"2","604","python3.12","h","gemv_norm_n1(const unsigned short *, int)","1","14","(256, 1, 1)","(320, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","12.5"
"3","604","python3.12","h","void nvjet<8>(float)","1","14","(384, 1, 1)","(8, 1, 1)","0","9.0","Command line profiler metrics","dram__bytes.sum","byte","999"
'''


def test_kernel_times_parse_units_and_names():
    times = kernel_times(CSV)
    assert [n for n, _ in times] == ["embedding_gather", "gemv_norm_n1", "gemv_norm_n1"]
    assert [t for _, t in times] == pytest.approx([4.096, 11.5, 12.5])


def test_table_sums_per_kernel():
    text = table(kernel_times(CSV), graph_ms=0.05)
    assert "| gemv_norm_n1 | 2 | 24.0 | 12.00 | 0.85 |" in text
    assert "| all kernels, each timed alone | 3 | 28.1 |" in text
    assert "Graph replay 50.0 µs" in text

"""Host side of sampling inside the decode graphs (no GPU): the device's seeded uniform (compiled
for the host) is numpy's default_rng([seed, step]).random() bit for bit, the per-row parameter block
a graph reads is packed from the steps (padded rows zeroed), and ReadbackStep turns the copied-back
arrays into the sampler's SampledTokens."""
from __future__ import annotations

import shutil
import subprocess

import numpy as np
import pytest

from engine.batch import SeqStep
from engine.executor.gpu_readback import ReadbackStep
from engine.executor.gpu_sampler import GRAPH_FIELDS, MAX_TOP_LOGPROBS, pack_graph_rows, seeded_rows, uniform_for
from engine.request import SamplingParams
from openinfer_kernels.raw_cuda import KERNEL_DIR


def step(i: int, **params) -> SeqStep:
    return SeqStep(seq_id=i, token_ids=[1], start_pos=3, block_table=[0], sample=True,
                   params=SamplingParams(**params), num_generated=i)


def test_device_uniform_is_numpy_default_rng(tmp_path):
    """sampling.cu's seeded_uniform, compiled for the host by nvcc, against numpy on random and edge
    (seed, step) pairs: the same double, bit for bit."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not available")
    main = tmp_path / "main.cu"
    main.write_text('#include "sampling.cu"\n#include <cstdio>\nint main() { unsigned s, t;\n'
                    '  while (scanf("%u %u", &s, &t) == 2) printf("%.17g\\n", seeded_uniform(s, t));\n}\n')
    exe = tmp_path / "uniform"
    subprocess.run([nvcc, f"-I{KERNEL_DIR}", "-o", str(exe), str(main)], check=True, capture_output=True)
    rng = np.random.default_rng(7)
    pairs = np.concatenate([rng.integers(0, 2**32, (1000, 2)), [[0, 0], [2**32 - 1, 2**32 - 1], [0, 2**32 - 1],
                                                                [2**31, 1], [1, 0]]])
    text = "".join(f"{a} {b}\n" for a, b in pairs.tolist())
    got = np.array(subprocess.run([str(exe)], input=text, capture_output=True, text=True, check=True).stdout.split(),
                   np.float64)
    want = np.array([np.random.default_rng([a, b]).random() for a, b in pairs.tolist()])
    np.testing.assert_array_equal(got, want)


def test_seeded_rows_mark_device_rows_and_draw_the_rest():
    seqs = [step(0, seed=None), step(1, seed=12345), step(2, seed=2**40 + 3), step(3, seed=2**32 - 1)]
    uniform, seed, steps = seeded_rows(seqs)
    np.testing.assert_array_equal(uniform, [-1.0, -1.0, uniform_for(seqs[2]), -1.0])
    np.testing.assert_array_equal(seed, np.uint32([0, 12345, 0, 2**32 - 1]))
    np.testing.assert_array_equal(steps, np.uint32([0, 1, 0, 3]))


def test_pack_graph_rows_fills_rows_and_zeroes_padding():
    rows = 8
    host = {name: np.full(rows, 77, dtype) for name, dtype in GRAPH_FIELDS}     # stale values everywhere
    seqs = [step(0, temperature=0.0), step(1, temperature=0.7, top_k=40, seed=5, logprobs=3),
            step(2, temperature=1.2, top_p=0.9, min_p=0.05, logprobs=0)]
    pack_graph_rows(host, seqs, rows)
    np.testing.assert_array_equal(host["temperature"][:3], np.float32([0.0, 0.7, 1.2]))
    np.testing.assert_array_equal(host["top_k"][:3], [-1, 40, -1])
    np.testing.assert_array_equal(host["top_p"][:3], np.float32([1.0, 1.0, 0.9]))
    np.testing.assert_array_equal(host["min_p"][:3], np.float32([0.0, 0.0, 0.05]))
    np.testing.assert_array_equal(host["logprobs"][:3], [0, 3, 0])
    np.testing.assert_array_equal(host["uniform"][:3], [0.0, -1.0, -1.0])       # derived on the device
    np.testing.assert_array_equal(host["seed"][:3], [0, 5, 0])
    np.testing.assert_array_equal(host["step"][:3], [0, 1, 2])
    for name, _ in GRAPH_FIELDS:                       # padded rows: temperature 0 (no draw), no logprobs
        assert not host[name][3:].any(), name


class _Done:
    def __init__(self):
        self.waited = 0

    def synchronize(self):
        self.waited += 1


def test_graph_step_result_builds_tokens_with_logprobs():
    ids = np.array([5, 9, 11], np.int32)
    lp = np.array([-0.5, -1.25, -2.0], np.float32)
    top_ids = np.arange(3 * MAX_TOP_LOGPROBS, dtype=np.int32).reshape(3, MAX_TOP_LOGPROBS)
    top_lp = -np.linspace(0, 3, 3 * MAX_TOP_LOGPROBS, dtype=np.float32).reshape(3, MAX_TOP_LOGPROBS)
    done = _Done()
    out = ReadbackStep([10, 11, 12], ids, done, [None, 0, 2], lp, top_ids, top_lp).result()
    assert done.waited == 1
    assert [(t.seq_id, t.token_id) for t in out.sampled] == [(10, 5), (11, 9), (12, 11)]
    assert out.sampled[0].logprob is None and out.sampled[0].top_logprobs == []
    assert out.sampled[1].logprob == -1.25 and out.sampled[1].top_logprobs == []
    assert out.sampled[2].logprob == -2.0
    assert out.sampled[2].top_logprobs == [(int(top_ids[2, j]), float(top_lp[2, j])) for j in range(2)]
    greedy = ReadbackStep([1], ids[:1], _Done()).result()
    assert greedy.sampled[0].token_id == 5 and greedy.sampled[0].logprob is None

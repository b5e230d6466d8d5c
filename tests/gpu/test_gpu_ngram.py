"""Prompt-lookup drafts on a real GPU (ngram_draft.cu, engine/executor/gpu_ngram.py; the host emulation's tests
are tests/kernels/test_ngram_draft_emulated.py and tests/spec/test_spec_ngram_device.py).

* The kernel against engine/ngram.py ngram_draft on random and adversarial sequences, rows to several CTA widths.
* The proposer over simulated engine steps (test_spec_ngram_device.simulate) on the device: its drafts equal the
  host NgramProposer's every step.
* The engine with method 'ngram' on the GPU executor (its device proposer): every proposal equals the host lookup
  on the same sequences, most come with the step before's read-back, and the greedy runs pass the floor gate
  with speculation's divergences only at near ties (test_gpu_spec.py's rules), on every path of test_free_running.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from test_free_running import PATHS
from test_gpu_free_running import assert_floor_gate, gate_line
from test_gpu_spec import NGRAM, K, assert_divergences_are_ties
from test_ngram_draft_emulated import adversarial
from test_spec_ngram_device import simulate

from engine.executor import gpu_ngram
from engine.executor.gpu_mapped_copy import MappedCopy
from engine.ngram import NgramProposer, ngram_draft
from harness.free_running_paths import engine_greedy
from openinfer_kernels.raw_cuda import kernel

pytestmark = pytest.mark.gpu


def test_kernel_matches_the_host_lookup():
    import cupy
    draft = kernel("ngram_draft", "ngram_draft")
    rng = np.random.default_rng(56)
    for trial in range(40):
        min_n = int(rng.integers(1, 5))
        max_n = int(rng.integers(min_n, 9))
        k = int(rng.integers(1, 9))
        seqs = [adversarial(rng, int(rng.choice([rng.integers(1, 12), rng.integers(12, 600),
                                                 rng.integers(600, 5000)]))) for _ in range(64)]
        stride = max(len(s) for s in seqs) + 3
        rows = rng.permutation(len(seqs) + 4)[:len(seqs)].astype(np.int32)
        tokens = rng.integers(-5, 100, (len(seqs) + 4, stride)).astype(np.int32)
        for s, r in zip(seqs, rows):
            tokens[r, :len(s)] = s
        limits = rng.integers(0, k + 3, len(seqs)).astype(np.int32)
        drafts, counts = cupy.full((len(seqs), k), -9, np.int32), cupy.full(len(seqs), -9, np.int32)
        draft((len(seqs),), (gpu_ngram.DRAFT_THREADS,),
              (cupy.asarray(tokens), np.int64(stride), cupy.asarray(rows),
               cupy.asarray(np.array([len(s) for s in seqs], np.int32)), cupy.asarray(limits), np.int32(min_n),
               np.int32(max_n), np.int32(k), drafts, counts))
        got_drafts, got_counts = drafts.get(), counts.get()
        for b, s in enumerate(seqs):
            want = ngram_draft(s.astype(np.int64), min_n, max_n, min(int(limits[b]), k))
            assert got_drafts[b, :got_counts[b]].tolist() == want, (trial, b, min_n, max_n, int(limits[b]))


def test_proposer_over_engine_steps():
    import cupy
    stream = cupy.cuda.Stream(non_blocking=True)
    device = gpu_ngram.CupyDevice(SimpleNamespace(stream=stream, mapped_copy=MappedCopy(stream)))
    with stream:
        for seed in range(8):
            simulate(seed, rows=8, steps=60, device=device, to_device=cupy.asarray, landed=stream.synchronize)


@pytest.fixture(scope="module")
def line():
    yield from gate_line("qwen3_tied", num_speculative_tokens=K)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("run", PATHS, ids=[p.name for p in PATHS])
def test_engine_drafts_on_the_device(line, run, graphs, monkeypatch):
    name, model, exact, bf16, prompts, executors = line
    ex = executors[graphs]
    prompts = prompts[2:4] if run.follow_up else prompts
    propose, on_demand = gpu_ngram.GpuNgramProposer.propose, gpu_ngram.GpuNgramProposer._on_demand
    calls = {"propose": 0, "on_demand": 0}
    host = NgramProposer(NGRAM.prompt_lookup_min, NGRAM.prompt_lookup_max)

    def checked(self, seqs, limits):
        calls["propose"] += 1
        drafts = propose(self, seqs, limits)
        assert drafts == host.propose(seqs, limits)
        return drafts

    def counted(self, seqs, limits):
        calls["on_demand"] += 1
        return on_demand(self, seqs, limits)
    monkeypatch.setattr(gpu_ngram.GpuNgramProposer, "propose", checked)
    monkeypatch.setattr(gpu_ngram.GpuNgramProposer, "_on_demand", counted)
    off = engine_greedy(ex, model.tokenizer, prompts, run)
    on = engine_greedy(ex, model.tokenizer, prompts, run, speculation=(NGRAM, None))
    print(f"ngram on the device, {run.name}: {calls}, {on.accepted_drafts} drafts accepted")
    assert calls["propose"] > 10 and calls["on_demand"] < calls["propose"] / 2, calls
    row = assert_floor_gate(f"spec-ngram/{name}/{run.name}/{'graphs' if graphs else 'eager'}", exact, bf16, on)
    assert_divergences_are_ties(exact, off, on, row["tie_tol"], row["hf_bf16_misses"] + 1)

"""The CPU executor's BLAS threads: one for decode-size steps, --cpu-threads for larger ones (OpenBLAS's
own count, read back from the library), the environment's OPENBLAS_NUM_THREADS honoured, and the engine
process running with the setting."""
from __future__ import annotations

import subprocess

import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.cpu import CpuExecutor
from engine.executor.cpu_threads import DECODE_TOKENS, default_cpu_threads, openblas, usable_cores
from engine.env import cpu_threads_from_env
from engine.executor.options import options_of
from engine.loader import load_model
from harness.models import tiny_model_path
from test_server_cli import OPENINFER, ROOT, free_port, interrupt, wait_healthy

needs_openblas = pytest.mark.skipif(openblas() is None, reason="numpy runs a BLAS other than OpenBLAS")


@needs_openblas
def test_decode_steps_run_on_one_thread_larger_ones_on_cpu_threads():
    blas = openblas()
    ex = CpuExecutor(load_model(tiny_model_path("qwen3_tied")), options_of(num_kv_blocks=32, max_model_len=128,
                                                                          cpu_threads=3))
    prompt = SeqStep(0, list(range(1, DECODE_TOKENS + 9)), 0, [0, 1], True)
    ex.execute(ModelBatch.build([prompt]))
    assert blas.get() == 3
    decodes = [SeqStep(1 + i, [5], 0, [2 + i], True) for i in range(DECODE_TOKENS)]
    ex.execute(ModelBatch.build(decodes))
    assert blas.get() == 1
    ex.execute(ModelBatch.build([prompt]))
    assert blas.get() == 3


def test_the_default_leaves_a_core_free():
    assert default_cpu_threads() == max(1, usable_cores() - 1)


def test_cpu_threads_from_the_environment():
    assert cpu_threads_from_env({}) is None
    assert cpu_threads_from_env({"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "5"}) == 3
    assert cpu_threads_from_env({"OMP_NUM_THREADS": "5"}) == 5
    for bad in ("0", "two", "-1"):
        with pytest.raises(ValueError, match="OPENBLAS_NUM_THREADS"):
            cpu_threads_from_env({"OPENBLAS_NUM_THREADS": bad})


@needs_openblas
def test_the_engine_process_runs_with_the_setting():
    """`openinfer serve --cpu-threads 3`: the engine process reads OpenBLAS's count back after the executor set it
    (one thread while idle: the decode-size setting) and says both at start."""
    port = free_port()
    proc = subprocess.Popen(OPENINFER + ["serve", "--model", tiny_model_path("qwen3_untied"), "--device", "cpu",
                                         "--port", str(port), "--max-model-len", "256", "--num-kv-blocks", "64",
                                         "--cpu-threads", "3"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    finally:
        interrupt(proc)
    log = proc.stderr.read()
    assert f"OpenBLAS threads: 1 for steps of up to {DECODE_TOKENS} tokens, 3 above (--cpu-threads; now 1)" in log, log

"""The step trace's CPU time and collector fields (engine/step_trace.py): a step's CPU time counts the work
of the executor's worker threads, and a full collection inside a step is recorded with its time."""
import gc
import json
import threading
import time
from types import SimpleNamespace

from engine.step_trace import StepTrace

OUT = SimpleNamespace(steps=[SimpleNamespace(start_pos=0, prompt_len=3, token_ids=[1, 2, 3])], num_tokens=3)
EXECUTOR = SimpleNamespace(last_gpu_ms=lambda: None, last_step_graphed=False)


def spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_trace_counts_worker_threads_and_full_collections(tmp_path):
    trace = StepTrace(str(tmp_path / "steps.jsonl"))
    trace.begin()
    worker = threading.Thread(target=spin, args=(0.2,))      # a worker's CPU, not the engine thread's
    worker.start()
    worker.join()
    trace.end(OUT, False, EXECUTOR)
    trace.begin()
    for _ in range(1000):                                     # garbage in cycles for the collector
        a = []
        a.append(a)
    gc.collect(2)
    trace.end(OUT, False, EXECUTOR)
    trace.begin()
    trace.end(OUT, False, EXECUTOR)
    trace.close()
    assert trace._collected not in gc.callbacks
    with open(tmp_path / "steps.jsonl", encoding="utf-8") as f:
        first, collected, idle = (json.loads(line) for line in f)
    assert first["cpu_ms"] >= 150
    assert collected["gc_gen"] == 2 and collected["gc_ms"] > 0
    assert idle["gc_gen"] == -1 and idle["gc_ms"] == 0

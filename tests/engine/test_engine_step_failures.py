"""Failed steps in the overlapped engine loop (its fake executors: test_engine_overlap.py): a step whose launch or
result raises fails its requests and the step queued behind it, not the engine; what was admitted with it is
scheduled afresh, every block comes back, and no timing of a failed step is read for a later one."""
from __future__ import annotations

import collections
import json

from test_engine_overlap import AsyncFakeExecutor, client_view, run

from engine.events import Error, Finished, Scheduled, Token
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, make_engine, run_until_idle, submit


def test_a_failed_launch_of_a_mixed_step_queued_ahead_fails_only_the_step_before():
    """The launch of a mixed step queued ahead raises: the requests of the step it was queued behind fail
    (their next step never ran), the prompt it admitted is scheduled afresh and completes, and every block
    comes back."""
    class FailOnce(AsyncFakeExecutor):
        failed = False

        def submit(self, batch, fed: bool = False):
            if fed and not self.failed and batch.fed_rows() < batch.num_tokens:
                self.failed = True
                raise RuntimeError("injected launch failure")
            return super().submit(batch, fed)

    ex = FailOnce()
    engine = make_engine(ex)
    greedy = dict(temperature=0.0, ignore_eos=True)
    a = submit(engine, GenerateRequest("a", [5, 6, 7], SamplingParams(max_tokens=30, **greedy)))
    for _ in range(3):
        engine.step()
    b = submit(engine, GenerateRequest("b", list(range(20, 45)), SamplingParams(max_tokens=5, **greedy)))
    run_until_idle(engine)
    assert ex.failed
    assert isinstance(a[-2], Error) and a[-1] is None and "injected launch failure" in a[-2].message
    sync = run(FakeExecutor(), [GenerateRequest("b", list(range(20, 45)), SamplingParams(max_tokens=5, **greedy))])
    assert client_view(b) == sync["b"] and [type(e) for e in b].count(Scheduled) == 1
    engine.block_manager.check_invariants(idle=True)


def test_a_failed_step_leaves_no_stale_timing_for_the_steps_after_it(tmp_path):
    """Steps timed in launch order (the GPU executor's CUDA-event pairs): a step whose result raises is never read,
    so the engine discards the timings in flight; each later trace row reads its own step's, and every request
    after the failure completes."""
    class TimedFailOnce(AsyncFakeExecutor):
        failed = False

        def __init__(self):
            super().__init__()
            self.timings, self.launched, self.last_read = collections.deque(), 0, None

        def submit(self, batch, fed: bool = False):
            self.launched += 1
            self.timings.append(float(self.launched))
            step, label = super().submit(batch, fed), float(self.launched)
            result = step.result

            def read():
                if not self.failed and self.launched >= 4:
                    self.failed = True
                    raise RuntimeError("injected step failure")
                self.last_read = label
                return result()
            step.result = read
            return step

        def last_gpu_ms(self):
            got = self.timings.popleft()
            assert got == self.last_read, f"read step {got}'s timing for step {self.last_read}"
            return got

        def discard_step_times(self):
            self.timings.clear()

    ex = TimedFailOnce()
    engine = make_engine(ex, step_trace=str(tmp_path / "steps.jsonl"))
    greedy = dict(temperature=0.0, ignore_eos=True)
    first = submit(engine, GenerateRequest("first", [5, 6, 7], SamplingParams(max_tokens=30, **greedy)))
    for _ in range(6):
        engine.step()
    later = submit(engine, GenerateRequest("later", [8, 9], SamplingParams(max_tokens=12, **greedy)))
    run_until_idle(engine)
    engine.trace.close()
    assert ex.failed and isinstance(first[-2], Error)
    assert isinstance(later[-2], Finished) and sum(isinstance(e, Token) for e in later) == 12
    rows = [json.loads(line) for line in open(tmp_path / "steps.jsonl")]
    assert len(rows) >= 12 and all(r["gpu_ms"] is not None for r in rows)

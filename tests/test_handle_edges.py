"""EngineHandle limits as a client sees them (fake model)."""
import asyncio

from engine.config import EngineConfig
from engine.events import Finished, Rejected
from engine.handle import EngineHandle
from engine.request import GenerateRequest, SamplingParams
from fake_executor import FakeExecutor, FakeTokenizer


def test_max_model_len_is_what_the_kv_pool_can_hold():
    """A KV pool smaller than the model's context: the advertised max_model_len (what the server
    validates against and fills a chat's default max_tokens up to) must be a length the engine
    accepts, not one it rejects for lack of KV cache."""
    pool_blocks = 4
    h = EngineHandle(EngineConfig(max_model_len=512), executor=FakeExecutor(num_kv_blocks=pool_blocks),
                     tokenizer=FakeTokenizer(), model_name="fake")
    try:
        assert h.max_model_len <= pool_blocks * 16
        prompt = [1, 2, 3]
        r = GenerateRequest("fill", prompt, SamplingParams(temperature=0, ignore_eos=True,
                                                          max_tokens=h.max_model_len - len(prompt)))

        async def run():
            return [e async for e in h.submit(r)]
        events = asyncio.run(run())
        assert not any(isinstance(e, Rejected) for e in events), events[0]
        assert [e.reason for e in events if isinstance(e, Finished)] == ["length"]
    finally:
        h.shutdown()


def test_idle_engine_runs_the_executors_warm_up_and_serves_between_pieces():
    """While idle the engine calls executor.warm_up() (the GPU's graph captures) until it says it is
    done; a request that arrives meanwhile is served between two pieces."""
    import threading
    import time

    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    from engine.request import SamplingParams
    from fake_executor import FakeExecutor, FakeTokenizer

    class Warming(FakeExecutor):
        def __init__(self):
            super().__init__()
            self.pieces, self.release = 0, threading.Event()

        def warm_up(self) -> bool:
            self.pieces += 1
            if self.pieces == 3:
                self.release.wait(5)          # a long capture; a request arrives meanwhile
            time.sleep(0.01)
            return self.pieces < 6

    ex = Warming()
    with EngineHandle(EngineConfig(max_model_len=512), executor=ex, tokenizer=FakeTokenizer()) as h:
        deadline = time.monotonic() + 5
        while ex.pieces < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        done = []
        t = threading.Thread(target=lambda: done.append(h.generate([[1, 2, 3]], SamplingParams(max_tokens=4))))
        t.start()
        ex.release.set()
        t.join(10)
        assert done and done[0][0].error is None and len(done[0][0].outputs[0].token_ids) == 4
        deadline = time.monotonic() + 5
        while ex.pieces < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)
        assert ex.pieces == 6                 # it stops once the executor says there is nothing left


def test_prompts_with_ids_outside_the_vocabulary_are_rejected_naming_the_first():
    """The vocabulary check (one numpy pass for plain ints, a walk otherwise) names the first bad id and
    lets a valid prompt through."""
    h = EngineHandle(EngineConfig(max_model_len=128), executor=FakeExecutor(num_kv_blocks=64),
                     tokenizer=FakeTokenizer(), model_name="fake")
    vocab = FakeTokenizer.vocab_size

    async def run(rid, prompt):
        return [e async for e in h.submit(GenerateRequest(rid, prompt, SamplingParams(temperature=0, max_tokens=2)))]
    try:
        for rid, prompt, bad in (("neg", [1, -3, vocab + 5], "-3"), ("big", [1, 2, vocab, vocab + 1], str(vocab)),
                                 ("float", [1, 2.5, 3], "2.5"), ("huge", [1, 2 ** 70], str(2 ** 70)),
                                 ("none", [1, None], "None")):
            events = asyncio.run(run(rid, prompt))
            assert isinstance(events[0], Rejected), (rid, events)
            assert f"prompt token id {bad} is out of the vocabulary range" in events[0].reason, events[0].reason
        events = asyncio.run(run("ok", [0, 1, vocab - 1]))
        assert not any(isinstance(e, Rejected) for e in events)
    finally:
        h.shutdown()

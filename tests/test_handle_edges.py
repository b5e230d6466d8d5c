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

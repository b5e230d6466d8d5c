"""EngineHandle limits as a client sees them (fake model)."""
import asyncio

import numpy as np

from engine.config import EngineConfig
from engine.events import Finished, Rejected, Token
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
        # the server's token-id prompts come as int32 arrays: the same checks, the same outputs as a list
        events = asyncio.run(run("arr-bad", np.array([1, vocab + 2], np.int32)))
        assert isinstance(events[0], Rejected) and f"prompt token id {vocab + 2} is out" in events[0].reason
        assert isinstance(asyncio.run(run("arr-empty", np.zeros(0, np.int32)))[0], Rejected)
        prompt = list(range(3, 40))
        as_list, as_array = (asyncio.run(run(rid, p)) for rid, p in (("l", prompt), ("a", np.array(prompt, np.int32))))
        tokens = [[(type(e.token_id), e.token_id) for e in events if isinstance(e, Token)] for events in (as_list, as_array)]
        assert tokens[0] == tokens[1] and tokens[0] and all(t is int for t, _ in tokens[1])
        assert [e.usage.prompt_tokens for e in as_array if isinstance(e, Finished)] == [len(prompt)]
    finally:
        h.shutdown()


def test_a_prompt_array_hashes_as_its_list():
    """Sequence.block_hashes over the request's int array (no list conversion) equals the list's chain,
    extended past the prompt into generated tokens."""
    from engine.sequence import Sequence
    from memory.prefix_hash import hash_chain

    prompt = list(range(100, 150))                   # 3 full blocks and 2 tokens
    seqs = [Sequence(0, "r", list(prompt), len(prompt), SamplingParams(), lora_id=2, prompt_array=arr)
            for arr in (None, np.array(prompt, np.int32))]
    for s in seqs:
        s.block_hashes(2)
        s.token_ids += list(range(14))               # generated tokens fill the fourth block
    assert seqs[0].block_hashes(4) == seqs[1].block_hashes(4) == hash_chain(seqs[0].token_ids, 16, 2)


def test_a_prompt_array_shares_the_prefix_cache_with_its_list():
    """A request whose prompt is an int array (the server's token-id prompts) hits the blocks a list prompt
    of the same ids cached, and with n = 2 its samples fork from it as a list prompt's do."""
    from fake_executor import make_engine, run_until_idle, submit
    from test_host_tier import cached, tokens

    engine = make_engine(FakeExecutor(num_kv_blocks=64))
    prompt = list(range(5, 75))                      # 4 full blocks and 6 tokens
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, n=2)
    first = submit(engine, GenerateRequest("list", prompt, params))
    run_until_idle(engine)
    second = submit(engine, GenerateRequest("array", np.array(prompt, np.int32), params))
    run_until_idle(engine)
    assert cached(first) == 0 and cached(second) == 64
    assert tokens(second) == tokens(first) and len(tokens(first)) == 8
    engine.block_manager.check_invariants(idle=True)


def test_a_prompt_sharing_a_recent_prefix_hashes_only_its_new_blocks(monkeypatch):
    """The scheduler takes the chain of a recent prompt's shared blocks instead of hashing them again; the
    chains it ends with are the ones hashed from scratch, and the prefix hits the same."""
    import engine.sequence
    from fake_executor import make_engine, run_until_idle, submit
    from memory.prefix_hash import hash_chain
    from test_host_tier import cached

    hashed = []
    monkeypatch.setattr(engine.sequence, "hash_chain",
                        lambda t, *a, **k: hashed.append(len(t)) or hash_chain(t, *a, **k))
    engine_ = make_engine(FakeExecutor(num_kv_blocks=64))
    prompt = list(range(5, 105))                     # 6 full blocks and 4 tokens
    p = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    submit(engine_, GenerateRequest("a", prompt, p))
    run_until_idle(engine_)
    turn = prompt[:70] + [200, 201] + list(range(30))  # shares 4 blocks and 6 tokens, then goes on
    events = submit(engine_, GenerateRequest("b", turn, p))
    seq = engine_.scheduler.waiting[0]
    run_until_idle(engine_)
    assert hashed == [6 * 16, 2 * 16]                # the second prompt hashed its 2 new full blocks only
    # 4 whole blocks, then a partial hit: a's fifth block shares the turn's next 6 tokens
    assert seq.block_hashes(6) == hash_chain(turn, 16)[:6] and cached(events) == 70

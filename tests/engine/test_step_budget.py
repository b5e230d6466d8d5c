"""A step's time budget (engine/step_budget.py): on the CPU executor a long prompt joining running streams
is cut into chunks whose modelled time (the linear layers over the step's rows, and the attention over
each sequence's context, under the demo model's cost model) stays within the step's target, every stream
keeps its token every step, and the GPU's budget (no cost model) stays vLLM's token count."""
from __future__ import annotations

import random
from itertools import pairwise

import numpy as np
import pytest

from engine.batch import StepOutput
from engine.config import EngineConfig
from engine.limits import DEFAULT_LIMITS, resolve_limits
from engine.loop_options import options_within
from engine.engine_loop import EngineLoop
from engine.executor.base import ExecutorBase
from engine.executor.cpu_cost import TARGET_S, cpu_step_cost
from engine.executor.options import resolved_options
from engine.request import GenerateRequest, SamplingParams
from engine.sampling import sample_step
from engine.step_budget import MIN_PREFILL, Products, StepBudget, StepCost
from fake_executor import FakeTokenizer, submit
from memory.kv_pool import BLOCK_SIZE

MAX_MODEL_LEN = 8192


@pytest.fixture(scope="module")
def demo_cost() -> StepCost:
    """The numpy executor's cost model of the demo model (SmolLM2-135M), as CpuExecutor builds it."""
    from engine.loader import load_model
    from engine.loader.demo import demo_model_path
    model = load_model(demo_model_path())
    return cpu_step_cost(model.config, model.weights, model.model.kv_layout().block_bytes(4) // BLOCK_SIZE)


def random_cost(rng: random.Random) -> StepCost:
    one, head_one = rng.choice([0.03, 0.1]), rng.choice([0.0, 0.01])
    layers = Products(one, many=one * rng.choice([1.0, 2.5]), row=rng.choice([0.0, 0.003]))
    head = Products(head_one, many=head_one * rng.choice([1.0, 2.5]), row=rng.choice([0.0, 6e-4]))
    return StepCost(rng.choice([0.0, 0.01]), layers, head, seq=rng.choice([0.0, 2e-3]), key=rng.choice([0.0, 1e-5, 1e-3]),
                    pair=rng.choice([0.0, 2e-6, 1e-4]), target=rng.uniform(0.05, 1.0))


def test_most_within_is_the_largest_chunk_that_fits():
    """Beside what a step already holds (a few decodes), the largest chunk whose step stays within the
    limit, by brute force: sampled once (a prompt's chunk) or on every row (a verify)."""
    rng = random.Random(0)
    for _ in range(300):
        budget = StepBudget.of(rng.choice([8, 76, 512]), random_cost(rng))
        for _ in range(rng.randrange(0, 4)):
            budget.spend(rng.randrange(0, 4000), 1, prefill=False)
        start, n, verify = rng.randrange(0, 9000), rng.randrange(0, 300), rng.random() < 0.3
        cost, sampled = budget.cost, [m if verify else 1 for m in range(n + 1)]
        times = [cost.time(budget.rows + m, budget.sampled + sampled[m], budget.own + cost.own(start, m))
                 for m in range(n + 1)]
        want = max((m for m in range(n + 1) if m == 0 or times[m] <= budget.limit), default=0)
        assert budget.most_within(start, n, verify) == want, (budget, start, n, verify)


def test_the_linear_layers_cost_grows_with_rows_and_jumps_from_one(demo_cost):
    """The demo model's linear layers: a matrix product of two rows reads the weights slower than one
    row's matrix-vector product (the OpenBLAS packing the issue measured); from there on each row adds
    its multiply-adds; the lm_head likewise, a quarter of the layers' weights."""
    for products in (demo_cost.layers, demo_cost.head):
        times = [products.of(r) for r in range(257)]
        assert times[0] == 0 and all(a < b for a, b in pairwise(times))
        assert times[2] > 2 * times[1]
    assert 0.2 < demo_cost.head.one / demo_cost.layers.one < 0.35
    macs = 106.2e6                                       # SmolLM2-135M's decoder-layer multiply-adds a token
    assert demo_cost.layers.row == pytest.approx(macs / 41e9, rel=0.5)


def test_the_chunk_shrinks_as_its_context_grows_and_the_step_stays_within_its_target(demo_cost):
    """Beside 8 decodes at a 300-token context, the chunk a step takes of a long prompt shrinks as the
    prompt's computed part grows, and the step's modelled time stays within the target."""
    sizes = []
    for start in range(0, 8101, 500):
        budget = StepBudget.of(DEFAULT_LIMITS["cpu"][1], demo_cost)
        assert budget.limit == TARGET_S
        for _ in range(8):
            budget.fit(300, 1)
            budget.spend(300, 1, prefill=False)
        n = budget.fit(start, 8101 - start)
        budget.spend(start, n, prefill=True)
        sizes.append(n)
        assert n == MIN_PREFILL or budget.time() <= TARGET_S
    assert all(a >= b for a, b in pairwise(sizes)) and sizes[0] > 4 * sizes[-1], sizes


def test_without_a_cost_model_the_budget_is_tokens():
    budget = StepBudget.of(64, None)
    assert budget.fit(8000, 500) == 64
    budget.spend(8000, 60, prefill=True)
    assert budget.fit(0, 500) == 4 and budget.fit(8000, 1) == 1


def test_decodes_are_never_cut_and_the_first_prefill_progresses(demo_cost):
    budget = StepBudget.of(64, demo_cost)
    for _ in range(20):                                 # 20 decodes of 4k-token sequences: far past the time
        assert budget.fit(4000, 1) == 1
        budget.spend(4000, 1, prefill=False)
    assert budget.time() > budget.limit and budget.fit(8000, 100) == MIN_PREFILL     # the first prefill still goes
    assert budget.fit(8000, 2) == 2
    budget.spend(8000, MIN_PREFILL, prefill=True)
    assert budget.fit(0, 100) == 0                                       # a second one waits


class InstantExecutor(ExecutorBase):
    """Takes steps at once (every sampled row gets token 7), recording (prompt_len, start, tokens) of each
    row; carries a StepCost and the CPU executor's default limits."""
    vocab_size = 262

    def __init__(self, step_cost: StepCost, num_kv_blocks: int = 4096):
        self.options = resolved_options(EngineConfig(device="cpu"), "cpu", MAX_MODEL_LEN)[1]
        self.step_cost, self.num_kv_blocks = step_cost, num_kv_blocks
        self.steps: list[list[tuple[int, int, int]]] = []

    def execute(self, batch):
        self.steps.append([(s.prompt_len, s.start_pos, len(s.token_ids)) for s in batch.seqs])
        sampled = [s for s in batch.seqs if s.sample]
        logits = np.zeros((len(sampled), self.vocab_size), np.float32)
        logits[:, 7] = 1.0
        return StepOutput(sample_step(logits, sampled))


def run_long_prompt(cost: StepCost, long_len: int, n: int, streams: int = 8) -> tuple[InstantExecutor, list]:
    """`streams` streams decode; then a prompt of long_len tokens (n samples) joins; steps run until each of
    its samples has a token. Returns the executor (its steps) and the long request's events."""
    ex = InstantExecutor(cost)
    config = EngineConfig(device="cpu")
    engine = EngineLoop(ex, FakeTokenizer(), options_within(ex.options, config, MAX_MODEL_LEN), [256])
    greedy = SamplingParams(temperature=0, max_tokens=6000, ignore_eos=True)
    for i in range(streams):
        submit(engine, GenerateRequest(f"s{i}", [10 + i] * 24, greedy))
    for _ in range(3):
        engine.step()
    ex.steps.clear()                                    # from here on every stream decodes
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=2, ignore_eos=True, n=n)
    events = submit(engine, GenerateRequest("long", [1 + i % 250 for i in range(long_len)], params))
    while len({e.index for e in events if getattr(e, "token_id", None) is not None}) < n:
        assert None not in events and len(ex.steps) < 20000, events[-2:]
        engine.step()
    return ex, events


def check_steps(ex: InstantExecutor, cost: StepCost, long_len: int, streams: int = 8) -> int:
    """Every step: each stream decodes one token, and the step's modelled time (the layers over its rows,
    the lm_head over a row a sequence, each sequence's attention) is within the target, or its one prefill
    chunk is the MIN_PREFILL tokens that keep the prompt going. Returns the steps."""
    tokens = ex.options.max_num_batched_tokens
    limit = StepBudget.of(tokens, cost).limit
    for rows in ex.steps:
        assert sum(1 for p, _, _ in rows if p == 24) == streams, rows    # no stream waits a step
        time = cost.base + cost.layers.of(sum(k for _, _, k in rows)) + cost.head.of(len(rows))
        time += sum(cost.seq + (start + k) * cost.key + k * (start + k) * cost.pair for _, start, k in rows)
        chunks = [(start, k) for p, start, k in rows if p == long_len and start < long_len]
        assert time <= limit + 1e-9 or (len(chunks) == 1 and chunks[0][1] <= MIN_PREFILL), (rows, time)
        assert sum(k for _, _, k in rows) <= tokens
    return len(ex.steps)


def test_a_long_prompt_never_stalls_running_streams(demo_cost):
    """The issue's case: an 8,101-token prompt joining 8 running streams of the demo model on the CPU."""
    ex, _ = run_long_prompt(demo_cost, 8101, 1)
    steps = check_steps(ex, demo_cost, 8101)
    prefill = sum(k for rows in ex.steps for p, start, k in rows if p == 8101 and start < 8101)
    assert prefill == 8101 and steps > 8101 // ex.options.max_num_batched_tokens
    late = [k for rows in ex.steps for p, start, k in rows if p == 8101 and start >= 7000]
    assert max(late) < 16                               # attention over ~8k keys makes late chunks small


def test_a_prompt_with_n16_never_stalls_running_streams(demo_cost):
    """A 2,000-token prompt with n=16 joining 8 streams: its prefill, then its 16 samples' last prompt
    tokens, are chunked within the budget while the streams decode (until every sample has a token)."""
    ex, _ = run_long_prompt(demo_cost, 2000, 16)
    check_steps(ex, demo_cost, 2000)
    assert sum(k for rows in ex.steps for p, start, k in rows if p == 2000 and start < 2000) >= 2000


def test_the_cpu_executor_brings_its_cost_model_and_the_gpu_none():
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from harness.models import tiny_model_path
    from tests.fake_executor import make_engine

    model = load_model(tiny_model_path("qwen3_tied"))
    ex = CpuExecutor(model, options_of(num_kv_blocks=8, max_model_len=64))
    assert ex.step_cost == cpu_step_cost(model.config, ex.weights, ex.kv_block_bytes // BLOCK_SIZE)
    assert 0 < ex.step_cost.pair < ex.step_cost.key < 1
    assert ExecutorBase.step_cost is None and make_engine().scheduler.step_cost is None
    limits = resolve_limits(EngineConfig(), "cpu", MAX_MODEL_LEN)
    assert (limits.max_num_seqs, limits.max_num_batched_tokens) == DEFAULT_LIMITS["cpu"]
    assert DEFAULT_LIMITS["cuda"] == (256, 8192)


def test_prompt_logprobs_and_outputs_are_the_same_under_a_tight_cost_model():
    """A harsh cost model (a 64-token prompt's own context fills the budget) cuts prompt-logprobs chunks to the
    minimum, re-fed token included, beside a running stream; the prompt still progresses, never completes a
    block mid-prompt, and gives the same prompt logprobs and tokens as without a cost model."""
    from fake_executor import FakeExecutor, make_engine, run_until_idle

    def run(cost):
        ex = FakeExecutor()
        ex.step_cost = cost
        engine = make_engine(ex, max_num_batched_tokens=32)
        stream = submit(engine, GenerateRequest("s", [5] * 20, SamplingParams(temperature=0, max_tokens=60,
                                                                             ignore_eos=True)))
        engine.step()
        long = submit(engine, GenerateRequest("p", list(range(30, 94)), SamplingParams(
            temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True)))
        run_until_idle(engine)
        engine.block_manager.check_invariants(idle=True)
        chunks = [(s.start_pos, len(s.token_ids)) for b in ex.steps for s in b.seqs if s.want_prompt_logprobs]
        return stream, long, chunks

    stream, long, chunks = run(StepCost(0.0, Products(1.0, 0.0, 1.0), Products(0.0, 0.0, 0.0), 0.0, key=0.5, pair=0.01,
                                        target=32))
    ref_stream, ref_long, ref_chunks = run(None)
    assert len(chunks) > len(ref_chunks) and all(n <= MIN_PREFILL + 1 for start, n in chunks if start >= 40)
    assert all((start + n) % BLOCK_SIZE for start, n in chunks[:-1])
    plp = [e for e in long if type(e).__name__ == "PromptLogprobs"]
    ref = [e for e in ref_long if type(e).__name__ == "PromptLogprobs"]
    assert plp[0].logprobs == ref[0].logprobs and plp[0].top_logprobs == ref[0].top_logprobs
    tokens = lambda events: [e.token_id for e in events if getattr(e, "token_id", None) is not None]  # noqa: E731
    assert tokens(long) == tokens(ref_long) and tokens(stream) == tokens(ref_stream)


def test_a_small_model_is_bound_by_its_tokens_and_a_larger_budget_is_kept(demo_cost):
    """A step aims at a time, not a count of tokens' worth: a tiny model's steps (whose tokens cost ~1,000x
    less) are bound by their tokens only; the demo model's default tokens at a prompt's start fit the
    target, and a larger token budget asked for is kept as the linear layers' time at its tokens."""
    from engine.loader import load_model
    from harness.models import tiny_model_path

    tiny = load_model(tiny_model_path("qwen3_tied"))
    cost = cpu_step_cost(tiny.config, tiny.weights, tiny.model.kv_layout().block_bytes(4) // BLOCK_SIZE)
    assert StepBudget.of(64, cost).fit(1000, 200) == 64                  # only the tokens bound it
    tokens = DEFAULT_LIMITS["cpu"][1]
    assert StepBudget.of(tokens, demo_cost).fit(0, 500) == tokens
    budget = StepBudget.of(512, demo_cost)
    assert budget.limit == pytest.approx(demo_cost.base + demo_cost.layers.of(512) + demo_cost.head.of(1))
    assert budget.limit > TARGET_S
    assert budget.fit(0, 600) > 4 * tokens

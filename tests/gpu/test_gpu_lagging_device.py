"""The engine on a lagging GPU: every step queued behind a kernel that holds the executor's stream ~15 ms, so
the host plans, packs and uploads the next step (async scheduling) while the device is still on the one
before, as under other load on the GPU. Greedy tokens and logprobs must be bit-identical to the unhurried run
on every path of the free-running gate (a pinned upload buffer rewritten before its queued copy ran gave the
chunked prefill garbage and then an illegal address, only under load). Needs a GPU."""
from __future__ import annotations

import pytest

from engine.loader import load_model
from gpu_contention import hold_stream
from harness.executors import new_gpu_executor
from harness.free_running_models import GATE_VOCAB, gate_model_path
from harness.free_running_paths import engine_greedy
from harness.models import random_sequences
from test_free_running import PATHS, PROMPT_LENS

pytestmark = pytest.mark.gpu
NEW_TOKENS = 32                 # more than a follow-up's shared tokens (PATHS: 24)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe", "deepseek_v2", "qwen3_5_text"])
def line(request):
    model = load_model(gate_model_path(request.param))
    executors = {graphs: new_gpu_executor(model, cuda_graphs=graphs, host_kv_blocks=32) for graphs in (True, False)}
    yield model, executors
    for ex in executors.values():
        ex.close()


def lagging(ex, monkeypatch, ms: float = 15.0) -> None:
    submit = ex.submit

    def late_submit(batch, *args, **kwargs):
        hold_stream(ex.stream, ms)
        return submit(batch, *args, **kwargs)

    monkeypatch.setattr(ex, "submit", late_submit)


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("run", [p for p in PATHS if p.name != "batch1"], ids=lambda p: p.name)
def test_a_lagging_device_changes_nothing(line, run, graphs, monkeypatch):
    model, executors = line
    ex = executors[graphs]
    if ex.num_state_slots and run.host_kv_blocks:
        pytest.skip("a line with per-sequence state keeps no prefix cache, hence no host KV tier")
    prompts = random_sequences(GATE_VOCAB, PROMPT_LENS, seed=11)
    prompts = prompts[2:4] if run.follow_up else prompts
    calm = engine_greedy(ex, model.tokenizer, prompts, run, new_tokens=NEW_TOKENS)
    lagging(ex, monkeypatch)
    late = engine_greedy(ex, model.tokenizer, prompts, run, new_tokens=NEW_TOKENS)
    assert [r.tokens for r in late.runs] == [r.tokens for r in calm.runs]
    assert [r.logprobs for r in late.runs] == [r.logprobs for r in calm.runs]

"""vLLM's step size on the GPU: max_num_batched_tokens 8192 (the default) with 5,000-token prompts.

The executor is built from the same options as the scheduler, so an 8192-token step is one it can
take: every request finishes, and a 5,000-token prompt prefilled in one step gives the logits of the
same prompt prefilled in 1,024-token chunks (within the bf16 tie tolerance)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.loader import load_model
from harness.executors import new_gpu_executor
from harness.models import build_tiny_model, engine_logits, log_softmax, random_sequences

pytestmark = pytest.mark.gpu
PROMPT = 5000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return build_tiny_model("qwen3_gqa4", str(tmp_path_factory.mktemp("long")), max_position_embeddings=8192,
                            rope_scaling=None)


def test_8192_token_steps_serve_5000_token_prompts(long_model):
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    from engine.request import SamplingParams

    with EngineHandle(EngineConfig(model=long_model, device="cuda", max_model_len=6000, num_kv_blocks=1600,
                                   progress=False)) as h:
        assert h.executor.options.max_num_batched_tokens == 8192 == h.engine.scheduler.max_num_batched_tokens
        prompts = random_sequences(h.executor.vocab_size, [PROMPT, PROMPT + 7, PROMPT - 3], seed=5)
        outs = h.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert [o.error for o in outs] == [None] * 3
    assert [(o.outputs[0].finish_reason, len(o.outputs[0].token_ids)) for o in outs] == [("length", 8)] * 3


def test_one_step_prefill_equals_chunked_prefill(long_model):
    model = load_model(long_model)
    blocks = -(-PROMPT // 16) + 1
    seq = random_sequences(model.config.vocab_size, [PROMPT], seed=6)[0]
    whole = new_gpu_executor(model, max_model_len=PROMPT + 16, max_num_batched_tokens=8192, num_kv_blocks=blocks)
    try:
        one = whole.forward_logits(ModelBatch.build([SeqStep(seq_id=0, token_ids=seq, start_pos=0,
                                                             block_table=list(range(blocks)), sample=False)]))
    finally:
        whole.close()
    chunked_ex = new_gpu_executor(model, max_model_len=PROMPT + 16, max_num_batched_tokens=1024,
                                  num_kv_blocks=blocks)
    try:
        chunked = engine_logits(chunked_ex, [seq], chunks=1024)[0]
    finally:
        chunked_ex.close()
    a, b = log_softmax(one), log_softmax(chunked)
    rows = np.arange(len(seq))
    regret = b[rows, b.argmax(-1)] - b[rows, a.argmax(-1)]
    assert float(np.mean(regret <= 0.05)) >= 0.99
    assert float(np.abs(a - b).mean()) < 0.02

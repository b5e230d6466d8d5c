"""The MoE and MLA lines (DeepSeek-V3 / Kimi-K2 too) through the real engine on the CPU: EngineHandle built from
the model folder as `openinfer serve --model <folder> --device cpu` builds it (greedy tokens checked against
transformers float32, teacher-forced), a prefix-cache hit, and the host KV tier on MLA's one-plane
pool (a restore that copied the wrong bytes would change the tokens)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from engine.config import EngineConfig
from engine.handle import EngineHandle
from engine.request import SamplingParams
from harness.models import hf_logits, tiny_model_path

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def hf_greedy_check(path: str, prompt: list[int], out: list[int]) -> None:
    """Every generated token is transformers' argmax on the prompt and the tokens before it."""
    logits = hf_logits(path, prompt + out[:-1])[len(prompt) - 1:]
    assert out == logits.argmax(-1).tolist()


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v2_lite", "deepseek_v2", "deepseek_v3", "kimi_k2"])
def test_serves_the_oracle_greedy_tokens_and_hits_the_prefix_cache(name):
    path = tiny_model_path(name)
    rng = random.Random(7)
    shared = [rng.randrange(5000) for _ in range(40)]
    first, second = shared + [11, 12, 13], shared + [21]
    with EngineHandle(EngineConfig(model=path, device="cpu", max_model_len=256, num_kv_blocks=64)) as h:
        a, = h.generate([first], GREEDY)
        b, = h.generate([second], GREEDY)
    # two full blocks of the shared prefix, then a partial hit: a's third block (full once a's output filled it)
    # shares shared[32:40], copied into b's own block (every layer's latent / K and V)
    assert a.cached_tokens == 0 and b.cached_tokens == 40
    for prompt, out in ((first, a), (second, b)):
        assert out.error is None and len(out.outputs[0].token_ids) == 8
        hf_greedy_check(path, prompt, out.outputs[0].token_ids)


def test_host_tier_restores_mla_latent_blocks():
    from fake_executor import make_engine
    from test_host_tier import cached, prompt_then_evict_then_again, tokens

    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model

    model = load_model(tiny_model_path("deepseek_v2_lite"))
    prompt = [(7 * i + 3) % 200 + 10 for i in range(70)]
    runs = {}
    for tier_blocks in (0, 32):
        ex = CpuExecutor(model, options_of(num_kv_blocks=10, max_model_len=512, host_kv_blocks=tier_blocks))
        assert ex.kv.shape[1] == 1 and (not tier_blocks or ex.host_kv.shape[1:] == (1, 32 * 16, 1, 40))
        engine = make_engine(ex, model.tokenizer, max_model_len=512, host_kv_blocks=tier_blocks)
        runs[tier_blocks] = prompt_then_evict_then_again(engine, prompt, GREEDY, others=4)
    (a0, b0), (a1, b1) = runs[0], runs[32]
    assert tokens(a0) == tokens(b0) == tokens(a1) == tokens(b1)
    assert cached(b1) == 64 and cached(b0) == 0
    hf_greedy_check(tiny_model_path("deepseek_v2_lite"), prompt, tokens(b1))


def test_host_tier_copy_moves_the_whole_latent_row():
    """copy_blocks on a one-plane pool: offload then restore into another block gives back every value."""
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model

    ex = CpuExecutor(load_model(tiny_model_path("deepseek_v2")), options_of(num_kv_blocks=6, max_model_len=64,
                                                                            host_kv_blocks=3))
    ex.kv[...] = np.random.default_rng(0).standard_normal(ex.kv.shape)
    ex.copy_blocks([(4, 2)], [])
    ex.copy_blocks([], [(2, 1)])
    np.testing.assert_array_equal(ex.kv[:, :, 16:32], ex.kv[:, :, 64:80])

"""Partial prefix hits on the GPU: a step's block copy (ModelBatch.block_copies) lands in the KV pool before
the step writes there, in eager steps and before a decode-graph replay, for GQA K/V and MLA latent pools.

A sequence that starts 15 tokens into a cached block (the scheduler's copy-on-write of a prompt sent again)
takes that block's KV byte for byte and scores its last token as the whole prompt's prefill did (bf16
rounding apart: the gate of test_gpu_moe_mla's prefix-hit test; an MLA line's two forms, its bound for them)."""
from __future__ import annotations

import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.loader import load_model
from engine.request import SamplingParams
from harness.executors import new_gpu_executor
from harness.models import random_sequences, tiny_model_path
from memory.kv_pool import BLOCK_SIZE
from test_gpu_executor import MIN_TIE_TOL
from test_gpu_host_tier import blocks_of
from test_gpu_moe_mla import MLA_FORMS_MEAN_DLOGPROB, MLA_FORMS_TIE_TOL, SAME_MEAN_DLOGPROB, assert_same_scores

pytestmark = pytest.mark.gpu


def block_rows(kv: np.ndarray, block: int) -> np.ndarray:
    """[L, P, 16, H, D]: one block's rows in every layer and plane."""
    return blocks_of(kv, [block])[0]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("name", ["qwen3_gqa4", "deepseek_v2_lite"])
def test_block_copy_then_last_token(name, graphs):
    model = load_model(tiny_model_path(name))
    ex = new_gpu_executor(model, cuda_graphs=graphs)
    try:
        seq = random_sequences(model.config.vocab_size, [48], seed=11)[0]
        whole = ex.forward_logits(ModelBatch.build([SeqStep(0, seq, 0, [5, 6, 7], False)]))   # cached: 5, 6, 7
        cached = block_rows(ex.kv_cache.get(), 7)
        ex.kv_cache[:, :, 9 * BLOCK_SIZE:10 * BLOCK_SIZE] = 0x7FC0            # block 9 holds NaNs until copied
        step = SeqStep(1, seq[47:], 47, [5, 6, 9], sample=True, params=SamplingParams(temperature=0.0),
                       block_copy=(7, 9))
        batch = ModelBatch.build([step])
        assert batch.block_copies.tolist() == [[7, 9]]
        if graphs:
            token = ex.execute(batch).sampled[0].token_id
            assert ex.last_step_graphed
            row = whole[47]
            assert row[token] >= row.max() - MIN_TIE_TOL, (token, int(row.argmax()))
        else:
            # an MLA line prefills 48 tokens in the expanded form and decodes one in the absorbed form
            mla = name in MLA_FORMS_MEAN_DLOGPROB
            assert_same_scores(ex.forward_logits(batch), whole[47:], MLA_FORMS_MEAN_DLOGPROB.get(name, SAME_MEAN_DLOGPROB),
                               MLA_FORMS_TIE_TOL if mla else MIN_TIE_TOL)
        copied = block_rows(ex.kv_cache.get(), 9)
        np.testing.assert_array_equal(copied[:, :, :15], cached[:, :, :15])    # the copy, byte for byte
        np.testing.assert_array_equal(block_rows(ex.kv_cache.get(), 7), cached)  # the cached block untouched
        assert not np.any(copied == 0x7FC0)                                      # and token 47 written
    finally:
        ex.close()


def test_block_copy_onto_itself_is_refused():
    model = load_model(tiny_model_path("qwen3_gqa4"))
    ex = new_gpu_executor(model)
    try:
        with pytest.raises(ValueError, match="onto itself"):
            ex.execute(ModelBatch.build([SeqStep(0, [3], 5, [1], True, block_copy=(1, 1))]))
    finally:
        ex.close()

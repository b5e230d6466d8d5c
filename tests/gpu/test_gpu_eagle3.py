"""EAGLE-3 heads on the GPU executor (engine/executor/gpu_eagle3.py).

* The head's drafting in CuPy on the compute stream equals the numpy draft's on the same kept hidden states and
  tokens (catch-up over several positions, k head steps, a draft vocabulary mapped through d2t, two sequences).
* The engine on one GPU with an eagle3 head: the target keeps the hidden states entering the head's layers, the
  head drafts, the verify steps accept or reject; greedy output equals the same GPU engine's without
  speculation, and the drafts equal the numpy head's on the GPU target's own kept rows.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_spec_eagle3 import HEADS, head_path, target_path

from engine.batch import ModelBatch
from engine.eagle3 import load_eagle3_head
from engine.eagle3_draft import Eagle3Draft
from engine.model_config import ModelConfig
from engine.request import SamplingParams
from engine.speculative import SpeculativeConfig

pytestmark = pytest.mark.gpu


class Seq:
    def __init__(self, seq_id, token_ids, num_computed):
        self.seq_id, self.token_ids, self.num_computed = seq_id, token_ids, num_computed


def test_device_draft_equals_the_numpy_draft():
    import cupy
    name = "qwen3_draft_vocab"
    target = ModelConfig.from_file(target_path(HEADS[name][0]))
    head = load_eagle3_head(head_path(name), target)
    rng = np.random.default_rng(0)
    embed = rng.standard_normal((target.vocab_size, target.hidden_size)).astype(np.float32)
    stream = cupy.cuda.Stream(non_blocking=True)
    host = Eagle3Draft(head, embed, 256)
    device = Eagle3Draft(head, cupy.asarray(embed), 256, xp=cupy, stream=stream)
    lens = [11, 7]
    batch = ModelBatch(seqs=[Seq(1, [], 0), Seq(2, [], 0)], input_ids=np.zeros(sum(lens), np.int32),
                       positions=np.concatenate([np.arange(n) for n in lens]).astype(np.int32),
                       slot_mapping=np.zeros(sum(lens), np.int32),
                       cu_seqlens=np.array([0, lens[0], sum(lens)], np.int32), context_lens=np.array(lens, np.int32),
                       block_tables=np.zeros((2, 1), np.int32), sample_rows=np.array([lens[0] - 1, sum(lens) - 1]))
    kept = {layer: rng.standard_normal((sum(lens), target.hidden_size)).astype(np.float32)
            for layer in set(head.aux_layers)}
    host.take(batch, kept)
    device.take(batch, {layer: cupy.asarray(a) for layer, a in kept.items()})
    seqs = [Seq(1, rng.integers(0, 3000, lens[0] + 1).tolist(), lens[0]),
            Seq(2, rng.integers(0, 3000, lens[1] + 1).tolist(), lens[1])]
    assert device.propose(seqs, [4, 2]) == host.propose(seqs, [4, 2])


def test_engine_with_an_eagle3_head_on_one_gpu():
    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    name = "qwen3"
    prompts = [[5, 6, 7, 8, 9] * 6, list(range(300, 340)), [11, 12, 13] * 9]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    got = []
    for spec in (None, SpeculativeConfig("eagle3", 3, model=head_path(name))):
        config = EngineConfig(model=target_path(HEADS[name][0]), device="cuda", max_model_len=256, progress=False,
                              num_kv_blocks=64, speculative_config=spec)
        with EngineHandle(config) as h:
            got.append([r.outputs[0].token_ids for r in h.generate(prompts, params)])
            stats = h.stats()
    assert stats.spec_decode_num_drafts > 10 and stats.spec_decode_num_draft_tokens > 30
    # bf16 on the GPU: a verify step's k + 1 rows and plain decoding's may part at a near tie (one request at most)
    assert sum(a == b for a, b in zip(*got)) >= len(prompts) - 1, got
    assert all(len(t) == 24 for t in got[1])

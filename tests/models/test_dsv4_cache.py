"""DeepSeek-V4's compact cache (engine/models/deepseek_v4.py, issue 58): the paged row of a token and layer is its
K = V and, on a compressed layer, the entry (and, CSA, the indexer key) of the window it closes; the compressor's
raw inputs live in a per-sequence ring (a state slot). What the executors allocate is what the line declares,
and a replayed position (slot -1) writes nothing. The gates over these are tests/models/test_free_running_dsv4.py
and test_golden_dsv4.py."""
from __future__ import annotations

import json
import os

import numpy as np

from engine.model_config import ModelConfig
from engine.models.registry import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLASH = os.path.join(ROOT, "bench", "configs", "deepseek-v4-flash")


def test_v4_flash_rows_and_rings():
    """V4-Flash (head_dim 512, index_head_dim 128, 21 CSA layers of entries of 4, 20 HCA of 128, 2 sliding): a
    paged row of 512 + 512 + 128 = 1,152 values (the widest, CSA's; it was 3,072 with the compressor inputs in
    it) and a ring slot of the CSA layers' last 8 tokens' 2 · 2 · 512 + 2 · 2 · 128 inputs and the HCA layers'
    last 128 tokens' 2 · 512."""
    raw = json.load(open(os.path.join(FLASH, "config.json")))
    model = build_model(ModelConfig.from_file(FLASH))
    types, D, d = raw["layer_types"], raw["head_dim"], raw["index_head_dim"]
    csa, hca = types.count("compressed_sparse_attention"), types.count("heavily_compressed_attention")
    assert (csa, hca, len(types)) == (21, 20, 43)
    widths = {"compressed_sparse_attention": D + D + d, "heavily_compressed_attention": D + D,
              "sliding_attention": D}
    assert [s.row_width for s in model.attention_specs] == [widths[t] for t in types]
    layout = model.kv_layout()
    assert (layout.layers, layout.planes, layout.heads, layout.dim) == (43, 1, 1, 1152)
    assert layout.block_bytes(2) == 16 * 43 * 1152 * 2                   # 99,072 bf16 bytes a token (was 264,192)
    state = model.state_layout()
    assert {a.name: (a.layers, a.shape, a.dtype) for a in state.arrays} == {
        "csa_ring": (21, (8, 4 * D + 4 * d), "activation"), "hca_ring": (20, (128, 2 * D), "activation")}
    assert state.slot_bytes(2) == 21 * 8 * 2560 * 2 + 20 * 128 * 1024 * 2              # 5.8 MiB a sequence
    specs = [s for s in model.attention_specs if s.rate]
    assert [s.ring_index for s in specs if s.ring == "csa_ring"] == list(range(csa))
    assert [s.ring_index for s in specs if s.ring == "hca_ring"] == list(range(hca))


def test_executor_allocates_the_lines_rows_and_rings():
    """The numpy executor's pool row is the widest layer's row_width and its ops read one ring slot per
    max_num_seqs, shaped as state_layout declares (float32 on the CPU)."""
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    from engine.loader import load_model
    from harness.models import tiny_model_path

    model = load_model(tiny_model_path("deepseek_v4"))
    ex = CpuExecutor(model, options_of(num_kv_blocks=8, max_model_len=128, max_num_seqs=3))
    specs = model.model.attention_specs
    assert ex.kv.shape[-1] == max(s.row_width for s in specs) == 32 + 32 + 16
    want = model.model.state_layout().shapes(3)
    assert {k: v.shape for k, v in ex.ops.dsv4.state.items()} == want
    assert want == {"csa_ring": (1, 3, 8, 4 * 32 + 4 * 16), "hca_ring": (1, 3, 8, 2 * 32)}
    assert all(v.dtype == np.float32 for v in ex.ops.dsv4.state.values())


def test_no_compressed_layer_no_state():
    model = build_model(ModelConfig.from_file(FLASH))
    model.attention_specs = [s for s in model.attention_specs if not s.rate]
    assert model.state_layout() is None and model.replay_tokens(100) == 0


def test_a_replayed_position_writes_no_row():
    """write_rows skips slot -1 (numpy would write it at the pool's last slot) and writes the others."""
    from engine.executor.cpu_dsv4_attention import NumpyDSV4Ops

    kv = np.zeros((2, 1, 32, 1, 8), np.float32)
    NumpyDSV4Ops(kv).write_rows(1, np.array([-1, 5, -1, 7]), np.arange(1, 17, dtype=np.float32).reshape(4, 4), 2)
    assert not kv[0].any() and not kv[1, 0, -1].any()
    np.testing.assert_array_equal(kv[1, 0, [5, 7], 0], [[0, 0, 5, 6, 7, 8, 0, 0], [0, 0, 13, 14, 15, 16, 0, 0]])
    assert np.count_nonzero(kv) == 8

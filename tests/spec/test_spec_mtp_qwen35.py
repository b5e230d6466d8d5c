"""Qwen3.5's MTP module (--speculative-config method "mtp", vLLM's qwen3_5_mtp layout) on the numpy executor: tiny
random Qwen3.5 folders, text-only and composite, with one module at mtp.* (harness/mtp_models.py) load it with
the layout's shapes ((1 + w) norms stored as 1 + w, q_proj split into query and gate); the drafts the engine
proposes step after step (catch-up over verified tokens past rejected rows, the module applied recursively on
its normed output) equal a torch reference built on transformers' Qwen3.5 full-attention layer
(tests/mtp_reference.py); with the module drafting, every request generates exactly what it generates without
speculation (the Gated DeltaNet state holding the verify steps' drafts); a folder without the module is refused."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from mtp_reference import Qwen35MtpReference
from test_spec_mtp import check_drafts_equal_the_reference, check_generates_what_plain_decoding_generates, mtp_engine

from engine.loader import load_model
from engine.model_files import ModelLoadError
from engine.mtp import load_mtp_layer
from harness.hybrid_models import hybrid_model_path
from harness.models import _tmp_root
from harness.mtp_models import qwen35_mtp_shapes, write_qwen35_mtp_model

NAMES = ("qwen3_5_text", "qwen3_5")


@functools.cache
def mtp_path(name: str) -> str:
    return write_qwen35_mtp_model(name, os.path.join(_tmp_root(), f"mtp_{name}"), seed=5)


@pytest.mark.parametrize("name", NAMES)
def test_mtp_layer_loads_with_the_layout(name):
    from engine.loader.safetensors_io import SafetensorsCheckpoint
    folder = mtp_path(name)
    model = load_model(folder)
    c, L = model.config, model.config.num_hidden_layers
    layer = load_mtp_layer(folder, model.model)
    ckpt = SafetensorsCheckpoint(folder)
    assert layer.layer == L and not any(k.startswith(f"layers.{L}.") for k in model.weights)   # the target skips it
    for key, shape in qwen35_mtp_shapes(c.hidden_size).items():
        assert tuple(ckpt.get(key).shape) == shape
    for name_, key in (("mtp.enorm", "pre_fc_norm_embedding"), ("mtp.hnorm", "pre_fc_norm_hidden"), ("mtp.norm", "norm")):
        np.testing.assert_array_equal(np.asarray(layer.weights[name_]),
                                      1 + np.asarray(ckpt.get(f"mtp.{key}.weight"), np.float32))
    np.testing.assert_array_equal(np.asarray(layer.weights["mtp.eh_proj"], np.float32),
                                  np.asarray(ckpt.get("mtp.fc.weight"), np.float32))
    # its layer loads as the target's full-attention layers do (the query rows and the gate rows of q_proj apart)
    full = next(i for i, t in enumerate(model.model.types) if t == "full_attention")
    want = {k.split(".", 2)[2]: np.shape(v) for k, v in model.weights.items() if k.startswith(f"layers.{full}.")}
    assert {k.split(".", 2)[2]: np.shape(v) for k, v in layer.weights.items() if k.startswith(f"layers.{L}.")} == want
    head = model.weights["lm_head" if "lm_head" in model.weights else "embed_tokens"]
    np.testing.assert_array_equal(np.asarray(layer.weights["mtp.head"], np.float32), np.asarray(head, np.float32))


@pytest.mark.parametrize("name,k", [("qwen3_5_text", 3), ("qwen3_5", 2)])
def test_drafts_equal_the_torch_reference(name, k):
    check_drafts_equal_the_reference(mtp_path(name), k, Qwen35MtpReference, method="qwen3_5_mtp")


@pytest.mark.parametrize("batch,chunk", [(1, 512), pytest.param(5, 24, marks=pytest.mark.slow)])
def test_mtp_generates_what_plain_decoding_generates(batch, chunk):
    """With the Gated DeltaNet state holding each verify step's drafts."""
    check_generates_what_plain_decoding_generates(mtp_path("qwen3_5_text"), batch, chunk, method="qwen3_5_mtp")


def test_a_folder_without_the_module_is_refused():
    with pytest.raises(ModelLoadError, match=r"has no multi-token-prediction layer \(mtp_num_hidden_layers = 0; "
                                             r"mtp.fc.weight absent\)"):
        mtp_engine(hybrid_model_path("qwen3_5_text"))

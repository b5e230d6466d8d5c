"""MTP drafts (--speculative-config method "mtp") on the numpy executor: a tiny random DeepSeek-V3 folder with one
multi-token-prediction module in the reference layout (harness/mtp_models.py) loads with the layout's shapes (and
FP8 block-scaled); the drafts the engine proposes, step after step (catch-up over verified tokens, the module
applied recursively past its one layer, scratch KV of rejected drafts overwritten), equal a torch reference built
on transformers' DeepseekV3 decoder layer (tests/mtp_reference.py); with the module drafting, every request
generates exactly what it generates without speculation — one request, concurrent ones, chunked prefill,
preemption, prefix hits, aborts; and a folder or line without MTP layers is refused at start."""
from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from fake_executor import make_engine
from mtp_reference import MtpReference
from test_spec_eagle3 import Recording, assert_drafts_match, check_preemption_prefix_hits_and_aborts, run_drafting
from test_spec_engine import assert_same

from engine.loader import load_model
from engine.model_files import ModelLoadError
from engine.mtp import load_mtp_layer
from engine.request import GenerateRequest, SamplingParams
from engine.speculative import SpeculativeConfig
from harness.models import _tmp_root, tiny_model_path
from harness.mtp_models import mtp_shapes, write_mtp_model


@functools.cache
def mtp_path(name: str = "deepseek_v3", **options) -> str:
    tag = "_".join(f"{k}{v}" for k, v in sorted(options.items()))
    return write_mtp_model(name, os.path.join(_tmp_root(), f"mtp_{name}{tag}"), seed=3, **options)


def mtp_engine(folder: str, k: int = 3, **config):
    from engine.executor.cpu import CpuExecutor
    from engine.executor.options import options_of
    model = load_model(folder)
    ex = CpuExecutor(model, options_of(num_kv_blocks=config.pop("num_kv_blocks", 64), max_model_len=512,
                                       num_speculative_tokens=k))
    method = config.pop("method", "deepseek_mtp")
    return make_engine(ex, model.tokenizer, max_model_len=512,
                       speculative_config=SpeculativeConfig.from_dict({"method": method,
                                                                        "num_speculative_tokens": k}), **config)


def requests(n: int, seed: int, max_tokens: int = 16, sampled: bool = True) -> list[GenerateRequest]:
    """Random prompts of different lengths; greedy, and seeded sampling on every third where `sampled`."""
    rng = np.random.default_rng(seed)
    return [GenerateRequest(f"r{i}", [int(t) for t in rng.integers(100, 30000, 5 + 4 * i)],
                            SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=max_tokens, ignore_eos=True,
                                           logprobs=1) if sampled and i % 3 == 2 else
                            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=2))
            for i in range(n)]


def run_mtp(folder, reqs, speculation: bool = True, waves: int = 1, steer_from=None, k: int = 3, **config):
    """test_spec_eagle3's run_drafting with the MTP layer drafting (steer_from: so that drafts are accepted, a random
    layer's rarely are; without it the layer's own drafts are verified, and recorded too)."""
    engine = mtp_engine(folder, k, **config)
    if speculation and steer_from is None:
        engine.speculator.proposer = Recording(engine.speculator.proposer)
    return run_drafting(engine, reqs, speculation, waves, steer_from)


def test_mtp_layer_loads_with_the_reference_shapes():
    from engine.loader.safetensors_io import SafetensorsCheckpoint
    folder = mtp_path()
    model = load_model(folder)
    c = model.config
    L = c.num_hidden_layers
    layer = load_mtp_layer(folder, model.model)
    ckpt = SafetensorsCheckpoint(folder)
    assert layer.layer == L and not any(k.startswith(f"layers.{L}.") for k in model.weights)   # the target skips it
    for short, shape in mtp_shapes(c.hidden_size, c.vocab_size).items():
        assert tuple(ckpt.get(f"model.layers.{L}.{short}").shape) == shape
    for name, short in (("mtp.enorm", "enorm"), ("mtp.hnorm", "hnorm"), ("mtp.eh_proj", "eh_proj"),
                        ("mtp.norm", "shared_head.norm"), ("mtp.head", "shared_head.head")):
        np.testing.assert_array_equal(np.asarray(layer.weights[name], np.float32),
                                      np.asarray(ckpt.get(f"model.layers.{L}.{short}.weight"), np.float32))
    # its block loads as the target's MoE layers do (routed experts, router bias, shared experts), from layer L
    moe = {k.split(".", 2)[2] for k in model.weights if k.startswith("layers.1.")}
    assert {k.split(".", 2)[2] for k in layer.weights if k.startswith(f"layers.{L}.")} == moe
    bias = ckpt.get(f"model.layers.{L}.mlp.gate.e_score_correction_bias")
    np.testing.assert_array_equal(np.asarray(layer.weights[f"layers.{L}.router_bias"], np.float32),
                                  np.asarray(bias, np.float32))
    # no shared_head.head: the target's lm_head drafts
    plain = mtp_path(ship_head=False)
    np.testing.assert_array_equal(np.asarray(load_mtp_layer(plain, load_model(plain).model).weights["mtp.head"]),
                                  np.asarray(SafetensorsCheckpoint(plain).get("lm_head.weight")))


def test_quantized_checkpoints_mtp_layer_loads_dequantized():
    """FP8 block scales (DeepSeek-V3's: eh_proj, the block's projections and experts) within e4m3's rounding, and
    the generation with it as without speculation; compressed-tensors int4 experts (Kimi-K2-Thinking's, on the
    Kimi-K2 shape) exactly as their dequantized reference."""
    from harness.quantized import fp8_folder, int4_experts_folder
    folder = mtp_path()
    fp8 = fp8_folder(folder, os.path.join(_tmp_root(), "mtp_fp8"), block=(16, 16))
    model = load_model(fp8)
    L = model.config.num_hidden_layers
    want, got = load_mtp_layer(folder, load_model(folder).model), load_mtp_layer(fp8, model.model)
    for name in ("mtp.eh_proj", f"layers.{L}.q_b_proj", f"layers.{L}.experts_down_proj"):
        a, b = np.asarray(want.weights[name], np.float32), np.asarray(got.weights[name], np.float32)
        assert a.shape == b.shape and np.abs(a - b).max() <= 0.07 * np.abs(a).max()     # e4m3: 3 mantissa bits
        assert not np.array_equal(a, b)
    off, _ = run_mtp(fp8, requests(2, seed=9, max_tokens=8), speculation=False)
    on, _ = run_mtp(fp8, requests(2, seed=9, max_tokens=8))
    assert_same(off, on)
    int4, plain = int4_experts_folder(mtp_path("kimi_k2"), os.path.join(_tmp_root(), "mtp_int4"),
                                      os.path.join(_tmp_root(), "mtp_int4_ref"), group=32)
    got, want = (load_mtp_layer(f, load_model(f).model) for f in (int4, plain))
    for name in (f"layers.{L}.experts_gate_up_proj", f"layers.{L}.experts_down_proj"):
        np.testing.assert_array_equal(np.asarray(got.weights[name], np.float32),
                                      np.asarray(want.weights[name], np.float32))


def check_drafts_equal_the_reference(folder: str, k: int, reference, **config) -> None:
    """Greedy requests run together in chunks, the verified drafts steered so some are accepted; each proposal the
    module made equals the reference's drafts after the same tokens (a near tie, margin < 1e-3, may go either
    way)."""
    reqs = requests(3, seed=1, max_tokens=12, sampled=False)
    off, _ = run_mtp(folder, reqs, speculation=False, max_num_batched_tokens=16, **config)
    on, engine = run_mtp(folder, reqs, steer_from=off, k=k, max_num_batched_tokens=16, **config)
    assert_same(off, on)
    assert engine.speculator.counters.num_accepted_tokens >= 5
    assert_drafts_match(engine.speculator.proposer.calls, reference(folder))


def check_generates_what_plain_decoding_generates(folder: str, batch: int, chunk: int, **config) -> None:
    """One request, or several together in chunks (greedy and seeded sampling): the module's own drafts, and
    steered ones."""
    reqs = requests(batch, seed=4, max_tokens=20)
    off, _ = run_mtp(folder, reqs, speculation=False, max_num_batched_tokens=chunk, **config)
    on, engine = run_mtp(folder, reqs, max_num_batched_tokens=chunk, **config)
    assert_same(off, on)
    assert engine.speculator.counters.num_draft_tokens > 20 * batch
    steered, engine = run_mtp(folder, reqs, steer_from=off, max_num_batched_tokens=chunk, **config)
    assert_same(off, steered)
    c = engine.speculator.counters
    assert c.num_draft_tokens > c.num_accepted_tokens > 5 * batch


@pytest.mark.parametrize("name,k", [("deepseek_v3", 3), ("kimi_k2", 2)])
def test_drafts_equal_the_torch_reference(name, k):
    check_drafts_equal_the_reference(mtp_path(name), k, MtpReference)


@pytest.mark.parametrize("batch,chunk", [(1, 512), pytest.param(5, 24, marks=pytest.mark.slow)])
def test_mtp_generates_what_plain_decoding_generates(batch, chunk):
    check_generates_what_plain_decoding_generates(mtp_path(), batch, chunk)


@pytest.mark.slow
def test_preemption_prefix_hits_and_aborts():
    """As test_spec_eagle3's; the aborted request's KV blocks back in the layer's pool."""
    engine = check_preemption_prefix_hits_and_aborts(lambda **config: mtp_engine(mtp_path(), **config),
                                                     requests(5, seed=5, max_tokens=32), num_kv_blocks=10)
    pool = engine.speculator.draft_states.pool
    assert len(pool.free) == pool.kv.shape[2] // 16


def test_folders_and_lines_without_mtp_layers_are_refused():
    from engine.executor.base import ExecutorBase
    from engine.loader.safetensors_io import SafetensorsCheckpoint, save_safetensors
    from engine.speculative import check_speculation
    with pytest.raises(ModelLoadError, match=r"has no multi-token-prediction layer \(num_nextn_predict_layers = 0"):
        mtp_engine(tiny_model_path("deepseek_v3"))
    with pytest.raises(ValueError, match="this model is 'qwen3', which the engine runs no MTP layers of"):
        mtp_engine(tiny_model_path("qwen3_tied"))
    folder = write_mtp_model("deepseek_v3", os.path.join(_tmp_root(), "mtp_bad"), seed=3)
    ckpt = SafetensorsCheckpoint(folder)
    tensors = {n: np.array(ckpt.get(n)) for n in ckpt.keys()}
    for change, message in ((lambda t: t.pop("model.layers.3.hnorm.weight"), "missing tensor 'model.layers.3.hnorm"),
                            (lambda t: t.update({"model.layers.3.eh_proj.weight": t["model.layers.3.eh_proj.weight"][
                                :, :64]}), "model.layers.3.eh_proj.weight")):
        bad = dict(tensors)
        change(bad)
        save_safetensors(os.path.join(folder, "model.safetensors"), bad)
        with pytest.raises(ModelLoadError, match=message):
            load_mtp_layer(folder, load_model(folder).model)

    class VerifiesOnly(ExecutorBase):
        supports_draft_verify = True
    with pytest.raises(ValueError, match="VerifiesOnly does not run multi-token-prediction layers"):
        check_speculation(SpeculativeConfig("mtp", 2), VerifiesOnly())


def test_the_gpu_is_refused_before_the_model_loads(monkeypatch):
    """The GPU executors run no MTP layer yet: refused at start, before the model is read."""
    from engine import loader
    from engine.config import EngineConfig
    from engine.executor import factory
    from engine.executor.gpu import GpuExecutor
    from engine.handle import EngineHandle
    monkeypatch.setattr(factory, "gpu_available", lambda: True)
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    config = EngineConfig(model="/nonexistent", device="auto", speculative_config=SpeculativeConfig("mtp", 2))
    with pytest.raises(ValueError, match="method 'mtp' .* drafts on the numpy executor only"):
        EngineHandle(config)
    assert not GpuExecutor.supports_mtp

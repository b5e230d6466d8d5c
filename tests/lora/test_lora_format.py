"""PEFT adapter folders: what is read (every pair in its packed site's slice, scaled) and what is refused,
each refusal naming the problem."""
from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

from engine.loader import load_model
from engine.loader.safetensors_io import SafetensorsCheckpoint, save_safetensors
from engine.lora import MODULES, LoRAError, check_lora_model, load_adapter, lora_sites, parse_lora_modules
from engine.models.registry import build_model
from harness.lora import tiny_adapter_path
from harness.models import tiny_model_path

MODEL = "qwen3_tied"


@pytest.fixture(scope="module")
def sites():
    return lora_sites(build_model(load_model(tiny_model_path(MODEL)).config))


def copy_adapter(tmp_path, adapter: str = "mixed16", model: str = MODEL) -> str:
    out = str(tmp_path / f"{model}-{adapter}")
    shutil.copytree(tiny_adapter_path(model, adapter), out)
    return out


def edit_config(folder: str, **changes) -> None:
    path = os.path.join(folder, "adapter_config.json")
    cfg = json.load(open(path))
    cfg.update(changes)
    json.dump(cfg, open(path, "w"))


def edit_tensors(folder: str, fn) -> None:
    path = os.path.join(folder, "adapter_model.safetensors")
    ckpt = SafetensorsCheckpoint(folder)
    tensors = {k: np.array(ckpt.get(k)) for k in ckpt.keys()}
    del ckpt
    fn(tensors)
    save_safetensors(path, tensors)


def read(folder: str, sites, max_rank: int = 16):
    return load_adapter("ad", folder, sites, 2, max_rank)


def test_sites_are_the_packed_projections(sites):
    assert sorted(sites) == sorted(f"layers.{i}.{p}" for i in range(2)
                                   for p in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    assert sites["layers.0.qkv_proj"].slices == (128, 64, 64) and sites["layers.0.qkv_proj"].k == 64
    assert sites["layers.1.gate_up_proj"].slices == (96, 96) and sites["layers.1.down_proj"].k == 96


def test_pairs_land_in_their_slices_scaled(sites):
    folder = tiny_adapter_path(MODEL, "mixed16")             # q, v, up, down: k and gate left alone
    ad = read(folder, sites)
    cfg = json.load(open(os.path.join(folder, "adapter_config.json")))
    assert (ad.rank, ad.scaling) == (16, cfg["lora_alpha"] / 16)
    assert ad.modules == ("down_proj", "q_proj", "up_proj", "v_proj")
    ckpt = SafetensorsCheckpoint(folder)
    key = "base_model.model.model.layers.1.self_attn.{}.lora_{}.weight"
    qkv = ad.sites["layers.1.qkv_proj"]
    np.testing.assert_array_equal(qkv.a[0], ckpt.get(key.format("q_proj", "A")))
    np.testing.assert_array_equal(qkv.a[2], ckpt.get(key.format("v_proj", "A")))
    assert not qkv.a[1].any() and not qkv.b[128:192].any()          # k: untouched
    np.testing.assert_allclose(qkv.b[192:], ckpt.get(key.format("v_proj", "B")) * ad.scaling, rtol=1e-6)
    gate_up = ad.sites["layers.1.gate_up_proj"]
    assert not gate_up.b[:96].any() and gate_up.b[96:].any()
    assert "layers.0.o_proj" not in ad.sites


def test_rslora_scales_by_the_root_of_the_rank(sites):
    ad = read(tiny_adapter_path(MODEL, "mlp4_rs"), sites)
    assert ad.scaling == pytest.approx(8 / math.sqrt(4))


@pytest.mark.parametrize("mutate,words", [
    (lambda f: os.remove(os.path.join(f, "adapter_config.json")), "missing file .*adapter_config.json"),
    (lambda f: os.remove(os.path.join(f, "adapter_model.safetensors")), "missing file .*adapter_model.safetensors"),
    (lambda f: edit_config(f, r=32), "rank 32 is over --max-lora-rank 16"),
    (lambda f: edit_config(f, target_modules=["q_proj", "lm_head"]), "target module 'lm_head'"),
    (lambda f: edit_config(f, use_dora=True), "use_dora"),
    (lambda f: edit_config(f, rank_pattern={"q_proj": 32}), r"rank 32 \(rank_pattern\['q_proj'\]\) is over --max-lora-rank 16"),
    (lambda f: edit_config(f, rank_pattern={"v_proj": 4}), r"shape mismatch: layer 0 v_proj.lora_A has shape \(16, 64\), "
                                                            r"expected \(4, 64\) \(rank 4"),
    (lambda f: edit_config(f, alpha_pattern={"q_proj(": 2}), r"alpha_pattern key 'q_proj\(' is not a valid regular"),
    (lambda f: edit_config(f, alpha_pattern={"q_proj": "big"}), r"alpha_pattern\['q_proj'\] must be a number"),
    (lambda f: edit_config(f, peft_type="IA3"), "peft_type 'IA3'"),
    (lambda f: open(os.path.join(f, "adapter_config.json"), "w").write("{oops"), "not valid JSON"),
    (lambda f: edit_tensors(f, lambda t: t.update({"base_model.model.model.embed_tokens.lora_A.weight":
                                                    np.zeros((16, 8), np.float32)})), "target 'embed_tokens'"),
    (lambda f: edit_tensors(f, lambda t: t.update({
        k.replace("layers.1.", "layers.7."): v for k, v in list(t.items()) if "layers.1." in k})),
     "layer 7 is beyond the model's 2 layers"),
    (lambda f: edit_tensors(f, lambda t: t.pop("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight")),
     "layer 0 up_proj has no lora_B"),
    (lambda f: edit_tensors(f, lambda t: t.update({"base_model.model.model.layers.0.mlp.up_proj.lora_B.weight":
                                                    np.zeros((95, 16), np.float32)})),
     r"shape mismatch: layer 0 up_proj.lora_B has shape \(95, 16\), expected \(96, 16\)"),
])
def test_bad_adapters_are_refused_naming_the_problem(tmp_path, sites, mutate, words):
    folder = copy_adapter(tmp_path)
    mutate(folder)
    with pytest.raises(LoRAError, match=words) as err:
        read(folder, sites)
    assert err.value.status == 400 and "'ad'" in str(err.value)


def test_an_adapter_of_another_model_is_a_shape_mismatch(tmp_path, sites):
    with pytest.raises(LoRAError, match="shape mismatch"):
        read(tiny_adapter_path("llama", "attn8"), sites)          # llama's q_proj is 64 x 64, qwen3_tied's 128 x 64


def test_missing_folder(sites, tmp_path):
    with pytest.raises(LoRAError, match="is not a folder"):
        read(str(tmp_path / "nowhere"), sites)


def test_lora_modules_parse_both_forms():
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y", "base_model_name": "m"}']) == (
        ("a", "/x"), ("b", "/y"))
    for bad in ("nopath", "=/x", "a=", '{"name": "b"}'):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_modules([bad])


def test_lines_without_lora_support_are_refused():
    check_lora_model("qwen3")
    for model_type in ("qwen3_moe", "deepseek_v2"):
        with pytest.raises(ValueError, match="has no LoRA support"):
            check_lora_model(model_type)


def test_the_benchmarks_adapters_load(tmp_path, sites):
    """bench/lora.py writes its random adapters in PEFT's format: all 7 projections of every layer."""
    from bench.lora import write_random_adapter

    folder = write_random_adapter(load_model(tiny_model_path(MODEL)), str(tmp_path / "bench"), rank=16, seed=0)
    ad = read(folder, sites)
    assert ad.modules == tuple(sorted(MODULES)) and len(ad.sites) == 8 and ad.scaling == 2.0


Q_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
GOOD_ENTRY = {"dtype": "F32", "shape": [16, 64], "data_offsets": [0, 16 * 64 * 4]}


def write_raw(folder: str, header: bytes, data: bytes = b"", length: int | None = None) -> str:
    """adapter_model.safetensors as given: an 8-byte length (the header's own unless `length`), header, data."""
    import struct
    path = os.path.join(folder, "adapter_model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


@pytest.mark.parametrize("header,data,length,words", [
    (json.dumps([GOOD_ENTRY]).encode(), b"", None, "the safetensors header is a JSON list, not an object"),
    (json.dumps({Q_A: {"dtype": "F32", "shape": [16, 64]}}).encode(), bytes(4096), None,
     r"tensor '.*q_proj.lora_A.weight': 'data_offsets' None is not \[begin, end\]"),
    (json.dumps({Q_A: [0, 4096]}).encode(), bytes(4096), None, "its entry is a JSON list, not an object"),
    (json.dumps({Q_A: "F32"}).encode(), b"", None, "its entry is a JSON str, not an object"),
    (json.dumps({Q_A: GOOD_ENTRY}).encode(), bytes(100), None,
     r"'data_offsets' \[0, 4096\] is not \[begin, end\] within the file's 100 data bytes"),
    (json.dumps({Q_A: {**GOOD_ENTRY, "data_offsets": [4096, 0]}}).encode(), bytes(4096), None, "'data_offsets'"),
    (json.dumps({Q_A: {**GOOD_ENTRY, "data_offsets": [0, 4000]}}).encode(), bytes(4096), None,
     r"span 4000 bytes; shape \[16, 64\] of F32 is 4096"),
    (json.dumps({Q_A: {**GOOD_ENTRY, "shape": [16, "64"]}}).encode(), bytes(4096), None,
     "'shape' .* is not a list of non-negative integers"),
    (json.dumps({Q_A: {**GOOD_ENTRY, "dtype": 7}}).encode(), bytes(4096), None, "'dtype' 7 is not a string"),
    (json.dumps({Q_A: GOOD_ENTRY}).encode(), b"", 10_000, "header of 10000 bytes in a file of"),
    (b"[" * 100_000 + b"]" * 100_000, b"", None, "the safetensors header is not valid JSON"),
    (b"{\"a\": \xff}", b"", None, "the safetensors header is not valid JSON"),
])
def test_malformed_safetensors_are_refused_naming_the_file(tmp_path, sites, header, data, length, words):
    """A header that is not safetensors' (the reader must check it before indexing the data) is a 400
    naming the file and what is wrong, never an exception of another kind out of the reader."""
    folder = copy_adapter(tmp_path)
    path = write_raw(folder, header, data, length)
    with pytest.raises(LoRAError, match=words) as err:
        read(folder, sites)
    assert err.value.status == 400 and path in str(err.value) and "'ad'" in str(err.value)

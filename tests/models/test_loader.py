"""Loading HF folders (single / sharded, bf16 / fp16 / fp32), the errors bad folders give, and
GGUF conversion (names, Q/K un-permute, config, tokenizer, cache)."""
from __future__ import annotations

import json
import os
import shutil

import ml_dtypes
import numpy as np
import pytest

from engine.batch import ModelBatch, SeqStep
from engine.executor.cpu import CpuExecutor
from engine.executor.factory import create_executor
from engine.executor.options import options_of
from engine.loader import load_model
from engine.loader.gguf_convert import convert_gguf, gguf_folder_for, hf_tensor_name, unpermute_qk
from engine.loader.safetensors_io import SafetensorsCheckpoint, save_safetensors
from engine.model_config import ModelConfig
from engine.model_files import ModelLoadError
from harness.models import (TINY_MODELS, build_config_model, build_tiny_model, hf_logits, qwen_tokenizer_dir,
                            tiny_model_path)


def copy_folder(src: str, dst: str, dtype=None, shards: int = 1, drop: str | None = None,
                reshape: tuple[str, tuple] | None = None) -> str:
    """Copy an HF folder, rewriting its weights in `dtype`, split into `shards` files."""
    shutil.copytree(src, dst)
    ckpt = SafetensorsCheckpoint(src)
    tensors = {n: np.array(ckpt.get(n)) for n in ckpt.keys() if n != drop}
    if dtype is not None:
        tensors = {n: a.astype(np.float32).astype(dtype) for n, a in tensors.items()}
    if reshape:
        tensors[reshape[0]] = np.zeros(reshape[1], dtype=tensors[reshape[0]].dtype)
    os.remove(os.path.join(dst, "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for k in range(shards):
        part = names[k::shards]
        fname = "model.safetensors" if shards == 1 else f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
        save_safetensors(os.path.join(dst, fname), {n: tensors[n] for n in part})
        weight_map.update({n: fname for n in part})
    if shards > 1:
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def logits_of(model) -> np.ndarray:
    ex = CpuExecutor(model, options_of(num_kv_blocks=4, max_model_len=64))
    ids = model.tokenizer.encode("Loading weights the same way every time.")
    return ex.forward_logits(ModelBatch.build([SeqStep(0, ids, 0, [0, 1], False)]))


def test_loaded_model_fields():
    m = load_model(tiny_model_path("qwen3_tied"))
    assert m.config.model_type == "qwen3" and m.config.head_dim == 32
    assert m.weights["embed_tokens"].dtype == ml_dtypes.bfloat16          # stored dtype kept
    assert "lm_head" not in m.weights                                     # tied: no copy
    c = m.config
    assert m.weights["layers.0.qkv_proj"].shape == ((c.num_attention_heads + 2 * c.num_key_value_heads)
                                                    * c.head_dim, c.hidden_size)
    assert m.weights["layers.1.gate_up_proj"].shape == (2 * c.intermediate_size, c.hidden_size)
    assert m.generation_config["eos_token_id"] and m.tokenizer.eos_token_ids
    assert os.path.samefile(m.path, tiny_model_path("qwen3_tied"))


@pytest.mark.parametrize("dtype,shards", [(np.float32, 1), (np.float16, 3), (ml_dtypes.bfloat16, 2)])
def test_dtypes_and_shards_load_the_same_model(tmp_path, dtype, shards):
    src = tiny_model_path("qwen3_untied")
    folder = copy_folder(src, str(tmp_path / "m"), dtype=dtype, shards=shards)
    m = load_model(folder)
    assert m.weights["layers.0.down_proj"].dtype == np.dtype(dtype)
    ref = logits_of(load_model(src))
    np.testing.assert_allclose(logits_of(m), ref, rtol=0, atol=1e-3 if dtype == np.float16 else 1e-5)


def test_missing_tensor_is_named(tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    folder = copy_folder(tiny_model_path("qwen3_tied"), str(tmp_path / "m"), drop=name)
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")) as e:
        load_model(folder)
    assert folder in str(e.value)


def test_shape_mismatch_names_tensor_and_both_shapes(tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    folder = copy_folder(tiny_model_path("llama"), str(tmp_path / "m"), reshape=(name, (95, 64)))
    with pytest.raises(ValueError) as e:
        load_model(folder)
    assert name in str(e.value) and "(95, 64)" in str(e.value) and "(96, 64)" in str(e.value)


@pytest.mark.parametrize("missing,match", [("config.json", "config"), ("tokenizer.json", "tokenizer.json"),
                                           ("model.safetensors", "safetensors")])
def test_missing_files(tmp_path, missing, match):
    folder = str(tmp_path / "m")
    shutil.copytree(tiny_model_path("qwen2"), folder)
    os.remove(os.path.join(folder, missing))
    with pytest.raises(FileNotFoundError, match=match):
        load_model(folder)


def test_bad_paths_and_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        load_model(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_model(str(tmp_path / "nope.gguf"))
    with pytest.raises(ValueError, match="'mamba'"):
        ModelConfig.from_dict({"model_type": "mamba"})
    with pytest.raises(ValueError, match="intermediate_size"):
        ModelConfig.from_dict({"model_type": "llama", "hidden_size": 8, "num_hidden_layers": 1,
                               "num_attention_heads": 2, "vocab_size": 10})
    cfg = ModelConfig.from_dict({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "intermediate_size": 8, "vocab_size": 10})
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4
    with pytest.raises(ValueError, match="device"):
        create_executor(load_model(tiny_model_path("qwen2")), options_of(), device="tpu")


@pytest.mark.parametrize("window,context,served", [(4096, 32768, False), (None, 32768, True), (32768, 32768, True),
                                                   (8192, None, True), (2048, None, False)])
def test_a_mistral_window_shorter_than_its_context_is_refused(window, context, served):
    """Mistral-7B v0.1 attends to 4096 tokens of 32768: full attention within the window, wrong beyond it."""
    d = {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
         "intermediate_size": 8, "vocab_size": 10, "sliding_window": window, "max_position_embeddings": context}
    if served:
        assert ModelConfig.from_dict(d).max_position_embeddings == (context or 4096)
    else:
        with pytest.raises(ValueError, match=f"sliding_window {window} is shorter than max_position_embeddings"):
            ModelConfig.from_dict(d)


def test_a_mistral_window_that_changes_transformers_logits_is_refused_at_load(tmp_path):
    """Past its window, transformers' Mistral differs from full attention (what the engine computes): refused."""
    cls_name, base = TINY_MODELS["mistral"]
    window = build_config_model(cls_name, {**base, "sliding_window": 8}, str(tmp_path / "window"), vocab=256)
    full = build_config_model(cls_name, {**base, "sliding_window": None}, str(tmp_path / "full"), vocab=256)
    ids = list(range(1, 21))
    assert np.abs(hf_logits(window, ids)[12:] - hf_logits(full, ids)[12:]).max() > 1e-2
    np.testing.assert_allclose(hf_logits(window, ids)[:8], hf_logits(full, ids)[:8], atol=1e-5)
    with pytest.raises(ModelLoadError, match="sliding_window 8 is shorter than max_position_embeddings 512"):
        load_model(window)
    assert load_model(full).config.model_type == "mistral"


def test_factory_auto_falls_back_to_cpu():
    ex = create_executor(load_model(tiny_model_path("qwen2")), options_of(num_kv_blocks=8, max_model_len=64), device="auto")
    from engine.executor.factory import gpu_available
    assert gpu_available() or isinstance(ex, CpuExecutor)
    assert ex.num_kv_blocks == 8 and ex.vocab_size > 0


# --- GGUF ---------------------------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's rotary permutation of q/k rows (the definition)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_inverts_llama_cpp_permute():
    w = np.random.default_rng(0).standard_normal((4 * 16, 24)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(w, 4), 4), w)
    assert not np.array_equal(llama_cpp_permute(w, 4), w)


def test_tensor_names():
    assert hf_tensor_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_tensor_name("blk.0.attn_k_norm.weight") == "model.layers.0.self_attn.k_norm.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_tensor_name("blk.0.ssm_a")


def write_gguf(src: str, path: str, arch: str) -> None:
    """Write an HF folder as a GGUF file the way llama.cpp does (F32; Q/K rows permuted for llama)."""
    import gguf
    cfg = ModelConfig.from_file(src)
    tok = json.load(open(os.path.join(src, "tokenizer.json"), encoding="utf-8"))
    vocab = dict(tok["model"]["vocab"])
    for t in tok["added_tokens"]:
        vocab[t["content"]] = t["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_vocab_size(cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|endoftext|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    ckpt = SafetensorsCheckpoint(src)
    inverse = {hf_tensor_name(g): g for g in
               ["token_embd.weight", "output_norm.weight", "output.weight"]
               + [f"blk.{i}.{k}.weight" for i in range(cfg.num_hidden_layers) for k in
                  ("attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                   "ffn_gate", "ffn_up", "ffn_down", "attn_q_norm", "attn_k_norm")]}
    for name in ckpt.keys():
        a = np.asarray(ckpt.get(name), dtype=np.float32)
        g = inverse[name]
        if arch == "llama" and ".attn_q." in g:
            a = llama_cpp_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".attn_k." in g:
            a = llama_cpp_permute(a, cfg.num_key_value_heads)
        w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.skipif(qwen_tokenizer_dir() is None, reason="needs the Qwen tokenizer (shared/models)")
@pytest.mark.slow
@pytest.mark.parametrize("arch,tiny", [("llama", "llama"), ("qwen3", "qwen3_tied")])
def test_gguf_round_trip(tmp_path, arch, tiny):
    """HF folder -> GGUF (llama.cpp layout) -> engine conversion gives back the same weights,
    config and tokenizer (llama: permuted Q/K; qwen3: q/k norms, head_dim != hidden/heads, tied)."""
    src = build_tiny_model(tiny, str(tmp_path / "hf"), seed=7, rope_scaling=None)
    gguf_path = str(tmp_path / "tiny.gguf")
    write_gguf(src, gguf_path, arch)
    folder = convert_gguf(gguf_path, out_dir=str(tmp_path / "converted"), progress=False)
    a, b = load_model(src), load_model(folder)
    for key in ("model_type", "num_key_value_heads", "head_dim", "tie_word_embeddings", "vocab_size"):
        assert getattr(b.config, key) == getattr(a.config, key), key
    for name, w in a.weights.items():
        np.testing.assert_array_equal(np.asarray(b.weights[name], np.float32), np.asarray(w, np.float32),
                                      err_msg=name)
    texts = ["Hello world, 1234 apples!", "  spaces\n\nand\ttabs", "naïve café — 日本語 🚀", "<|im_start|>user"]
    for t in texts:
        assert b.tokenizer.encode(t) == a.tokenizer.encode(t), t
    assert b.tokenizer.eos_token_ids == [a.tokenizer.token_to_id("<|im_end|>")]
    chat = b.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_gguf_conversion_is_cached(monkeypatch, tmp_path):
    from engine.loader.demo import demo_gguf_path, demo_model_path
    folder = demo_model_path()
    stamp = os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns
    assert convert_gguf(demo_gguf_path(), out_dir=folder) == folder
    assert demo_model_path() == folder
    assert os.stat(os.path.join(folder, "model.safetensors")).st_mtime_ns == stamp
    monkeypatch.setenv("OPENINFER_CACHE", str(tmp_path))
    assert gguf_folder_for(demo_gguf_path()).startswith(str(tmp_path))


def test_demo_model_config():
    from engine.loader.demo import demo_model_path
    m = load_model(demo_model_path())
    c = m.config
    assert (c.model_type, c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
            c.num_key_value_heads, c.vocab_size, c.tie_word_embeddings) == ("llama", 576, 30, 9, 3, 49152, True)
    assert m.tokenizer.chat_template and m.tokenizer.eos_token_ids == [m.tokenizer.token_to_id("<|im_end|>")]

"""Convert a GGUF file, once, into a cached Hugging Face folder (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that `load_hf_folder` reads.

Quantized tensors are dequantized with the `gguf` package to float32; float tensors keep their
type. Llama-architecture Q/K weights are un-permuted (llama.cpp permutes them for its rotary
layout). The folder goes under $OPENINFER_CACHE (default ~/.cache/openinfer)/gguf/.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys

import ml_dtypes
import numpy as np

from engine.env import cache_root
from engine.loader.gguf_tokenizer import build_tokenizer
from engine.loader.safetensors_io import save_safetensors
from engine.model_config import ModelConfig
from engine.model_files import ModelLoadError

CONVERTER_VERSION = 2
TEMP_MARK = ".tmp"                      # a conversion writes <folder>.tmp<pid>, then renames it <folder>
SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")

_TENSOR_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(name: str) -> str:
    """GGUF tensor name -> HF checkpoint name (e.g. blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _TENSOR_NAMES:
        return f"model.layers.{m.group(1)}.{_TENSOR_NAMES[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's rotary permutation of q_proj / k_proj rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _required(reader, key: str):
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata {key!r} is missing")
    return value


def _config(reader, arch: str, tensor_names: set[str], vocab_size: int) -> dict:
    g = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    need = lambda key: int(_required(reader, f"{arch}.{key}"))  # noqa: E731
    hidden, heads = need("embedding_length"), need("attention.head_count")
    rope_scaling = None
    if g("rope.scaling.type") in ("linear", "yarn"):
        rope_scaling = {"rope_type": g("rope.scaling.type"), "factor": float(g("rope.scaling.factor"))}
        if g("rope.scaling.original_context_length"):
            rope_scaling["original_max_position_embeddings"] = int(g("rope.scaling.original_context_length"))
    cfg = {
        "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                           "qwen3": "Qwen3ForCausalLM"}[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads if heads > 0 else 0)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(g("context_length", 4096)),
        "vocab_size": vocab_size,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    return cfg


def _tensor_array(t) -> np.ndarray:
    from gguf import GGMLQuantizationType, quants
    kind = t.tensor_type
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        return np.asarray(t.data)
    a = quants.dequantize(t.data, kind)
    return a.astype(ml_dtypes.bfloat16) if kind == GGMLQuantizationType.BF16 else a.astype(np.float32)


def gguf_folder_for(gguf_path: str) -> str:
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|v{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{digest}")


def convert_gguf(gguf_path: str, out_dir: str | None = None, progress: bool = True) -> str:
    """Return an HF folder for `gguf_path`, converting it on first use (cached). The folder is written
    under a temporary name and renamed when complete; temporary folders a killed conversion left are
    removed first. ModelLoadError naming the file for a damaged or unsupported GGUF."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    out_dir = out_dir or gguf_folder_for(gguf_path)
    remove_stale_temps(out_dir)
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    reader = _open(gguf_path)
    try:
        cfg, tokenizer, tok_config, tensors = _convert(reader, gguf_path, progress)
    except ModelLoadError:
        raise
    except ValueError as e:                 # unsupported content, or the gguf package on damaged data
        raise ModelLoadError(f"{gguf_path}: cannot convert: {e}") from None
    except (TypeError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{gguf_path}: damaged GGUF file ({type(e).__name__}: {e})") from None
    tmp = f"{out_dir}{TEMP_MARK}{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        os.makedirs(tmp)
        gen = {"bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
               "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id")}
        for name, obj in (("config.json", cfg), ("tokenizer_config.json", tok_config),
                          ("generation_config.json", {k: v for k, v in gen.items() if v is not None})):
            with open(os.path.join(tmp, name), "w", encoding="utf-8") as f:
                json.dump(obj, f, indent=2, ensure_ascii=False)
        tokenizer.save(os.path.join(tmp, "tokenizer.json"))
        save_safetensors(os.path.join(tmp, "model.safetensors"), tensors)
        os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
        _publish(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)       # gone once renamed; what an error or Ctrl-C left
    return out_dir


def _open(gguf_path: str):
    """A GGUFReader over the file, its tensors checked to lie within it."""
    from gguf import GGUFReader
    try:
        reader = GGUFReader(gguf_path)
    except Exception as e:               # the gguf package raises ValueError, IndexError, ... on damaged files
        raise ModelLoadError(f"{gguf_path}: not a readable GGUF file, or a truncated one "
                             f"({type(e).__name__}: {e})") from None
    size = os.path.getsize(gguf_path)
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
            raise ModelLoadError(f"{gguf_path}: truncated: tensor {t.name!r} ends at byte "
                                 f"{t.data_offset + t.n_bytes}, the file has {size}")
    return reader


def _convert(reader, gguf_path: str, progress: bool):
    """(config.json dict, tokenizer, tokenizer_config dict, HF-named tensors) of an open GGUF."""
    from tqdm import tqdm

    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"{gguf_path}: unsupported GGUF architecture {arch!r}; "
                             f"supported: {', '.join(SUPPORTED_ARCHS)}")
    tok_meta = {k[len("tokenizer."):]: _field(reader, k) for k in reader.fields if k.startswith("tokenizer.")}
    tokenizer, tok_config = build_tokenizer(tok_meta)
    names = {t.name for t in reader.tensors}
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if embd is None:
        raise ModelLoadError(f"{gguf_path}: no token_embd.weight tensor")
    vocab_size = int(_field(reader, f"{arch}.vocab_size", 0) or int(embd.shape[-1]))
    cfg = _config(reader, arch, names, vocab_size)
    ModelConfig.from_dict(cfg)              # sizes checked before any tensor is reshaped by them

    tensors: dict[str, np.ndarray] = {}
    bar = tqdm(reader.tensors, desc=f"converting {os.path.basename(gguf_path)}", unit="tensor",
               disable=not progress, file=sys.stderr)
    for t in bar:
        a = _tensor_array(t)
        if arch == "llama" and ".attn_q." in t.name:
            a = unpermute_qk(a, cfg["num_attention_heads"])
        elif arch == "llama" and ".attn_k." in t.name:
            a = unpermute_qk(a, cfg["num_key_value_heads"])
        tensors[hf_tensor_name(t.name)] = a
    dtypes = {a.dtype for n, a in tensors.items() if a.ndim == 2}
    cfg["torch_dtype"] = "bfloat16" if dtypes == {np.dtype(ml_dtypes.bfloat16)} else (
        "float16" if dtypes == {np.dtype(np.float16)} else "float32")
    return cfg, tokenizer, tok_config, tensors


def _publish(tmp: str, out_dir: str) -> None:
    """Rename the complete folder tmp to out_dir (atomic: a folder at out_dir is always complete)."""
    try:
        os.rename(tmp, out_dir)
    except OSError:
        if not os.path.isfile(os.path.join(out_dir, "model.safetensors")):
            raise                       # (else another process converted it meanwhile)


def remove_stale_temps(out_dir: str) -> None:
    """Remove the temporary folders of conversions into out_dir whose process is gone (killed midway)."""
    parent, stem = os.path.split(os.path.abspath(out_dir))
    try:
        entries = os.listdir(parent)
    except OSError:
        return
    for entry in entries:
        head, mark, pid = entry.rpartition(TEMP_MARK)
        if mark and head == stem and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return False                    # this process is not converting it now: a leftover of an earlier one
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True                     # another user's live process
    return True

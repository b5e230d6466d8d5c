"""Model helpers shared by the tests and the benchmarks (not part of the engine: they need torch and
transformers): tiny random-weight Hugging Face model folders (built with transformers, saved in bf16
with the real Qwen tokenizer), real-shape folders with random bf16 weights, the transformers float32
oracle, and an engine driver that feeds sequences through the paged KV cache in any chunking.

    from harness.models import TINY_MODELS, tiny_model_path, hf_logits, engine_logits

`tiny_model_path(name)` builds a folder once per test process (cached) under a temp dir.
"""
from __future__ import annotations

import atexit
import functools
import os
import random
import shutil
import tempfile
from dataclasses import dataclass

import numpy as np

from engine.batch import BLOCK_SIZE, ModelBatch, SeqStep

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The engine (numpy float32) against transformers float32 on the same bf16 weights: a float32 summation-order
# difference. Measured max |dlogprob| 8.5e-6 over 48 greedy tokens of 4 prompts of qwen3_tied (2026-11-30) and
# 2.3e-5 on a batch of prompts' prompt logprobs once decode-size steps ran BLAS on one thread (2026-12-06): the
# bound is ~2x that.
F32_LOGPROB_TOL = 5e-5


def qwen_tokenizer_dir() -> str | None:
    """The real Qwen tokenizer folder (shared/models/qwen-tokenizer, inside or beside the checkout,
    or $OPENINFER_TEST_TOKENIZER), if there is one."""
    candidates = [os.environ.get("OPENINFER_TEST_TOKENIZER", ""),
                  os.path.join(_REPO, "shared", "models", "qwen-tokenizer"),
                  os.path.join(os.path.dirname(_REPO), "shared", "models", "qwen-tokenizer"),
                  "/work/shared/models/qwen-tokenizer"]
    return next((c for c in candidates if c and os.path.isfile(os.path.join(c, "tokenizer.json"))), None)


@functools.lru_cache(maxsize=None)
def tokenizer_source() -> tuple[str, int, int, int]:
    """(folder with tokenizer.json, vocab rows, bos id, eos id): the real Qwen tokenizer when it is
    present, else the demo model's (SmolLM2) tokenizer. vocab rows >= the tokenizer's size, so
    every encoded id is a valid row."""
    from tokenizers import Tokenizer
    folder = qwen_tokenizer_dir()
    if folder is None:
        from engine.loader.demo import demo_model_path
        folder = demo_model_path()
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    size = tok.get_vocab_size(with_added_tokens=True)
    bos = tok.token_to_id("<|endoftext|>")
    eos = tok.token_to_id("<|im_end|>")
    return folder, -(-size // 128) * 128, bos, eos


_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=512,
             rms_norm_eps=1e-6)

# name -> (transformers config class name, config overrides)
TINY_MODELS: dict[str, tuple[str, dict]] = {
    # head_dim 32 != hidden / heads (16); GQA 2; tied lm_head
    "qwen3_tied": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       tie_word_embeddings=True, rope_theta=10000.0)),
    # GQA 1 (MHA); untied lm_head
    "qwen3_untied": ("Qwen3Config", dict(num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                         tie_word_embeddings=False, rope_theta=1000000.0)),
    # GQA 4; yarn rope scaling
    "qwen3_gqa4": ("Qwen3Config", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                                       tie_word_embeddings=False, rope_theta=10000.0,
                                       rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 128})),
    # llama3 rope scaling, GQA 2
    "llama": ("LlamaConfig", dict(num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=False, rope_theta=500000.0,
                                  rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64})),
    # qkv bias, tied
    "qwen2": ("Qwen2Config", dict(num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True, rope_theta=10000.0)),
    # head_dim 32 != hidden / heads (16, as Mistral-Nemo's); GQA 2; untied; a window as long as the context
    "mistral": ("MistralConfig", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      sliding_window=512, tie_word_embeddings=False, rope_theta=1000000.0)),
}

# The MoE and MLA lines (tests/models/test_golden_moe.py): experts not a power of two, top-k > 1, dense and
# MoE layers mixed, rope dim != nope dim != v dim, q_lora_rank None and set, group-limited routing.
SPARSE_MODELS: dict[str, tuple[str, dict]] = {
    # layer 0 dense (mlp_only_layers), layers 1-2 MoE: 6 experts, top-3 renormalized; GQA 2, head_dim 32
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, num_experts=6, num_experts_per_tok=3,
                                         moe_intermediate_size=40, norm_topk_prob=True, decoder_sparse_step=1,
                                         mlp_only_layers=[0], tie_word_embeddings=False, rope_theta=1000000.0)),
    # V2-Lite shape: q_proj (no q_lora_rank), greedy top-2 of 6 experts x 1.5 + 1 shared expert, first layer
    # dense; yarn with mscale != mscale_all_dim (cos / sin and the softmax scale both scaled)
    "deepseek_v2_lite": ("DeepseekV2Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20, n_routed_experts=6, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=24, first_k_dense_replace=1, topk_method="greedy",
        routed_scaling_factor=1.5, tie_word_embeddings=False, rope_theta=10000.0,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8})),
    # V2 shape: q_lora_rank set; group-limited top-3 of 6 experts in 3 groups (best 2 groups), 2 shared
    "deepseek_v2": ("DeepseekV2Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=6, num_experts_per_tok=3,
        n_shared_experts=2, moe_intermediate_size=16, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=3, topk_group=2, routed_scaling_factor=1.0, tie_word_embeddings=False, rope_theta=10000.0)),
}

# The DeepSeek-V3 line (tests/models/test_golden_dsv3.py): sigmoid routing with a random score correction bias,
# q LoRA, one shared expert, a dense first layer, yarn as Kimi-K2's config has it.
DSV3_MODELS: dict[str, tuple[str, dict]] = {
    # group-limited: 8 experts in 4 groups (best 2 groups by their top-2 sums), top-3 renormalized x 2.5
    "deepseek_v3": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3,
        n_shared_experts=1, moe_intermediate_size=16, first_k_dense_replace=1, n_group=4, topk_group=2,
        norm_topk_prob=True, routed_scaling_factor=2.5, num_nextn_predict_layers=0, tie_word_embeddings=False,
        rope_theta=10000.0)),
    # Kimi-K2 shape: one group, 6 experts top-3 renormalized x 2.827, yarn (beta 1 / 1, mscale 1 / 1)
    "kimi_k2": ("DeepseekV3Config", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=40, kv_lora_rank=32,
        qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=20, n_routed_experts=6, num_experts_per_tok=3,
        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.827, num_nextn_predict_layers=0, tie_word_embeddings=False,
        rope_theta=50000.0, rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 16,
                                          "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})),
}

# DeepSeek-V4 (tests/models/test_golden_dsv4.py): one layer of each attention kind (sliding, compressed sparse with the
# indexer's top-3 of entries of 4 tokens, heavily compressed in entries of 8), the first MLP hash-routed, 3
# hyper-connection streams, a window of 6 tokens, swiglu_limit low enough to clamp.
DSV4_MODELS: dict[str, tuple[str, dict]] = {
    "deepseek_v4": ("DeepseekV4Config", dict(
        num_hidden_layers=3, num_attention_heads=4, head_dim=32, q_lora_rank=48, partial_rotary_factor=0.25,
        num_experts_per_tok=2, n_routed_experts=6, moe_intermediate_size=16, hc_mult=3, sliding_window=6,
        o_groups=2, o_lora_rank=16, index_n_heads=4, index_head_dim=16, index_topk=3, swiglu_limit=1.0,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        mlp_layer_types=["hash_moe", "moe", "moe"], routed_scaling_factor=1.5, tie_word_embeddings=False,
        num_nextn_predict_layers=0)),
}

_TMP: list[str] = []


def _tmp_root() -> str:
    if not _TMP:
        _TMP.append(tempfile.mkdtemp(prefix="openinfer-tiny-"))
        atexit.register(shutil.rmtree, _TMP[0], True)
    return _TMP[0]


def randomize_(model, seed: int) -> None:
    """Weights with a real spread (transformers' 0.02 init makes every logit nearly equal):
    matrices ~ N(0, 1/fan_in), norms ~ 1 + N(0, 0.2), biases ~ N(0, 0.5), embeddings ~ N(0, 1)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.ndim >= 2:                      # [N, K], or stacked experts [E, N, K]
                p.copy_(torch.randn(p.shape, generator=g) * (1.5 / p.shape[-1] ** 0.5))
            elif "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if "e_score_correction_bias" in name:         # DeepSeek-V3's router bias: ~ the spread of its scores
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):                # DeepSeek-V4's hash routing: distinct experts per token
                experts = torch.rand(b.shape[0], model.config.n_routed_experts, generator=g).argsort(-1)
                b.copy_(experts[:, :b.shape[1]])


def tiny_model_type(name: str) -> str:
    """The model_type of tiny model `name` (its transformers config class says it), without building it."""
    import transformers
    cls_name, _ = {**TINY_MODELS, **SPARSE_MODELS, **DSV3_MODELS, **DSV4_MODELS}[name]
    return getattr(transformers, cls_name).model_type


def build_tiny_model(name: str, out_dir: str, seed: int = 0, **overrides) -> str:
    """Save a random-weight model `name` of TINY_MODELS, SPARSE_MODELS or DSV3_MODELS as an HF folder (bf16) with a
    real tokenizer."""
    cls_name, base = {**TINY_MODELS, **SPARSE_MODELS, **DSV3_MODELS, **DSV4_MODELS}[name]
    return build_config_model(cls_name, {**base, **overrides}, out_dir, seed)


def build_config_model(cls_name: str, overrides: dict, out_dir: str, seed: int = 0, vocab: int | None = None) -> str:
    """Save a random-weight model of transformers config class `cls_name` (the tiny base, then `overrides`) as an HF
    folder (bf16) with a real tokenizer; vocab: embedding rows (None: the tokenizer's; fewer keep the tokenizer's
    first ids, for gates that run many steps)."""
    import torch
    import transformers
    _, rows, bos, eos = tokenizer_source()
    vocab = vocab or rows
    config = getattr(transformers, cls_name)(**{**_BASE, **overrides}, vocab_size=vocab,
                                             bos_token_id=in_vocab(bos, vocab), eos_token_id=in_vocab(eos, vocab))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    randomize_(model, seed)
    return save_tiny(model, out_dir)


def in_vocab(token: int, vocab: int) -> int | None:
    """A special token's id where the embedding has its row, else None."""
    return token if token < vocab else None


def save_tiny(model, out_dir: str) -> str:
    """Save a random-weight transformers model as an HF folder in bf16, with the real tokenizer and a
    generation config that stops at its eos and bos."""
    import torch
    import transformers
    folder, _, bos, eos = tokenizer_source()
    model.to(torch.bfloat16).save_pretrained(out_dir, safe_serialization=True)
    transformers.GenerationConfig(bos_token_id=bos, eos_token_id=[eos, bos]).save_pretrained(out_dir)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if os.path.isfile(os.path.join(folder, f)):
            shutil.copy(os.path.join(folder, f), out_dir)
    return out_dir


@functools.lru_cache(maxsize=None)
def tiny_model_path(name: str) -> str:
    """The folder of tiny model `name`, built once per process."""
    return build_tiny_model(name, os.path.join(_tmp_root(), name))


@functools.lru_cache(maxsize=4)
def hf_model(path: str, gguf_file: str | None = None):
    """transformers float32 oracle (eager attention), cached."""
    import torch
    from transformers import AutoModelForCausalLM
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 **kwargs)
    return model.eval()


def hf_logits(path: str, ids: list[int], gguf_file: str | None = None) -> np.ndarray:
    """float32 logits [T, V] of one sequence from transformers."""
    import torch
    with torch.no_grad():
        out = hf_model(path, gguf_file)(torch.tensor([ids])).logits[0]
    return out.float().numpy()


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return (x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))).astype(np.float32)


def engine_logits(executor, seqs: list[list[int]], chunks: list | int | None = None,
                  prefill: list | int | None = None, seed: int = 0,
                  lora_slots: list[int | None] | None = None) -> list[np.ndarray]:
    """Teacher-force `seqs` through `executor` together: each step feeds every unfinished sequence
    its next chunk. Per sequence (a list, or one value for all): the first step feeds `prefill`
    tokens, later steps `chunks` tokens (None: everything left; 1: decode one token a step).
    KV blocks come from a shuffled pool, so sequences interleave in the cache; sequence i keeps its
    state (linear-attention lines) in state slot i. lora_slots: per sequence, the executor's LoRA slot
    it runs with (None: the base model).
    Returns float32 logits [len(seq), V] per sequence."""
    n = len(seqs)
    sizes = chunks if isinstance(chunks, list) else [chunks] * n
    firsts = prefill if isinstance(prefill, list) else [prefill] * n
    rng = random.Random(seed)
    free = list(range(executor.num_kv_blocks))
    rng.shuffle(free)
    tables = []
    for s in seqs:
        need = -(-len(s) // BLOCK_SIZE)
        tables.append([free.pop() for _ in range(need)])
    done = [0] * n
    outs: list[list[np.ndarray]] = [[] for _ in range(n)]
    while any(done[i] < len(seqs[i]) for i in range(n)):
        steps, who = [], []
        for i, s in enumerate(seqs):
            if done[i] >= len(s):
                continue
            k = sizes[i] if done[i] else (firsts[i] or sizes[i])
            k = len(s) - done[i] if k is None else k
            toks = s[done[i]:done[i] + k]
            slot = lora_slots[i] if lora_slots else None
            steps.append(SeqStep(seq_id=i, token_ids=toks, start_pos=done[i], block_table=tables[i],
                                 sample=False, state_slot=i, lora_id=0 if slot is None else slot + 1))
            who.append((i, len(toks)))
        slots = {s + 1: s for s in lora_slots if s is not None} if lora_slots else {}
        logits = executor.forward_logits(ModelBatch.build(steps, slots or None))
        row = 0
        for i, k in who:
            outs[i].append(logits[row:row + k])
            done[i] += k
            row += k
    return [np.concatenate(o, axis=0) for o in outs]


@dataclass
class GateResult:
    """Engine vs oracle on teacher-forced positions."""
    positions: int
    argmax_agreement: float          # fraction of positions whose argmax matches the oracle's
    max_abs_dlogprob: float          # over the full vocabulary of every position
    mean_abs_dlogprob: float
    p99_abs_dlogprob: float

    def failures(self, max_dlogprob: float = 1e-3) -> list[str]:
        out = []
        if self.argmax_agreement < 1.0:
            out.append(f"argmax agreement {self.argmax_agreement:.4f} < 1")
        if not self.max_abs_dlogprob <= max_dlogprob:
            out.append(f"max |dlogprob| {self.max_abs_dlogprob:.3g} > {max_dlogprob:g}")
        return out


def compare_logits(engine: np.ndarray, oracle: np.ndarray) -> GateResult:
    if engine.shape != oracle.shape:
        raise AssertionError(f"logits shape {engine.shape} != oracle {oracle.shape}")
    a, b = log_softmax(engine), log_softmax(oracle)
    d = np.abs(a - b)
    return GateResult(
        positions=int(a.shape[0]),
        argmax_agreement=float(np.mean(a.argmax(-1) == b.argmax(-1))),
        max_abs_dlogprob=float(d.max()),
        mean_abs_dlogprob=float(d.mean()),
        p99_abs_dlogprob=float(np.percentile(d, 99)),
    )


def test_prompts(tokenizer, count: int = 4) -> list[list[int]]:
    """Token sequences of mixed lengths (5 to ~40 tokens, crossing 16-token block boundaries)."""
    texts = [
        "Hello world",
        "The quick brown fox jumps over the lazy dog while the cat watches from the window sill.",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))",
        "Über den Wolken muss die Freiheit wohl grenzenlos sein — 自由 🚀 and more text to be long.",
        "One two three four five six seven eight nine ten eleven twelve thirteen fourteen.",
    ]
    return [tokenizer.encode(t) for t in texts[:count]]


test_prompts.__test__ = False  # not a pytest test


def random_sequences(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


def write_random_qwen3(config_path: str, out_dir: str, seed: int = 0, embed_std: float = 0.06):
    """An HF folder of a real-shape model (any transformers config: Qwen3, Qwen3-MoE, DeepSeek-V2) with
    random bf16 weights (written on the GPU): matrices and stacked experts ~ N(0, 1/fan_in), norms
    ~ 1 + N(0, 0.1), embedding ~ N(0, embed_std) (logit spread ~3 like a real model). Returns the bf16
    model on the GPU. Reuses out_dir when already complete."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(os.path.dirname(config_path))
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2 and "embed" in name:
                p.normal_(0.0, embed_std)
            elif p.ndim >= 2:
                p.normal_(0.0, p.shape[-1] ** -0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.1)
    done = os.path.join(out_dir, ".complete")
    if not os.path.exists(done):
        model.save_pretrained(out_dir, safe_serialization=True)
        folder = tokenizer_source()[0]
        for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if os.path.isfile(os.path.join(folder, f)):
                shutil.copy(os.path.join(folder, f), out_dir)
        open(done, "w").close()
    return model.eval()

"""DeepSeek-V4's mechanisms (engine/executor/cpu_dsv4_ops.py, the sqrtsoftplus router of cpu_moe_ops), each
against transformers' own module for it on random weights (float32): the hyper-connections (pre / post /
Sinkhorn comb, the collapse, the layer's merge, the final head), the experts' clamped SwiGLU, the top-k and
hash routers, and a sliding-window layer's whole attention (q LoRA, the shared K = V head of head_dim,
partial interleaved rope on the trailing dims, sinks, the output rope undone, the grouped output
projection). Each check is also shown to fail when the mechanism is done the plain way."""
from __future__ import annotations

import numpy as np
import pytest

from engine.executor import cpu_dsv4_ops as v4
from engine.executor.cpu_moe_ops import route_topk
from engine.models.ops import RouteSpec

torch = pytest.importorskip("torch")
T, D, N = 11, 64, 3


@pytest.fixture(scope="module")
def config():
    from transformers import DeepseekV4Config

    cfg = DeepseekV4Config(vocab_size=100, hidden_size=D, moe_intermediate_size=16, num_hidden_layers=2,
                           num_attention_heads=4, head_dim=32, q_lora_rank=48, partial_rotary_factor=0.25,
                           num_experts_per_tok=2, n_routed_experts=6, hc_mult=N, hc_sinkhorn_iters=20,
                           sliding_window=5, o_groups=2, o_lora_rank=16, swiglu_limit=0.7,
                           routed_scaling_factor=1.5, layer_types=["sliding_attention"] * 2,
                           mlp_layer_types=["hash_moe", "moe"])
    cfg._attn_implementation = "eager"
    return cfg


def randomized(module, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(module.named_parameters()) + list(module.named_buffers()):
            if p.dtype.is_floating_point:
                std = 1.0 if p.ndim < 2 else 1.5 / p.shape[-1] ** 0.5
                p.copy_((1.0 if "norm" in name else 0.0) + std * torch.randn(p.shape, generator=g))
    return module.eval()


def f32(t) -> np.ndarray:
    return t.detach().float().numpy()


def test_hyper_connection_and_merge(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection
    hc = randomized(DeepseekV4HyperConnection(config), 0)
    streams = torch.randn(1, T, N, D, generator=torch.Generator().manual_seed(1))
    post, comb, collapsed = hc(streams)
    args = (f32(hc.fn), f32(hc.base), f32(hc.scale), config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
    p, c, x = v4.hyper_connection(f32(streams[0]), *args)
    np.testing.assert_allclose(p, f32(post[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c, f32(comb[0]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(x, f32(collapsed[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(c.sum(-2), 1, atol=1e-5)                    # doubly stochastic
    np.testing.assert_allclose(c.sum(-1), 1, atol=1e-3)
    one = v4.hyper_connection(f32(streams[0]), *args[:3], 1, *args[4:])[1]
    assert not np.allclose(one, c, atol=1e-3)                              # the Sinkhorn iterations matter
    out = torch.randn(1, T, D, generator=torch.Generator().manual_seed(2))
    want = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)   # the layer's
    got = v4.hc_merge(f32(out[0]), f32(streams[0]), p, c)
    np.testing.assert_allclose(got, f32(want[0]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(v4.hc_merge(f32(out[0]), f32(streams[0]), p, c.transpose(0, 2, 1)), got, atol=1e-3)


def test_hyper_head(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead
    head = randomized(DeepseekV4HyperHead(config), 3)
    streams = torch.randn(1, T, N, D, generator=torch.Generator().manual_seed(4))
    got = v4.hyper_head(f32(streams[0]), f32(head.hc_fn), f32(head.hc_base), float(head.hc_scale.detach()),
                        config.hc_eps, config.rms_norm_eps)
    np.testing.assert_allclose(got, f32(head(streams)[0]), rtol=1e-5, atol=1e-5)


def test_swiglu_limit(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Experts
    experts = DeepseekV4Experts(config)
    gate_up = 2 * torch.randn(T, 32, generator=torch.Generator().manual_seed(5))
    got = v4.swiglu_limited(f32(gate_up), config.swiglu_limit)
    np.testing.assert_allclose(got, f32(experts._apply_gate(gate_up)), rtol=1e-6, atol=1e-6)
    assert not np.allclose(got, v4.swiglu_limited(f32(gate_up), 1e9), atol=1e-2)


def test_sqrtsoftplus_router_with_its_bias(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter
    router = randomized(DeepseekV4TopKRouter(config), 6)
    with torch.no_grad():
        router.e_score_correction_bias.copy_(0.3 * torch.randn(6, generator=torch.Generator().manual_seed(7)))
    x = torch.randn(T, D, generator=torch.Generator().manual_seed(8))
    logits, weights, ids = router(x)
    spec = RouteSpec(num_experts=6, top_k=2, renormalize=True, scale=1.5, scoring="sqrtsoftplus")
    w, i = route_topk(f32(logits), spec, f32(router.e_score_correction_bias))
    order = np.argsort(ids.numpy(), -1)
    np.testing.assert_array_equal(np.sort(i, -1), np.take_along_axis(ids.numpy(), order, -1))
    np.testing.assert_allclose(np.take_along_axis(w, np.argsort(i, -1), -1),
                               np.take_along_axis(f32(weights), order, -1), rtol=1e-5)
    assert not np.array_equal(np.sort(route_topk(f32(logits), spec)[1], -1), np.sort(i, -1))


def test_hash_router(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter
    router = randomized(DeepseekV4HashRouter(config), 9)
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        router.tid2eid.copy_(torch.stack([torch.randperm(6, generator=g)[:2] for _ in range(100)]))
    x, input_ids = torch.randn(T, D, generator=g), torch.randint(0, 100, (1, T), generator=g)
    logits, weights, ids = router(x, input_ids)
    w, i = v4.hash_route(f32(logits), router.tid2eid.numpy(), input_ids.numpy()[0], 1.5)
    np.testing.assert_array_equal(i, ids.numpy())
    np.testing.assert_allclose(w, f32(weights), rtol=1e-5)


def rope_tables(config, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r = int(config.head_dim * config.partial_rotary_factor)
    inv = 1.0 / (config.rope_theta ** (np.arange(0, r, 2, dtype=np.float32) / r))
    ang = positions[:, None].astype(np.float32) * inv.astype(np.float32)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def numpy_sliding_attention(att, config, x: np.ndarray, positions: np.ndarray, window: int) -> np.ndarray:
    H, Dh, eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
    cos, sin = rope_tables(config, positions)
    q_res = v4.rms(x @ f32(att.q_a_proj.weight).T, eps, f32(att.q_a_norm.weight))
    q = v4.rope_trailing(v4.rms((q_res @ f32(att.q_b_proj.weight).T).reshape(-1, H, Dh), eps), cos, sin)
    kv = v4.rope_trailing(v4.rms(x @ f32(att.kv_proj.weight).T, eps, f32(att.kv_norm.weight))[:, None], cos, sin)[:, 0]
    o = v4.sliding_mqa_attention(q, kv, positions, positions, window, f32(att.sinks), Dh ** -0.5)
    o = v4.rope_trailing(o, cos, -sin).reshape(len(x), H * Dh)
    return v4.grouped_linear(o, f32(att.o_a_proj.weight), config.o_groups) @ f32(att.o_b_proj.weight).T


def test_sliding_window_shared_kv_attention(config):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention, DeepseekV4RotaryEmbedding
    att = randomized(DeepseekV4Attention(config, 0), 11)
    x = torch.randn(1, T, D, generator=torch.Generator().manual_seed(12))
    pos = torch.arange(T)[None]
    rope = DeepseekV4RotaryEmbedding(config)
    emb = {k: rope(x, pos, layer_type=k) for k in ("main", "compress")}
    d = pos[0][:, None] - pos[0][None, :]
    mask = torch.where((d >= 0) & (d < config.sliding_window), 0.0, float("-inf"))[None, None]
    with torch.no_grad():
        want = att(x, position_embeddings=emb, position_ids=pos, attention_mask=mask)[0][0].numpy()
    got = numpy_sliding_attention(att, config, f32(x[0]), np.arange(T), config.sliding_window)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not np.allclose(numpy_sliding_attention(att, config, f32(x[0]), np.arange(T), 10 ** 6), want, atol=1e-3)

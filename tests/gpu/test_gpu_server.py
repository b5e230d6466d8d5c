"""End to end on the GPU: the real engine (GpuExecutor) behind the real server, a streaming
completion over HTTP. Oracle: transformers float32 greedy on the same weights, on the same GPU."""
from __future__ import annotations

import json

import httpx
import pytest

from harness.models import tiny_model_path

pytestmark = pytest.mark.gpu
MODEL = "qwen3_tied"


def test_streaming_completion_on_gpu_matches_transformers_greedy():
    import torch
    from transformers import AutoModelForCausalLM

    from engine.config import EngineConfig
    from engine.handle import EngineHandle
    from engine.loader import load_model
    from server.app import create_app
    from server.background import BackgroundServer

    path = tiny_model_path(MODEL)
    handle = EngineHandle(EngineConfig(model=path, device="cuda", max_model_len=512, num_kv_blocks=256,
                                       max_num_seqs=16))
    assert type(handle.executor).__name__ == "GpuExecutor"
    prompt = "The capital of France is"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True,
            "ignore_eos": True}
    text, chunks, finish = "", 0, None
    try:
        with BackgroundServer(create_app(handle)) as srv:
            with httpx.stream("POST", srv.url + "/v1/completions", json=body, timeout=120) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"]
                    if choice:
                        text += choice[0]["text"]
                        finish = choice[0].get("finish_reason") or finish
                        chunks += 1
            plain = httpx.post(srv.url + "/v1/completions", json={**body, "stream": False}, timeout=120).json()
    finally:
        handle.shutdown()
    assert chunks >= 2 and finish == "length"
    assert plain["choices"][0]["text"] == text

    tok = load_model(path).tokenizer
    ids = tok.encode(prompt)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(24):      # plain greedy, no stop tokens (the request sets ignore_eos)
            seq.append(int(hf(torch.tensor([seq], device="cuda")).logits[0, -1].argmax()))
    expected = tok.decode(seq[len(ids):], skip_special_tokens=True)
    print(f"GPU server streamed {chunks} chunks: {text!r}")
    assert text == expected

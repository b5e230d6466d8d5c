"""Speculative decoding through the real server: `openinfer serve --speculative-config` (ngram, the engine in its
own process) answers completions and chats — streamed or not, with logprobs, stop strings, max_tokens, several
requests at once — exactly as a server without speculation on the same model does, and /metrics reports vLLM's
spec_decode counters (absent without speculation)."""
from __future__ import annotations

import concurrent.futures
import json
import re
import subprocess

import httpx
import pytest
from test_server_cli import OPENINFER, ROOT, free_port, interrupt, wait_healthy

from engine.config import EngineConfig
from engine.handle import EngineHandle
from harness.models import tiny_model_path
from server.app import create_app
from server.background import BackgroundServer

pytestmark = pytest.mark.slow

MODEL = "qwen3_tied"
# logprobs: a verify step computes its rows as one chunk, plain decoding one row a step: float32 rounding,
# measured max |dlogprob| 2.3e-5 on these requests (logprobs down to -12); the bound is 2x that
LOGPROB_TOL = 5e-5
SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
ARGS = dict(max_model_len=256, num_kv_blocks=128)


@pytest.fixture(scope="module")
def servers():
    """(url with speculation, url without) over the same tiny model."""
    port = free_port()
    proc = subprocess.Popen(OPENINFER + ["serve", "--model", tiny_model_path(MODEL), "--device", "cpu", "--port",
                                         str(port), "--served-model-name", MODEL, "--max-model-len", "256",
                                         "--num-kv-blocks", "128", "--speculative-config", SPEC],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    handle = EngineHandle(EngineConfig(model=tiny_model_path(MODEL), device="cpu", served_model_name=MODEL, **ARGS))
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc)
        with BackgroundServer(create_app(handle)) as plain:
            yield url, plain.url
    finally:
        interrupt(proc)
        handle.shutdown()


def strip(body: dict) -> dict:
    """A response without what differs between any two responses (ids, times)."""
    return {k: v for k, v in body.items() if k not in ("id", "created", "system_fingerprint")}


def same(a, b) -> bool:
    """Equal JSON, floats (logprobs) within LOGPROB_TOL."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= LOGPROB_TOL
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return strip(r.json())


def stream(url: str, route: str, body: dict) -> list[dict]:
    chunks = []
    with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def text_of(chunks: list[dict]) -> str:
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


BODIES = [
    {"prompt": "one two three one two three one two three", "max_tokens": 40, "temperature": 0, "logprobs": 2},
    {"prompt": "a b a b a b a b", "max_tokens": 30, "temperature": 0.8, "top_p": 0.9, "seed": 7, "logprobs": 1},
    {"prompt": "red green blue red green blue red", "max_tokens": 25, "temperature": 0, "ignore_eos": True},
]


def test_completions_equal_the_server_without_speculation(servers):
    spec, plain = servers
    for body in BODIES:
        body = {"model": MODEL, **body}
        assert same(post(spec, "/v1/completions", body), post(plain, "/v1/completions", body))
        assert text_of(stream(spec, "/v1/completions", body)) == text_of(stream(plain, "/v1/completions", body))
    full = post(plain, "/v1/completions", {"model": MODEL, **BODIES[2]})["choices"][0]["text"]
    stop = {"model": MODEL, **BODIES[2], "stop": [full[8:11]]}           # a stop string inside the output
    got = post(spec, "/v1/completions", stop)
    assert same(got, post(plain, "/v1/completions", stop)) and got["choices"][0]["finish_reason"] == "stop"


def test_concurrent_requests_and_chat(servers):
    spec, plain = servers
    bodies = [{"model": MODEL, **b, "n": 2 if i % 2 else 1} for i, b in enumerate(BODIES * 3)]
    with concurrent.futures.ThreadPoolExecutor(9) as pool:
        got = list(pool.map(lambda b: post(spec, "/v1/completions", b), bodies))
    assert same(got, [post(plain, "/v1/completions", b) for b in bodies])
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "repeat: la la la la la la"}],
            "max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2}
    assert same(post(spec, "/v1/chat/completions", chat), post(plain, "/v1/chat/completions", chat))


def test_metrics_report_the_spec_decode_counters(servers):
    spec, plain = servers
    post(spec, "/v1/completions", {"model": MODEL, **BODIES[0]})
    text = httpx.get(spec + "/metrics").text
    values = {m[0]: float(m[1]) for m in re.findall(r"^(openinfer_spec_decode_\S+) (\S+)$", text, re.MULTILINE)}
    drafts = values["openinfer_spec_decode_num_drafts_total"]
    draft_tokens = values["openinfer_spec_decode_num_draft_tokens_total"]
    accepted = values["openinfer_spec_decode_num_accepted_tokens_total"]
    per_pos = [values[f'openinfer_spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}}'] for i in range(4)]
    assert 0 < accepted <= draft_tokens <= 4 * drafts and sum(per_pos) == accepted
    assert "# TYPE openinfer_spec_decode_num_drafts_total counter" in text
    assert "spec_decode" not in httpx.get(plain + "/metrics").text

"""LoRA over HTTP (vLLM's interface) on the real engine (CPU, tiny Qwen3, PEFT adapters): the request's
`model` picks an adapter, /v1/models lists adapters with their parent, adapters load and unload at run
time behind the API key, bad adapters are refused with a 4xx naming the problem while the server goes
on serving, and an unload waits for the requests that use the adapter."""
from __future__ import annotations

import asyncio
import json
import os
import shutil

import httpx
import numpy as np
import openai
import pytest

from engine.config import EngineConfig
from engine.handle import EngineHandle
from harness.lora import hf_lora_logits, tiny_adapter_path
from harness.models import hf_logits, tiny_model_path
from server.app import create_app
from server.background import BackgroundServer

MODEL, KEY = "qwen3_tied", "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    h = EngineHandle(EngineConfig(model=tiny_model_path(MODEL), device="cpu", max_model_len=512, num_kv_blocks=128,
                                  enable_lora=True, max_loras=2, progress=False,
                                  lora_modules=(("attn8", tiny_adapter_path(MODEL, "attn8")),)))
    with BackgroundServer(create_app(h, api_key=KEY)) as srv:
        yield srv, h
    h.shutdown()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server[0].url, headers=AUTH, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0].url + "/v1", api_key=KEY, max_retries=0, timeout=60)


def greedy_oracle(prompt: list[int], adapter: str | None, steps: int) -> list[int]:
    path, ids = tiny_model_path(MODEL), list(prompt)
    for _ in range(steps):
        logits = hf_logits(path, ids) if adapter is None else hf_lora_logits(path, tiny_adapter_path(MODEL, adapter), ids)
        ids.append(int(np.argmax(logits[-1])))
    return ids[len(prompt):]


def complete_ids(client, model: str, prompt: list[int], n: int = 6):
    out = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    return out.model, [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


PROMPT = [(13 * j) % 4000 + 200 for j in range(19)]


def load(http, name: str, path: str):
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})


def test_models_lists_adapters_with_their_parent(http, server):
    base = server[1].model_name
    cards = {c["id"]: c for c in http.get("/v1/models").json()["data"]}
    assert set(cards) == {base, "attn8"}
    assert cards["attn8"]["parent"] == base and cards["attn8"]["root"] == tiny_adapter_path(MODEL, "attn8")
    assert http.get("/v1/models/attn8").json()["parent"] == base
    assert http.get("/v1/models/nope").status_code == 404


def test_the_model_field_picks_the_adapter(client, server):
    base = server[1].model_name
    assert complete_ids(client, "attn8", PROMPT) == ("attn8", greedy_oracle(PROMPT, "attn8", 6))
    assert complete_ids(client, base, PROMPT) == (base, greedy_oracle(PROMPT, None, 6))
    chat = client.chat.completions.create(model="attn8", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert chat.model == "attn8"
    with pytest.raises(openai.NotFoundError, match="'attn8'"):
        client.completions.create(model="nope", prompt="x", max_tokens=1)


def test_metrics_report_lora_requests_info(http, client):
    """/metrics carries vLLM's lora_requests_info (max_lora, running and waiting adapters' names) and the
    adapter counts; after a request the adapter is neither running nor waiting, and it was loaded once."""
    complete_ids(client, "attn8", PROMPT, 2)
    text = http.get("/metrics").text
    info = [line for line in text.splitlines() if line.startswith("openinfer_lora_requests_info{")]
    assert len(info) == 1, text
    labels, value = info[0].rsplit(" ", 1)
    assert 'max_lora="2"' in labels and 'running_lora_adapters=""' in labels and 'waiting_lora_adapters=""' in labels
    assert float(value) > 1.7e9
    gauges = {line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines()
              if line.startswith("openinfer_engine_lora_")}
    assert gauges["openinfer_engine_lora_adapters_loaded"] >= 1 and gauges["openinfer_engine_lora_slot_loads"] >= 1


def test_load_and_unload_at_run_time(http, client):
    assert load(http, "late", tiny_adapter_path(MODEL, "mixed16")).status_code == 200
    assert "late" in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert complete_ids(client, "late", PROMPT)[1] == greedy_oracle(PROMPT, "mixed16", 6)
    r = load(http, "late", tiny_adapter_path(MODEL, "attn8"))
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    r = http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": tiny_adapter_path(MODEL, "attn8"),
                                                 "load_inplace": True})
    assert r.status_code == 200 and complete_ids(client, "late", PROMPT)[1] == greedy_oracle(PROMPT, "attn8", 6)
    assert http.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": "/y",
                                                    "load_inplace": "yes"}).status_code == 422
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 200 and "late" in r.text
    assert "late" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt="x", max_tokens=1)
    r = http.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "lora_adapter_not_found"


def bad_copy(tmp_path, **config) -> str:
    folder = str(tmp_path / "bad")
    shutil.copytree(tiny_adapter_path(MODEL, "mixed16"), folder)
    cfg_path = os.path.join(folder, "adapter_config.json")
    json.dump({**json.load(open(cfg_path)), **config}, open(cfg_path, "w"))
    return folder


@pytest.mark.parametrize("make,words", [
    (lambda tmp: str(tmp / "missing"), "is not a folder"),
    (lambda tmp: bad_copy(tmp, r=64), "rank 64 is over --max-lora-rank 16"),
    (lambda tmp: bad_copy(tmp, target_modules=["q_proj", "c_attn"]), "target module 'c_attn'"),
    (lambda tmp: tiny_adapter_path("llama", "attn8"), "shape mismatch"),
])
def test_bad_adapters_are_refused_and_the_server_keeps_serving(http, client, tmp_path, make, words):
    r = load(http, "bad", make(tmp_path))
    assert r.status_code == 400 and words in r.json()["error"]["message"], r.text
    assert "bad" not in {c["id"] for c in http.get("/v1/models").json()["data"]}
    assert complete_ids(client, "attn8", PROMPT, 2)[1] == greedy_oracle(PROMPT, "attn8", 2)


def test_bodies_and_the_api_key_are_checked(server, http):
    url = server[0].url
    assert httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/y"}).status_code == 401
    assert httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "attn8"}).status_code == 401
    assert http.post("/v1/load_lora_adapter", json={"lora_path": "/y"}).status_code == 422
    assert http.post("/v1/unload_lora_adapter", json={}).status_code == 422
    r = load(http, server[1].model_name, tiny_adapter_path(MODEL, "attn8"))
    assert r.status_code == 400 and "base model's name" in r.json()["error"]["message"]


def test_unload_while_a_stream_uses_the_adapter_waits_for_it(server, http):
    assert load(http, "busy", tiny_adapter_path(MODEL, "mlp4_rs")).status_code == 200
    body = {"model": "busy", "prompt": PROMPT, "max_tokens": 150, "temperature": 0, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=server[0].url, headers=AUTH, timeout=60) as c:
            whole = (await c.post("/v1/completions", json=body)).json()["choices"][0]["text"]
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                lines = resp.aiter_lines()
                first = await lines.__anext__()
                unload = asyncio.create_task(c.post("/v1/unload_lora_adapter", json={"lora_name": "busy"}))
                await asyncio.sleep(0.05)
                pending = not unload.done()
                rest = [line async for line in lines]
            chunks = [json.loads(x[6:]) for x in [first] + rest if x.startswith("data: {")]
            streamed = "".join(ch["choices"][0]["text"] for ch in chunks)
            return whole, streamed, pending, await unload

    whole, streamed, pending, unloaded = asyncio.run(main())
    assert pending and unloaded.status_code == 200
    assert streamed == whole and len(server[1].tokenizer.encode(whole)) > 100
    assert "busy" not in {c["id"] for c in http.get("/v1/models").json()["data"]}


def test_unknown_models_resolve_from_the_resolver_folder(server, tmp_path):
    """--lora-resolver-dir (vLLM's filesystem resolver): a request naming an unknown model loads
    <folder>/<model> first (concurrent requests for it load it once) and decodes as peft does; names outside
    the folder, folders without an adapter_config.json and unknown names stay 404; a bad adapter there is a
    400 naming the problem and the server goes on serving."""
    from concurrent.futures import ThreadPoolExecutor
    handle = server[1]
    shutil.copytree(tiny_adapter_path(MODEL, "mixed16"), tmp_path / "team" / "m16")
    bad_copy(tmp_path, r=64)
    (tmp_path / "empty").mkdir()
    with BackgroundServer(create_app(handle, api_key=KEY, lora_resolver_dir=str(tmp_path))) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda _: complete_ids(c, "team/m16", PROMPT), range(2)))
        assert got == [("team/m16", greedy_oracle(PROMPT, "mixed16", 6))] * 2
        assert handle.lora_adapters["team/m16"] == str(tmp_path / "team" / "m16")
        for name in ("empty", "nope", "../" + tmp_path.name + "/empty", "/etc", "team/../team/m16"):
            with pytest.raises(openai.NotFoundError):
                c.completions.create(model=name, prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="rank 64 is over --max-lora-rank 16"):
            c.chat.completions.create(model="bad", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        assert complete_ids(c, "attn8", PROMPT, 2)[1] == greedy_oracle(PROMPT, "attn8", 2)
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as h:
            assert h.post("/v1/unload_lora_adapter", json={"lora_name": "team/m16"}).status_code == 200


def test_the_resolver_folder_is_checked_at_start(tmp_path):
    from server.cli import build_parser, lora_resolver_dir
    args = build_parser().parse_args(["serve", "--lora-resolver-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="needs --enable-lora"):
        lora_resolver_dir(args)
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-resolver-dir", str(tmp_path / "no")])
    with pytest.raises(ValueError, match="is not a folder"):
        lora_resolver_dir(args)
    args = build_parser().parse_args(["serve", "--enable-lora", "--lora-resolver-dir", str(tmp_path)])
    assert lora_resolver_dir(args) == str(tmp_path)

"""LoRA over HTTP (vLLM's interface) on the real engine (CPU, tiny Qwen3, PEFT adapters): the request's
`model` picks an adapter, /v1/models lists adapters with their parent, adapters load and unload at run
time behind the API key, where the server allows it (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING) and only from
the allowed folders, bad adapters are refused with a 4xx naming the problem while the server goes on
serving, and an unload waits for the requests that use the adapter."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile

import httpx
import numpy as np
import openai
import pytest

from engine.config import EngineConfig
from engine.handle import EngineHandle
from harness.lora import adapter_copy, hf_lora_logits, malformed_adapter, tiny_adapter_path
from harness.models import hf_logits, tiny_model_path
from server.app import create_app
from server.background import BackgroundServer

MODEL, KEY = "qwen3_tied", "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> tuple[str, str]:
    """The folders run-time loads may read: the tiny adapters' and every test's tmp_path."""
    return os.path.dirname(tiny_adapter_path(MODEL, "attn8")), str(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def server(roots):
    h = EngineHandle(EngineConfig(model=tiny_model_path(MODEL), device="cpu", max_model_len=512, num_kv_blocks=128,
                                  enable_lora=True, max_loras=2, progress=False,
                                  lora_modules=(("attn8", tiny_adapter_path(MODEL, "attn8")),)))
    with BackgroundServer(create_app(h, api_key=KEY, allow_runtime_lora=True, allowed_lora_paths=roots)) as srv:
        yield srv, h
    h.shutdown()


@pytest.fixture()
def outside():
    """A folder outside the allowed ones, holding a good adapter (`adapter`) and a plain file (`secret`)."""
    folder = tempfile.mkdtemp(prefix="openinfer-outside-")
    shutil.copytree(tiny_adapter_path(MODEL, "mixed16"), os.path.join(folder, "adapter"))
    open(os.path.join(folder, "secret"), "w").write("{}")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


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


def test_the_document_lists_the_lora_routes(server):
    from test_server_openapi import check_document
    check_document(server[0], secured=True, lora=True)


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
    return adapter_copy(tiny_adapter_path(MODEL, "mixed16"), tmp_path / "bad", **config)


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


def test_unknown_models_resolve_from_the_resolver_folder(server, tmp_path, outside):
    """--lora-resolver-dir (vLLM's filesystem resolver): a request naming an unknown model loads
    <folder>/<model> first (concurrent requests for it load it once) and decodes as peft does; names outside
    the folder (by their text or through a symlink), folders without an adapter_config.json and unknown names
    stay 404; a bad or malformed adapter there is a 400 naming the problem, and the server (resolver
    included) goes on serving."""
    from concurrent.futures import ThreadPoolExecutor
    handle = server[1]
    shutil.copytree(tiny_adapter_path(MODEL, "mixed16"), tmp_path / "team" / "m16")
    shutil.copytree(tiny_adapter_path(MODEL, "mlp4_rs"), tmp_path / "team" / "rs4")
    bad_copy(tmp_path, r=64)
    malformed_adapter(tiny_adapter_path(MODEL, "mixed16"), tmp_path / "broken")
    (tmp_path / "escape").symlink_to(os.path.join(outside, "adapter"))
    (tmp_path / "empty").mkdir()
    with BackgroundServer(create_app(handle, api_key=KEY, lora_resolver_dir=str(tmp_path),
                                     allow_runtime_lora=True)) as srv:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda _: complete_ids(c, "team/m16", PROMPT), range(2)))
        assert got == [("team/m16", greedy_oracle(PROMPT, "mixed16", 6))] * 2
        assert handle.lora_adapters["team/m16"] == os.path.realpath(tmp_path / "team" / "m16")
        for name in ("empty", "nope", "../" + tmp_path.name + "/empty", "/etc", "team/../team/m16", "escape"):
            with pytest.raises(openai.NotFoundError):
                c.completions.create(model=name, prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError, match="rank 64 is over --max-lora-rank 16"):
            c.chat.completions.create(model="bad", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
        with pytest.raises(openai.BadRequestError, match=r"'data_offsets' None is not \[begin, end\]"):
            c.completions.create(model="broken", prompt="x", max_tokens=1)
        assert complete_ids(c, "team/rs4", PROMPT, 2) == ("team/rs4", greedy_oracle(PROMPT, "mlp4_rs", 2))
        assert complete_ids(c, "attn8", PROMPT, 2)[1] == greedy_oracle(PROMPT, "attn8", 2)
        with httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as h:
            for name in ("team/m16", "team/rs4"):
                assert h.post("/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_run_time_loading_is_off_unless_allowed(server):
    """Without VLLM_ALLOW_RUNTIME_LORA_UPDATING (create_app's allow_runtime_lora) both routes are a 403
    naming how to turn it on, and the adapters loaded at start serve on."""
    handle = server[1]
    with BackgroundServer(create_app(handle, api_key=KEY)) as srv, \
            httpx.Client(base_url=srv.url, headers=AUTH, timeout=60) as c:
        for path, body in (("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": tiny_adapter_path(MODEL, "mixed16")}),
                           ("/v1/unload_lora_adapter", {"lora_name": "attn8"})):
            r = c.post(path, json=body)
            assert r.status_code == 403, r.text
            err = r.json()["error"]
            assert err["code"] == "runtime_lora_updating_disabled", err
            assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in err["message"] and "--allowed-lora-path" in err["message"]
        assert "x" not in handle.lora_adapters and "attn8" in handle.lora_adapters
        assert httpx.post(srv.url + "/v1/load_lora_adapter", json={}).status_code == 401
    with pytest.raises(ValueError, match="resolver folder needs run-time LoRA loading"):
        create_app(handle, lora_resolver_dir="/tmp")


def test_loads_read_only_inside_the_allowed_folders(server, http, tmp_path, outside):
    """Outside the allowed folders (absolute, relative, `~`, through a symlink in an allowed folder, or an
    adapter there whose weights file links out) a load is a 403 that reads the same whether anything is
    there or not; inside them a relative path loads, as its real path."""
    handle = server[1]
    (tmp_path / "link").symlink_to(os.path.join(outside, "adapter"))
    linked = shutil.copytree(tiny_adapter_path(MODEL, "mixed16"), tmp_path / "linked_weights")
    os.remove(linked / "adapter_model.safetensors")
    (linked / "adapter_model.safetensors").symlink_to(os.path.join(outside, "adapter", "adapter_model.safetensors"))
    paths = [os.path.join(outside, "adapter"), os.path.join(outside, "secret"), os.path.join(outside, "nothing"),
             "/etc", "/nowhere/at/all", "/", "~", "~/nothing", "relative/adapter",
             os.path.relpath(os.path.join(outside, "adapter")), str(tmp_path / "link"), str(linked),
             str(tmp_path) + "/../" * 12 + outside.lstrip("/") + "/adapter"]
    messages = set()
    for path in paths:
        r = load(http, "escape", path)
        assert r.status_code == 403, (path, r.text)
        err = r.json()["error"]
        assert (err["code"], err["param"]) == ("lora_path_not_allowed", "lora_path"), err
        messages.add(err["message"].replace(repr(path), "PATH"))
    assert len(messages) == 1, messages
    assert "escape" not in handle.lora_adapters
    relative = os.path.relpath(tiny_adapter_path(MODEL, "mlp4_rs"))
    assert load(http, "rel", relative).status_code == 200
    assert handle.lora_adapters["rel"] == os.path.realpath(tiny_adapter_path(MODEL, "mlp4_rs"))
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "rel"}).status_code == 200


def test_run_time_lora_flags_are_checked_at_start(tmp_path, monkeypatch):
    """--allow-runtime-lora-updating (env VLLM_ALLOW_RUNTIME_LORA_UPDATING, "1" or "true" as vLLM reads it),
    --allowed-lora-path and --lora-resolver-dir: a combination that cannot work is refused at start."""
    from server.cli import build_parser, runtime_lora
    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    monkeypatch.delenv("VLLM_LORA_RESOLVER_CACHE_DIR", raising=False)

    def access(*flags):
        return runtime_lora(build_parser().parse_args(["serve", *flags]))
    folder = str(tmp_path)
    for flags, words in [
            (["--lora-resolver-dir", folder], "needs --enable-lora"),
            (["--enable-lora", "--lora-resolver-dir", folder], "needs --allow-runtime-lora-updating"),
            (["--enable-lora", "--allowed-lora-path", folder], "needs --allow-runtime-lora-updating"),
            (["--enable-lora", "--allow-runtime-lora-updating"], "needs the folders adapters may be loaded from"),
            (["--enable-lora", "--allow-runtime-lora-updating", "--allowed-lora-path", folder + "/no"], "is not a folder"),
            (["--enable-lora", "--allow-runtime-lora-updating", "--lora-resolver-dir", folder + "/no"], "is not a folder")]:
        with pytest.raises(ValueError, match=words):
            access(*flags)
    assert access() == {"allow_runtime_lora": False, "allowed_lora_paths": (), "lora_resolver_dir": None}
    assert access("--enable-lora", "--allow-runtime-lora-updating", "--allowed-lora-path", folder,
                  "--lora-resolver-dir", folder) == {"allow_runtime_lora": True, "allowed_lora_paths": (folder,),
                                                     "lora_resolver_dir": folder}
    for value, on in (("1", True), ("True", True), ("0", False), ("yes", False)):
        monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", value)
        assert build_parser().parse_args(["serve"]).allow_runtime_lora_updating is on
    assert build_parser().parse_args(["serve", "--no-allow-runtime-lora-updating"]).allow_runtime_lora_updating is False

"""/openapi.json describes the running server — every route and body, the bearer key only with
--api-key, the LoRA routes only with --enable-lora — and schemathesis, generating requests from it (valid
and invalid, every route), finds nothing with its default checks, with the API key and without; the real
engine (CPU, tiny model) behind it. Explicit nulls are accepted wherever OpenAI's API takes them."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from server.app import create_app
from server.auth import OPEN_PATHS
from server.background import BackgroundServer
from tests.tiny_engine import tiny_handle

KEY = "k"
EXAMPLES = 30                 # per operation and phase: ~40 s a server on a 2-core machine


@pytest.fixture(scope="module")
def handle():
    h = tiny_handle(max_model_len=64, num_kv_blocks=64, max_n=2)
    yield h
    h.shutdown()


@pytest.fixture(scope="module", params=[KEY, None], ids=["api-key", "no-key"])
def server(request, handle):
    """The same engine served with --api-key and without."""
    with BackgroundServer(create_app(handle, served_model_name="tiny", api_key=request.param)) as srv:
        yield srv


def check_document(server, secured: bool, lora: bool) -> dict:
    """The document describes exactly the routes served; the bearer key (and its 401 answers) only where
    the server requires one, the LoRA routes only where they are served."""
    doc = httpx.get(server.url + "/openapi.json", timeout=10).json()
    served = {("/" + route.path.strip("/").replace("<model_id:path>", "{model_id}"), method)
              for route in server.app.router.routes for method in route.methods if method not in ("HEAD", "OPTIONS")}
    described = set()
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            if method == "parameters":
                continue
            described.add((path, method.upper()))
            if method == "post":
                assert op["requestBody"]["content"]["application/json"]["schema"], path
                assert "415" in op["responses"], path              # a body that is not JSON
                assert ("403" in op["responses"]) == ("lora_adapter" in path), path
            assert "200" in op["responses"], path
            assert ("401" in op["responses"]) == (secured and path not in OPEN_PATHS), path
            if secured:
                assert (op.get("security") == []) == (path in OPEN_PATHS), path
            else:
                assert "security" not in op, path
    assert described == served
    assert ("security" in doc and "components" in doc) == secured
    assert ("/v1/load_lora_adapter" in doc["paths"]) == lora == ("/v1/unload_lora_adapter" in doc["paths"])
    return doc


def test_the_document_describes_this_server(server):
    check_document(server, secured=server.app.ctx.api_key is not None, lora=False)
    assert httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/x"},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=10).status_code == 404


def test_explicit_nulls_are_the_defaults(server):
    """Every field OpenAI's API reference marks nullable may be sent as null (the official client sends
    what extra_body holds as it is)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    common = ["frequency_penalty", "logit_bias", "logprobs", "max_tokens", "n", "presence_penalty", "seed", "stop",
              "stream", "stream_options", "temperature", "top_p", "user"]
    chat_only = ["max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                 "response_format", "function_call", "functions", "metadata", "modalities", "prediction", "audio",
                 "reasoning_effort", "service_tier", "store", "web_search_options"]
    reply = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                           extra_body={k: None for k in common + chat_only})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens > 0
    out = client.completions.create(model="tiny", prompt="Hi", extra_body={k: None for k in common + [
        "best_of", "echo", "suffix"]})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 16


@pytest.mark.slow
def test_schemathesis_default_checks_find_nothing(server, tmp_path):
    """schemathesis with its default checks (all of them), generating requests (valid and invalid, every
    route) from the document of a server with the API key and without. One setting: a schema-valid request
    may be a 400 (never a 422: its JSON types and required fields are the document's), for the rules no
    JSON schema can state — a prompt's tokens plus max_tokens within max_model_len, min_tokens at most
    max_tokens, one output constraint per request."""
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or shutil.which("schemathesis")
    if exe is None:
        pytest.skip("schemathesis is in the test extra")
    config = tmp_path / "schemathesis.toml"
    config.write_text('[checks.positive_data_acceptance]\n'
                      'expected-statuses = ["2xx", "3xx", "400", "401", "403", "404", "409", "429", "5xx"]\n')
    auth = ["-H", f"Authorization: Bearer {KEY}"] if server.app.ctx.api_key else []
    run = subprocess.run([exe, "--config-file", str(config), "run", server.url + "/openapi.json", *auth,
                          "-n", str(EXAMPLES), "--seed", "1", "--generation-database", "none",
                          "--request-timeout", "30", "--no-color"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    selected = re.search(r"Selected: (\d+)/(\d+)", out)
    assert "FAILURES" not in out and selected and selected[1] == selected[2], out[-2000:]
    assert f"Tested: {selected[1]}" in out and int(selected[1]) >= 12, out[-2000:]     # every operation


def test_token_ids_are_json_schema_integers(server):
    """1.0 is an integer to JSON Schema (and to vLLM's pydantic): a token id may be written so; 1.5 is not."""
    headers = {"Authorization": f"Bearer {KEY}"}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(server.url + path, json=body, headers=headers, timeout=60)
    assert post("/detokenize", {"tokens": [9707.0, 1879]}).json() == post("/detokenize", {"tokens": [9707, 1879]}).json()
    as_floats = post("/v1/completions", {"prompt": [9707.0, 1879.0], "max_tokens": 2, "temperature": 0,
                                         "stop_token_ids": [0.0]})
    as_ints = post("/v1/completions", {"prompt": [9707, 1879], "max_tokens": 2, "temperature": 0, "stop_token_ids": [0]})
    assert as_floats.status_code == 200 and as_floats.json()["choices"][0]["text"] == as_ints.json()["choices"][0]["text"]
    for body, path in (({"tokens": [1.5]}, "/detokenize"), ({"prompt": [1.5], "max_tokens": 1}, "/v1/completions")):
        assert post(path, body).status_code == 422

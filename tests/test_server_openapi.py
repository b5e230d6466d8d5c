"""/openapi.json describes every route and body, and schemathesis, generating requests from it (valid
and invalid, every route, with the API key), finds no server error and no answer that breaks the
document — the real engine (CPU, tiny model) behind it.

Not checked: schemathesis' `positive_data_acceptance` (every schema-valid request is accepted). Some
rules span fields (a prompt plus max_tokens must fit max_model_len, top_logprobs needs logprobs,
max_tokens 0 needs echo) and JSON Schema counts 1.0 as an integer where a token id must be an int."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest

from server.app import create_app
from server.auth import OPEN_PATHS
from server.background import BackgroundServer
from tests.tiny_engine import tiny_handle

KEY = "k"
EXAMPLES = 30                 # per operation and phase: ~20 s on a 2-core machine


@pytest.fixture(scope="module")
def server():
    handle = tiny_handle(max_model_len=64, num_kv_blocks=64, max_n=2)
    with BackgroundServer(create_app(handle, api_key=KEY)) as srv:
        yield srv
    handle.shutdown()


def test_the_document_describes_every_route_and_body(server):
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
            assert (op.get("security") == []) == (path in OPEN_PATHS), path
    assert described == served


def test_schemathesis_finds_no_server_error(server, tmp_path):
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or shutil.which("schemathesis")
    if exe is None:
        pytest.skip("schemathesis is in the test extra")
    run = subprocess.run([exe, "run", server.url + "/openapi.json", "-H", f"Authorization: Bearer {KEY}",
                          "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                          "-n", str(EXAMPLES), "--seed", "1", "--generation-database", "none",
                          "--request-timeout", "30", "--no-color"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    selected = re.search(r"Selected: (\d+)/(\d+)", out)
    assert "FAILURES" not in out and selected and selected[1] == selected[2], out[-2000:]
    assert f"Tested: {selected[1]}" in out and int(selected[1]) >= 12, out[-2000:]     # every operation

"""`openinfer serve` and `openinfer generate` as a user runs them: a subprocess on 127.0.0.1, the
api key from the environment, a clean exit on Ctrl-C, and a clear error for a bad option."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from harness.models import tiny_model_path

OPENINFER = [sys.executable, "-m", "server.cli"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early ({proc.returncode}): {proc.stderr.read()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"server not healthy within {timeout} s")


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C the server and wait for it to exit (killed, and the test failed, after 30 s)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_serve_subprocess_with_api_key_then_ctrl_c():
    port = free_port()
    env = dict(os.environ, OPENINFER_API_KEY="test-key")
    proc = subprocess.Popen(OPENINFER + ["serve", "--model", tiny_model_path("qwen3_untied"), "--device", "cpu",
                                         "--port", str(port), "--served-model-name", "tiny", "--max-model-len",
                                         "256", "--num-kv-blocks", "64"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=url + "/v1", api_key="test-key", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny"]
        out = client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="Hello", max_tokens=300)
    finally:
        interrupt(proc)
    log = proc.stderr.read()
    assert proc.returncode == 0, log
    assert "prompt=" in log and "completion=4" in log and "ttft=" in log     # one line per request


def test_generate_prints_the_completion():
    path = tiny_model_path("qwen3_untied")
    run = subprocess.run(OPENINFER + ["generate", "Hello there", "--model", path, "--device", "cpu",
                                      "--max-tokens", "5", "--no-chat"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "finish_reason=" in run.stderr and "prompt_tokens=" in run.stderr
    assert run.stdout.strip()


@pytest.mark.parametrize("args,needle", [(["serve", "--device", "tpu"], "--device"),
                                         (["serve", "--max-num-seqs", "0"], "max_num_seqs"),
                                         (["serve", "--model", "/no/such/model"], "/no/such/model")])
def test_bad_cli_options_fail_with_a_clear_message(args, needle):
    run = subprocess.run(OPENINFER + args, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and needle in run.stderr

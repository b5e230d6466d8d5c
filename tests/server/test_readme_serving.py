"""The README's serving examples, run exactly as written: its `.venv/bin/openinfer serve` command (the
demo model) in a subprocess, then every curl block and every openai-client Python block of the README and of
docs/serving.md against it.
Where the checkout has no .venv (a development tree), the same command runs as
`python -m server.cli`, so the checkout's own code serves."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(ROOT, "README.md")
SERVING_DOC = os.path.join(ROOT, "docs", "serving.md")
PORT = 8000
OPENINFER = ".venv/bin/openinfer"


def readme_blocks(section: str | None = None, path: str = README) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of the README (or of one `## section`), in order."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if section is not None:
        text = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return [(m.group(1), m.group(2)) for m in re.finditer(r"```(\w*)\n(.*?)```", text, re.S)]


def serve_command() -> str:
    """The Serving section's server command."""
    commands = [code.strip() for lang, code in readme_blocks("Serving")
                if lang == "bash" and code.strip().startswith(f"{OPENINFER} serve")]
    assert commands, f"README's Serving section has no `{OPENINFER} serve` block"
    return commands[0]


def runnable(command: str) -> str:
    if os.path.exists(os.path.join(ROOT, OPENINFER)):
        return command
    return f"{shlex.quote(sys.executable)} -m server.cli" + command[len(OPENINFER):]


def example_blocks() -> list[tuple[str, str]]:
    """The README's blocks, then docs/serving.md's (run against the README's server too)."""
    return readme_blocks() + readme_blocks(path=SERVING_DOC)


def client_examples() -> list[tuple[str, str]]:
    return [(lang, code) for lang, code in example_blocks()
            if (lang == "bash" and code.lstrip().startswith("curl ")) or (lang == "python" and "OpenAI(" in code)]


def test_readme_has_the_examples():
    langs = [lang for lang, _ in client_examples()]
    assert langs.count("bash") >= 2 and langs.count("python") >= 1
    readme = [lang for lang, code in readme_blocks() if (lang, code) in client_examples()]
    assert "bash" in readme and "python" in readme        # a curl and an openai-client example in the README
    assert f"--port {PORT}" in serve_command()


def test_serving_uses_the_first_commands_form():
    first = next(code for lang, code in readme_blocks() if lang == "bash")
    assert f"&& {OPENINFER} serve" in first, first
    assert serve_command().startswith(f"{OPENINFER} serve ")


def test_the_demo_model_is_installed_up_front():
    """The first command and CI's test command install the demo model before anything runs (the server
    never runs pip: engine/loader/demo.py)."""
    from engine.loader.demo import INSTALL_COMMAND
    with open(README, encoding="utf-8") as f:
        ci = f.read().split("<!-- ci:test-command", 1)[1].split("```bash\n", 1)[1].split("\n", 1)[0]
    first = next(code for lang, code in readme_blocks() if lang == "bash")
    for command in (first, ci):
        steps = [step.strip() for step in command.split("&&")]
        install = steps.index(f".venv/bin/{INSTALL_COMMAND}")
        assert install > 0 and "pip install" in steps[install - 1], command


@pytest.fixture(scope="module")
def readme_server():
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", PORT)) == 0:
            pytest.fail(f"port {PORT} (the README's) is already in use; stop what listens there")
    env = dict(os.environ, PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.Popen(runnable(serve_command()), shell=True, cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    try:
        while True:
            if proc.poll() is not None:
                pytest.fail(f"`{serve_command()}` exited ({proc.returncode}): {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"http://127.0.0.1:{PORT}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("README server not healthy within 180 s")
            time.sleep(0.25)
        yield env
    finally:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except ProcessLookupError:        # it exited already (a failed start)
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def check_curl_output(out: str) -> None:
    if out.startswith("data: "):
        events = [e for e in out.split("\n\n") if e.strip()]
        assert events[-1].strip() == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
        assert chunks and all("choices" in c for c in chunks)
        assert "".join(c["choices"][0].get("text", "") for c in chunks if c["choices"])
    elif out.startswith("{"):
        body = json.loads(out)
        if "error" in body:       # the README's bad-request example
            assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["param"]
        else:
            assert body["choices"] and body["usage"]["completion_tokens"] > 0
    else:                         # a metrics line, through grep
        name, value = out.split()[:2]
        assert name.startswith("openinfer_") and float(value) > 0


def run_example(lang: str, code: str, env: dict) -> None:
    argv = ["bash", "-c", code] if lang == "bash" else [sys.executable, "-c", code]
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert run.returncode == 0, f"README example failed:\n{code}\n{run.stderr[-2000:]}"
    assert run.stdout.strip(), f"README example printed nothing:\n{code}"
    if lang == "bash":
        check_curl_output(run.stdout.strip())
    elif "include_usage" in code:
        assert re.search(r"\[\d+ prompt \+ \d+ completion tokens\]", run.stdout)


@pytest.mark.slow
def test_readme_examples_run_as_written(readme_server):
    """The generating examples run at once (the engine batches them, as it would for several users);
    the metrics example runs after them, so it has tokens to count."""
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    examples = client_examples()
    generating = [e for e in examples if "/metrics" not in e[1]]
    with ThreadPoolExecutor(len(generating)) as pool:
        for future in [pool.submit(run_example, lang, code, readme_server) for lang, code in generating]:
            future.result()
    for lang, code in examples:
        if "/metrics" in code:
            run_example(lang, code, readme_server)


def readme_block(lang: str, marker: str) -> str:
    """The one `lang` block of the README and docs/serving.md that holds `marker`."""
    blocks = [code for block_lang, code in example_blocks() if block_lang == lang and marker in code]
    assert len(blocks) == 1, f"README + docs/serving.md: {len(blocks)} {lang} blocks hold {marker!r}"
    return blocks[0]


@pytest.mark.slow
def test_readme_python_example_generates_the_oracles_text():
    """The "From Python" block, run as written, prints the demo model's greedy answer: transformers' greedy
    tokens on the demo model's GGUF (the oracle) for the same prompt and length."""
    import torch

    from engine.loader.demo import demo_gguf_path, demo_model_path
    from engine.tokenizer import Tokenizer
    from harness.models import hf_model
    code = readme_block("python", "EngineHandle(")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    content = re.search(r'"content": "([^"]+)"', code).group(1)
    max_tokens = int(re.search(r"max_tokens=(\d+)", code).group(1))
    tok = Tokenizer.from_folder(demo_model_path())
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": content}]), add_special_tokens=False)
    gguf = demo_gguf_path()
    with torch.no_grad():
        out = hf_model(os.path.dirname(gguf), os.path.basename(gguf)).generate(
            torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, eos_token_id=tok.eos_token_ids,
            pad_token_id=tok.eos_token_ids[0])
    expected = tok.decode([t for t in out[0, len(ids):].tolist() if t not in tok.eos_token_ids])
    assert expected and run.stdout == expected + "\n"


@pytest.mark.slow
def test_readme_lm_eval_local_task_runs_as_written(readme_server, tmp_path):
    """The lm_eval block, as written (the task's YAML and dataset made in a fresh folder, the Hub switched
    off), against the README's server: the task is scored. (lm-eval is in the test extra: the pip line is
    left out; tests/server/test_lm_eval.py checks the loglikelihoods against transformers.)"""
    code = readme_block("bash", "lm_eval --model local-completions")
    script = "\n".join(line for line in code.splitlines() if not line.startswith(".venv/bin/pip"))
    lm_eval = os.path.join(ROOT, ".venv/bin/lm_eval")
    if not os.path.exists(lm_eval):
        lm_eval = f"{shlex.quote(sys.executable)} -m lm_eval"
    script = script.replace(".venv/bin/lm_eval", lm_eval)
    env = dict(readme_server, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp_path / "hf"))
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    task = re.search(r"--tasks (\S+)", code).group(1)
    row = next((line for line in run.stdout.splitlines() if line.startswith(f"|{task}")), None)
    assert row is not None, run.stdout[-2000:]
    cells = [c.strip() for c in row.split("|")]
    assert "acc" in cells and 0.0 <= float(cells[cells.index("acc") + 2]) <= 1.0, row

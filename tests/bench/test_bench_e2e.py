"""bench/serve and bench/prefix_ttft end to end against the real server (CPU executor, tiny model)."""
import importlib.util
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("server.cli") is None, reason="server CLI not present"),
    pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers"),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served_tiny_model(tmp_path_factory):
    """(base url, model folder) of `openinfer serve` on the CPU with a tiny random Qwen3 model."""
    from harness.models import tiny_model_path
    model = tiny_model_path("qwen3_tied")
    port = _free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", "--model", model, "--device", "cpu",
                             "--port", str(port), "--host-kv-blocks", "64"],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            try:
                if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.seek(0)
                pytest.fail(f"the server did not come up:\n{log.read()[-3000:]}")
            time.sleep(0.5)
        yield url, model
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_serve_benchmark_against_the_real_server(served_tiny_model, tmp_path):
    from bench.serve import main
    url, model = served_tiny_model
    report = main(["--base-url", url, "--tokenizer", model, "--input-len", "24", "--output-len", "5",
                   "--num-prompts", "6", "--sweep-rates", "20,inf", "--max-concurrency", "4",
                   "--out-dir", str(tmp_path), "--label", "e2e", "--save-requests", "--no-plots"])
    assert len(report["runs"]) == 2
    for run in report["runs"]:
        m = run["metrics"]
        assert m["completed"] == 6 and m["failed"] == 0, run["errors"]
        # the server's own usage counts: prompts are exactly 24 tokens, outputs pinned to 5 by min_tokens
        assert m["total_input_tokens"] == 6 * 24 and m["total_output_tokens"] == 6 * 5
        assert m["max_concurrent_requests"] <= 4
        for r in run["requests"]:
            assert r["success"] and r["ttft"] > 0 and 1 <= len(r["itl"]) <= 4
            assert r["cached_tokens"] == 0  # fresh prompts per rate: no run reuses another's KV blocks
            assert r["latency"] == pytest.approx(r["ttft"] + sum(r["itl"]), abs=1e-6)
        assert m["mean_tpot_ms"] > 0 and m["mean_e2el_ms"] >= m["mean_ttft_ms"]
    assert (tmp_path / "e2e.json").exists() and (tmp_path / "e2e.md").exists()


def test_prefix_ttft_against_the_real_server(served_tiny_model, tmp_path):
    from bench.prefix_ttft import main
    url, model = served_tiny_model
    report = main(["--base-url", url, "--tokenizer", model, "--lengths", "40,100", "--seed", "5",
                   "--out-dir", str(tmp_path), "--label", "e2e", "--host-tier"])
    for row in report["summary"]:
        assert row["cold_cached_tokens"] == 0
        # every full 16-token KV block before the changed last token comes from the prefix cache: first
        # from the device, then (after POST /reset_prefix_cache) from the host KV tier
        assert row["warm_cached_tokens"] == row["host_cached_tokens"] == (row["length"] - 1) // 16 * 16
        assert row["cold_prompt_tokens"] == row["warm_prompt_tokens"] == row["host_prompt_tokens"] == row["length"]
        assert row["host_ttft_ms"] > 0 and row["host_speedup"] > 0
    assert "host-tier TTFT" in (tmp_path / "e2e.md").read_text()


def _server_ttft(url: str) -> tuple[float, float] | None:
    """(sum, count) of the server's own TTFT histogram, or None when it exports none."""
    text = httpx.get(url + "/metrics", timeout=10).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("openinfer_time_to_first_token_seconds_")}
    if "openinfer_time_to_first_token_seconds_sum" not in values:
        return None
    return values["openinfer_time_to_first_token_seconds_sum"], values["openinfer_time_to_first_token_seconds_count"]


def test_client_ttft_brackets_the_server_measured_ttft(served_tiny_model):
    """The client's TTFT covers the server's (which starts later, at request arrival) plus HTTP time."""
    import asyncio
    from bench.common_data import load_tokenizer, random_requests
    from bench.serve import probe, run_benchmark
    url, model = served_tiny_model
    specs = random_requests(load_tokenizer(model), 4, 30, 6, seed=11)
    name = asyncio.run(probe(url, None, specs[0], "completions", True, None))
    before = _server_ttft(url)
    if before is None:
        pytest.skip("the server exports no TTFT histogram")
    results, _ = asyncio.run(run_benchmark(specs, url, name, float("inf"), max_concurrency=1))
    after = _server_ttft(url)
    assert after[1] - before[1] == 4
    server_sum, client_sum = after[0] - before[0], sum(r.ttft for r in results)
    assert server_sum - 0.005 <= client_sum <= server_sum + 4 * 0.5, (client_sum, server_sum)


def test_shared_prefix_prompts_hit_the_prefix_cache(served_tiny_model):
    """--prefix-len: one random prefix shared by every prompt, so later requests reuse its KV blocks."""
    import asyncio
    from bench.common_data import load_tokenizer, random_requests
    from bench.serve import probe, run_benchmark
    url, model = served_tiny_model
    specs = random_requests(load_tokenizer(model), 4, 8, 2, prefix_len=32, seed=12)
    name = asyncio.run(probe(url, None, random_requests(load_tokenizer(model), 1, 20, 2, seed=13)[0],
                             "completions", True, None))
    results, _ = asyncio.run(run_benchmark(specs, url, name, float("inf"), max_concurrency=1))
    assert all(r.success for r in results)
    assert results[0].cached_tokens == 0
    # the 32 prefix tokens are two full blocks; the boundary token may merge with the body's first
    assert all(r.cached_tokens in (16, 32) for r in results[1:]), [r.cached_tokens for r in results]

"""The engine in a process of its own (EngineClient): the same tokens as the in-process engine, aborts
and errors crossing the pipe, start-up errors raised in the parent, a dead engine process failing
its open requests instead of hanging them, and the process tied to its parent (engine/process_tree.py):
none of the parent's sockets held, dead with the parent, a SIGTERM ending it once its requests have."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from engine.config import EngineConfig
from engine.events import Error, Finished, Rejected, Token
from engine.handle import EngineHandle
from engine.process import EngineClient
from engine.request import GenerateRequest, SamplingParams
from harness.models import tiny_model_path

PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def config():
    return EngineConfig(model=tiny_model_path("qwen3_tied"), device="cpu", max_model_len=256, num_kv_blocks=64,
                        progress=False)


@pytest.fixture(scope="module")
def client(config):
    with EngineClient(config) as c:
        yield c


def test_same_tokens_as_the_engine_in_this_process(client, config):
    prompts = [[5, 6, 7, 8], list(range(40, 90)), [3] * 20]
    with EngineHandle(config) as local:
        want = [o.outputs[0].token_ids for o in local.generate(prompts, PARAMS)]
    got = client.generate(prompts, PARAMS)
    assert [o.outputs[0].token_ids for o in got] == want and all(len(w) == 12 for w in want)
    assert [o.outputs[0].finish_reason for o in got] == ["length"] * 3
    assert client.max_model_len == 256 and client.tokenizer.encode("hi") and client.is_healthy()
    assert client.stats().generation_tokens_total >= 36


def test_rejections_and_aborts_cross_the_pipe(client):
    async def run():
        bad = [e async for e in client.submit(GenerateRequest("bad", [1] * 300, PARAMS))]
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = client.submit(GenerateRequest("long", [1, 2, 3], long))
        events = []
        async for e in stream:
            events.append(e)
            if sum(isinstance(x, Token) for x in events) == 3:
                client.abort("long")
        return bad, events
    bad, events = asyncio.run(run())
    assert isinstance(bad[0], Rejected) and "max_model_len" in bad[0].reason
    assert isinstance(events[-1], Finished) and events[-1].reason == "abort"
    assert sum(isinstance(e, Token) for e in events) < 200


def test_grammar_checks_run_in_the_engine_process(client):
    """The server's grammar check crosses the pipe to the engine's grammar cache: a grammar past the
    limits is the same GrammarError every time; a good one is compiled there, where its request runs."""
    import re

    from engine.grammar import GrammarError
    from server.structured import regex_grammar

    async def refusal(grammar: str) -> str:
        with pytest.raises(GrammarError) as e:
            await client.check_grammar(grammar)
        return str(e.value)

    async def run():
        bad = regex_grammar("a{1000000}", "r")
        reasons = {await refusal(bad), await refusal(bad)}
        good = regex_grammar("[0-9]{3}-pipe", "r")
        await client.check_grammar(good)
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=16, grammar=good)
        return reasons, [e async for e in client.submit(GenerateRequest("g", [5, 6, 7], params))]
    reasons, events = asyncio.run(run())
    assert len(reasons) == 1 and "lexer error" in reasons.pop()
    assert re.fullmatch("[0-9]{3}-pipe", "".join(e.text for e in events if isinstance(e, Token)))
    assert [e.reason for e in events if isinstance(e, Finished)] == ["stop"]


def test_start_up_errors_are_raised_in_the_parent():
    with pytest.raises(FileNotFoundError, match="no/such"):
        EngineClient(EngineConfig(model="/no/such/model", device="cpu"))
    with pytest.raises(ValueError, match="max_model_len"):
        EngineClient(EngineConfig(model=tiny_model_path("qwen3_tied"), device="cpu", max_model_len=100000))


def signal_mid_request(c: EngineClient, sig: signal.Signals, max_tokens: int) -> list:
    """The events of one request whose engine process is sent `sig` after its second event."""
    async def run():
        stream = c.submit(GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        events = []
        async for e in stream:
            events.append(e)
            if len(events) == 2:
                os.kill(c._proc.pid, sig)
        return events
    return asyncio.run(asyncio.wait_for(run(), 60))


def test_a_dead_engine_fails_open_requests(config):
    c = EngineClient(config)
    ended = []
    c.on_end(lambda why, failed: ended.append((why, failed)))
    try:
        events = signal_mid_request(c, signal.SIGKILL, max_tokens=200)
        assert isinstance(events[-1], Error) and "engine process ended" in events[-1].message
        assert not c.is_healthy()
        assert ended == [("the engine process ended (killed by SIGKILL)", True)]      # the server stops on it
    finally:
        c.shutdown()


def test_startup_notes_are_made_in_the_engine_process(config, monkeypatch):
    """What `openinfer serve` says about the device is asked in the engine process, never in the server
    before it forks: CUDA initialised in a parent is unusable in its forked child (the GPU server
    failed to start with cudaErrorInitializationError when the server asked CuPy for the device count)."""
    import logging

    from server import startup

    asked_in = []

    def status():
        asked_in.append(os.getpid())                 # only the parent's list is seen here
        return f"CuPy sees no GPU (asked in {os.getpid()})"

    monkeypatch.setattr(startup, "cupy_status", status)
    monkeypatch.setattr(startup, "nvidia_gpu_present", lambda: "/dev/nvidia0")
    config = dataclasses.replace(config, device="auto")
    with EngineClient(config, notes=startup.startup_notes) as c:
        levels = [level for level, _ in c.startup_notes]
        assert levels[0] == logging.WARNING and "CuPy sees no GPU (asked in " in c.startup_notes[0][1]
        assert f"(asked in {os.getpid()})" not in c.startup_notes[0][1]
        assert "CpuExecutor" in c.startup_notes[-1][1]
    assert not asked_in                                  # the server process never asked


def test_the_end_of_the_warm_up_reaches_the_parent_without_a_request(config):
    """/metrics' openinfer_engine_warming_up: the engine's idle-time warm-up ends with no step to carry
    its stats, so the child sends them itself (the CPU executor's warm-up ends at once)."""
    import time

    with EngineClient(config) as c:
        deadline = time.monotonic() + 30
        while c.stats().warming_up and time.monotonic() < deadline:
            time.sleep(0.02)
        assert c.stats().warming_up == 0
        assert c.stats().num_steps == 0


def test_the_engine_process_holds_no_socket_of_its_parent(config):
    """A listener the server closes stops listening: the engine process, forked after the server bound
    its port, must not keep it open (the kernel would accept connections nobody answers, and the port
    would stay taken after the server died)."""
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    with EngineClient(config) as c:
        listener.close()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        assert c.is_healthy()


@pytest.mark.slow                 # a Python process of its own starts an engine: 10-30 s on 2 cores
def test_the_engine_process_dies_with_its_parent(tmp_path):
    """kill -9 of the process that started the engine process ends that too (PR_SET_PDEATHSIG, and EOF on
    its input pipe, whose write end only the parent holds)."""
    import subprocess
    import sys
    import time

    script = ("import sys, time\nfrom engine.config import EngineConfig\nfrom engine.process import EngineClient\n"
              f"c = EngineClient(EngineConfig(model={tiny_model_path('qwen3_tied')!r}, device='cpu', "
              "max_model_len=256, num_kv_blocks=64, progress=False))\n"
              "print(c._proc.pid, flush=True)\ntime.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), "the engine process outlived its parent"
    finally:
        parent.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan is reaped by init, a child of ours is not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_sigterm_to_the_engine_process_lets_its_requests_finish_then_ends_it(config):
    """SIGTERM stops the engine process gracefully: the parent hears of it at once (no new requests; the
    server drains), the running request finishes whole, then the process exits with code 0."""
    c = EngineClient(config)
    ended = []
    c.on_end(lambda why, failed: ended.append((why, failed)))
    try:
        events = signal_mid_request(c, signal.SIGTERM, max_tokens=40)
        assert isinstance(events[-1], Finished) and events[-1].reason == "length"
        assert sum(isinstance(e, Token) for e in events) == 40
        assert ended == [("the engine process received SIGTERM", False)]
        assert not c.is_healthy()
        with pytest.raises(RuntimeError, match="stopping"):
            c.submit(GenerateRequest("late", [1, 2], PARAMS))
        assert c.wait(30) == 0
    finally:
        c.shutdown()

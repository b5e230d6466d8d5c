"""KV cache events from a live `openinfer serve` (the demo model on the CPU, the engine in its own process):
a subscriber of vLLM's wire format (tests/kv_event_subscriber.py) sees a prompt's full blocks stored under the
engine's prefix hashes with the prompt's tokens, their removal once the small KV pool evicts them, one
AllBlocksCleared for POST /reset_prefix_cache, and gets every batch again from the replay socket."""
from __future__ import annotations

import json
import subprocess

import httpx
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from kv_event_subscriber import AllBlocksCleared, BlockRemoved, BlockStored, Subscriber, events_config
from memory.kv_pool import BLOCK_SIZE
from memory.prefix_hash import hash_chain
from test_server_cli import OPENINFER, ROOT, free_port, interrupt, wait_healthy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server():
    """(url, Subscriber) of a demo-model server with a 16-block KV pool publishing its events."""
    port, events, replay = free_port(), free_port(), free_port()
    proc = subprocess.Popen(OPENINFER + ["serve", "--device", "cpu", "--port", str(port), "--num-kv-blocks", "16",
                                         "--kv-events-config", json.dumps(events_config(events, replay))],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    sub = None
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, timeout=180)
        sub = Subscriber(events, replay_port=replay)
        yield url, sub
    finally:
        if sub is not None:
            sub.close()
        interrupt(proc)


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stored_hashes(evs) -> list[int]:
    return [h for e in evs if isinstance(e, BlockStored) for h in e.block_hashes]


def test_stored_removed_cleared_and_replayed(server):
    url, sub = server
    prompt = list(range(1000, 1050))                           # 3 full blocks
    complete(url, prompt)
    chain = hash_chain(prompt, BLOCK_SIZE)
    sub.wait(lambda evs: set(chain) <= set(stored_hashes(evs)))
    (first,) = [e for e in sub.events() if isinstance(e, BlockStored) and e.block_hashes[0] == chain[0]]
    assert (first.block_hashes, first.parent_block_hash, first.token_ids) == (chain, None, prompt[:48])
    assert (first.block_size, first.medium, first.lora_id, first.group_idx) == (16, "GPU", None, 0)

    for i in range(3):                                         # 3 x 6 blocks through a 16-block pool
        complete(url, [2000 + 100 * i + t for t in range(100)])
    sub.wait(lambda evs: set(chain) <= {h for e in evs if isinstance(e, BlockRemoved) for h in e.block_hashes})

    assert httpx.post(url + "/reset_prefix_cache", timeout=60).status_code == 200
    sub.wait(lambda evs: isinstance(evs[-1], AllBlocksCleared))
    assert sub.received[-1][1].events == [AllBlocksCleared()]

    seqs = [seq for seq, _ in sub.received]
    assert seqs == list(range(len(seqs)))                      # nothing missed, in order
    assert sub.replay(0) == [(seq, sub.payloads[seq]) for seq in seqs]

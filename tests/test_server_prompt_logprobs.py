"""vLLM's `prompt_logprobs` (completions: in each choice; chat: at the top level) through a live server (CPU
engine, tiny random-weight Qwen3, the real Qwen tokenizer), read by the official openai client: per prompt
token (the first None) a dict token id -> {logprob, rank, decoded_token} with the prompt token first at its
rank in the distribution and the top-k at ranks 1..k. Oracle: transformers float32 logits and its tokenizer."""
from __future__ import annotations

import httpx
import numpy as np
import openai
import pytest

from harness.models import hf_logits, log_softmax, tiny_model_path
from server.app import create_app
from server.background import BackgroundServer
from tests.tiny_engine import MODEL, tiny_handle

TOL = 2e-5                      # engine vs transformers float32 logprobs on this model (test_server_client_fit.py)


@pytest.fixture(scope="module")
def path():
    return tiny_model_path(MODEL)


@pytest.fixture(scope="module")
def handle():
    h = tiny_handle()
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def server(handle):
    with BackgroundServer(create_app(handle, served_model_name="m")) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def check_against_oracle(plp: list, ids: list[int], k: int, path: str) -> None:
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(path)
    oracle = log_softmax(hf_logits(path, ids))
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        row, entry = oracle[pos - 1], plp[pos]
        token = str(ids[pos])
        assert list(entry)[0] == token                     # the prompt token first, as vLLM's dict has it
        mine = entry[token]
        assert abs(mine["logprob"] - row[ids[pos]]) <= TOL
        lo, hi = np.count_nonzero(row > mine["logprob"] + TOL) + 1, np.count_nonzero(row >= mine["logprob"] - TOL)
        assert lo <= mine["rank"] <= hi                    # its rank: the tokens at least as likely
        assert mine["decoded_token"] == hf_tok.decode([ids[pos]])
        assert sorted(e["rank"] for e in entry.values())[:k] == list(range(1, k + 1))   # the top-k: ranks 1..k
        kth = np.sort(row)[-k] if k else np.inf
        for t, e in entry.items():
            assert abs(e["logprob"] - row[int(t)]) <= TOL and e["decoded_token"] == hf_tok.decode([int(t)])
            assert t == token or row[int(t)] >= kth - TOL  # each alternative among the k most likely
        assert len(entry) == k + (mine["rank"] > k)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs_match_the_oracle(client, handle, path, k):
    ids = handle.tokenizer.encode("Colorless green ideas sleep furiously")
    out = client.completions.create(model="m", prompt=ids, max_tokens=2, n=2, temperature=1.0, seed=1,
                                    extra_body={"prompt_logprobs": k})
    assert [c.model_extra["prompt_logprobs"] for c in out.choices] == [out.choices[0].model_extra["prompt_logprobs"]] * 2
    check_against_oracle(out.choices[0].model_extra["prompt_logprobs"], ids, k, path)


def test_each_prompt_has_its_own_and_echo_keeps_its_k(client, handle, path):
    texts = ["The sky is", "A quick brown fox jumps"]
    out = client.completions.create(model="m", prompt=texts, max_tokens=1, echo=True, logprobs=1,
                                    extra_body={"prompt_logprobs": 4})
    for choice, text in zip(out.choices, texts):
        ids = handle.tokenizer.encode(text)
        check_against_oracle(choice.model_extra["prompt_logprobs"], ids, 4, path)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])    # echo's: logprobs 1, + the token
    plain = client.completions.create(model="m", prompt="The sky is", max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra


def test_chat_prompt_logprobs_cover_the_rendered_prompt(client, server, path):
    messages = [{"role": "user", "content": "Hello there"}]
    ids = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()["tokens"]
    out = client.chat.completions.create(model="m", messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 1})
    check_against_oracle(out.model_extra["prompt_logprobs"], ids, 1, path)


@pytest.mark.parametrize("body,param", [
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),      # vLLM: not with a stream (0 is fine)
    ({"prompt_logprobs": -1}, "prompt_logprobs"),                     # the whole vocabulary: not served
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_refusals(server, body, param):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "prompt_logprobs": 0,
                                                          "stream": True})
    assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n")

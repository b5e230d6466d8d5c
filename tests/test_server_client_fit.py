"""What clients (lm-eval, OpenAI's SDK) rely on, against the real engine (CPU, tiny random-weight Qwen3,
the real Qwen tokenizer): prompt scoring with max_tokens 0, the chosen token among the top logprobs,
a byte-fragment token's real bytes in chat logprobs, /tokenizer_info. Oracle: transformers float32."""
from __future__ import annotations

import json

import httpx
import numpy as np
import pytest

from server.app import create_app
from server.background import BackgroundServer
from harness.models import hf_logits, log_softmax, tiny_model_path
from tests.tiny_engine import MODEL, tiny_handle

LOGPROB_TOL = 2e-5             # engine vs transformers float32 on this model (see test_server_live.py)


@pytest.fixture(scope="module")
def path():
    return tiny_model_path(MODEL)


@pytest.fixture(scope="module")
def handle():
    h = tiny_handle()
    yield h
    h.shutdown()


@pytest.fixture(scope="module")
def url(handle):
    with BackgroundServer(create_app(handle)) as srv:
        yield srv.url


def post(url: str, route: str, **body) -> dict:
    r = httpx.post(url + route, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_echo_with_max_tokens_0_scores_the_prompt(url, handle, path):
    prompt = "The capital of France is Paris"
    ids = handle.tokenizer.encode(prompt)
    out = post(url, "/v1/completions", prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    choice = out["choices"][0]
    assert choice["text"] == prompt and choice["finish_reason"] == "length"
    assert out["usage"] == {**out["usage"], "prompt_tokens": len(ids), "completion_tokens": 0,
                            "total_tokens": len(ids)}
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    oracle = log_softmax(hf_logits(path, ids))
    np.testing.assert_allclose(lp["token_logprobs"][1:], [oracle[i - 1][ids[i]] for i in range(1, len(ids))],
                               atol=LOGPROB_TOL)
    streamed = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True,
                                                         "logprobs": 2, "stream": True}, timeout=60).text
    events = [e[6:] for e in streamed.split("\n\n") if e]
    chunks = [json.loads(e) for e in events[:-1]]
    assert events[-1] == "[DONE]" and "".join(c["choices"][0]["text"] for c in chunks) == prompt
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]] \
        == lp["tokens"]


def test_top_logprobs_always_hold_the_chosen_token(url, handle, path):
    """OpenAI: up to logprobs + 1 entries, the chosen one included — at prompt and generated positions."""
    ids = handle.tokenizer.encode("Colorless green ideas sleep furiously, said the linguist")
    k = 2
    out = post(url, "/v1/completions", prompt=ids, max_tokens=6, echo=True, logprobs=k, temperature=1.0, seed=3,
               return_tokens_as_token_ids=True)
    lp = out["choices"][0]["logprobs"]
    all_ids = [int(t.split(":")[1]) for t in lp["tokens"]]
    assert all_ids[:len(ids)] == ids
    oracle = log_softmax(hf_logits(path, all_ids))
    grew = 0
    for pos in range(1, len(all_ids)):
        top, token = lp["top_logprobs"][pos], lp["tokens"][pos]
        assert top[token] == lp["token_logprobs"][pos]
        best = np.argsort(-oracle[pos - 1])[:k]
        assert {f"token_id:{t}" for t in best} <= set(top)            # the k most likely, by the oracle
        assert len(top) == (k if all_ids[pos] in best else k + 1)
        grew += len(top) == k + 1
    assert grew >= 3                # a random-weight model seldom predicts the prompt: most positions grow


def fragment_token(tokenizer) -> int:
    """A token that is only part of a UTF-8 character (the first piece of an emoji)."""
    for t in tokenizer.encode("🎉🦜🧪"):
        raw = tokenizer.token_bytes(t)
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return t
    raise AssertionError("no byte-fragment token in the emoji")


def test_chat_logprobs_give_a_fragment_tokens_real_bytes(url, handle):
    tok = handle.tokenizer
    frag = fragment_token(tok)
    raw = tok.token_bytes(frag)
    assert tok.decode([frag]) == "\ufffd"              # what the text of such a token is
    out = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "An emoji, please"}],
               max_tokens=1, temperature=0, logprobs=True, top_logprobs=3, logit_bias={str(frag): 100})
    entry = out["choices"][0]["logprobs"]["content"][0]
    assert entry["bytes"] == list(raw) and entry["bytes"] != [239, 191, 189]
    assert entry["token"] == raw.decode("utf-8", "backslashreplace") and "\\x" in entry["token"]
    by_id = post(url, "/v1/chat/completions", messages=[{"role": "user", "content": "An emoji, please"}],
                 max_tokens=1, temperature=0, logprobs=True, top_logprobs=3, logit_bias={str(frag): 100},
                 return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"][0]
    assert by_id["token"] == f"token_id:{frag}" and by_id["bytes"] == list(raw)
    for alt in by_id["top_logprobs"]:
        assert alt["bytes"] == list(tok.token_bytes(int(alt["token"].split(":")[1])))


def test_tokenizer_info_has_vllms_fields(url, handle):
    info = httpx.get(url + "/tokenizer_info", timeout=10).json()
    tok = handle.tokenizer
    assert info["tokenizer_class"] == tok.config["tokenizer_class"]
    assert info["eos_token"] == "<|im_end|>" and info["eos_token"] == tok.special_tokens["eos_token"]
    assert info["chat_template"] == tok.chat_template
    assert "vocab_file" not in info and "merges_file" not in info
    assert all(not isinstance(v, dict) or "content" not in v for v in info.values())
    # what lm-eval's remote tokenizer does with it: the eos id through /tokenize
    ids = post(url, "/tokenize", prompt=info["eos_token"], add_special_tokens=False)["tokens"]
    assert ids == [tok.token_to_id("<|im_end|>")]

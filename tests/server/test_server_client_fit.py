"""What clients (lm-eval, OpenAI's SDK) rely on, against the real engine (CPU, tiny random-weight Qwen3,
the real Qwen tokenizer): prompt scoring with max_tokens 0, the chosen token among the top logprobs,
a byte-fragment token's real bytes in chat logprobs, /tokenizer_info, vLLM's prompt_logprobs (per prompt
token a dict token id -> {logprob, rank, decoded_token}: the prompt token first at its rank, the top-k at
ranks 1..k). Oracle: transformers float32 and its tokenizer."""
from __future__ import annotations

import json

import httpx
import numpy as np
import openai
import pytest

from server.app import create_app
from server.background import BackgroundServer
from harness.models import F32_LOGPROB_TOL, hf_logits, log_softmax, tiny_model_path
from tests.tiny_engine import MODEL, tiny_handle

LOGPROB_TOL = F32_LOGPROB_TOL


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


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


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


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_tokenize_renders_the_tools_and_names_the_tokens_as_vllm_does(url, handle, path):
    """vLLM's /tokenize: a conversation's `tools` rendered by the chat template (so its count is the chat
    request's prompt_tokens) and, with return_token_strs, each token's vocabulary string."""
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "The weather in Paris?"}]
    want = list(hf_tok.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                           tokenize=True, return_dict=False))
    out = post(url, "/tokenize", messages=messages, tools=[WEATHER_TOOL], return_token_strs=True)
    assert out["tokens"] == want and out["count"] == len(want)
    assert out["token_strs"] == hf_tok.convert_ids_to_tokens(want)
    chat = post(url, "/v1/chat/completions", messages=messages, tools=[WEATHER_TOOL], max_tokens=1)
    assert chat["usage"]["prompt_tokens"] == len(want)
    text = post(url, "/tokenize", prompt="Hello world", return_token_strs=True)
    assert text["token_strs"] == hf_tok.convert_ids_to_tokens(hf_tok.encode("Hello world"))
    assert "token_strs" not in post(url, "/tokenize", prompt="Hello world")


def check_prompt_logprobs(plp: list, ids: list[int], k: int, path: str) -> None:
    from transformers import AutoTokenizer
    hf_tok = AutoTokenizer.from_pretrained(path)
    oracle = log_softmax(hf_logits(path, ids))
    assert len(plp) == len(ids) and plp[0] is None
    for pos in range(1, len(ids)):
        row, entry = oracle[pos - 1], plp[pos]
        token = str(ids[pos])
        assert list(entry)[0] == token                     # the prompt token first, as vLLM's dict has it
        mine = entry[token]
        assert abs(mine["logprob"] - row[ids[pos]]) <= LOGPROB_TOL
        lo, hi = np.count_nonzero(row > mine["logprob"] + LOGPROB_TOL) + 1, np.count_nonzero(row >= mine["logprob"] - LOGPROB_TOL)
        assert lo <= mine["rank"] <= hi                    # its rank: the tokens at least as likely
        assert mine["decoded_token"] == hf_tok.decode([ids[pos]])
        assert sorted(e["rank"] for e in entry.values())[:k] == list(range(1, k + 1))   # the top-k: ranks 1..k
        kth = np.sort(row)[-k] if k else np.inf
        for t, e in entry.items():
            assert abs(e["logprob"] - row[int(t)]) <= LOGPROB_TOL and e["decoded_token"] == hf_tok.decode([int(t)])
            assert t == token or row[int(t)] >= kth - LOGPROB_TOL  # each alternative among the k most likely
        assert len(entry) == k + (mine["rank"] > k)


@pytest.mark.parametrize("k", [0, 3])
def test_completion_prompt_logprobs_match_the_oracle(url, handle, path, k):
    ids = handle.tokenizer.encode("Colorless green ideas sleep furiously")
    out = sdk(url).completions.create(model=handle.model_name, prompt=ids, max_tokens=2, n=2, temperature=1.0, seed=1,
                                    extra_body={"prompt_logprobs": k})
    assert [c.model_extra["prompt_logprobs"] for c in out.choices] == [out.choices[0].model_extra["prompt_logprobs"]] * 2
    check_prompt_logprobs(out.choices[0].model_extra["prompt_logprobs"], ids, k, path)


def test_each_prompt_has_its_own_and_echo_keeps_its_k(url, handle, path):
    texts = ["The sky is", "A quick brown fox jumps"]
    out = sdk(url).completions.create(model=handle.model_name, prompt=texts, max_tokens=1, echo=True, logprobs=1,
                                    extra_body={"prompt_logprobs": 4})
    for choice, text in zip(out.choices, texts):
        ids = handle.tokenizer.encode(text)
        check_prompt_logprobs(choice.model_extra["prompt_logprobs"], ids, 4, path)
        assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs[1:])    # echo's: logprobs 1, + the token
    plain = sdk(url).completions.create(model=handle.model_name, prompt="The sky is", max_tokens=1)
    assert "prompt_logprobs" not in plain.choices[0].model_extra


def test_chat_prompt_logprobs_cover_the_rendered_prompt(url, handle, path):
    messages = [{"role": "user", "content": "Hello there"}]
    ids = post(url, "/tokenize", messages=messages)["tokens"]
    out = sdk(url).chat.completions.create(model=handle.model_name, messages=messages, max_tokens=1, extra_body={"prompt_logprobs": 1})
    check_prompt_logprobs(out.model_extra["prompt_logprobs"], ids, 1, path)


@pytest.mark.parametrize("body,param", [
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),      # vLLM: not with a stream (0 is fine)
    ({"prompt_logprobs": -1}, "prompt_logprobs"),                     # the whole vocabulary: not served
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
])
def test_prompt_logprobs_refusals(url, body, param):
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param
    ok = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 1, "prompt_logprobs": 0,
                                                          "stream": True})
    assert ok.status_code == 200 and ok.text.endswith("data: [DONE]\n\n")

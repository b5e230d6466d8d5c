"""Request parsing edge cases: vLLM extras that would change the result are refused, not ignored."""
import pytest

from fake_executor import FakeTokenizer
from server.errors import APIError
from server.protocol import ModelInfo, parse_completion

MODEL = ModelInfo(name="m", max_model_len=128, tokenizer=FakeTokenizer(), vocab_size=FakeTokenizer.vocab_size)


@pytest.mark.parametrize("field,value", [
    ("include_stop_str_in_output", True),
    ("allowed_token_ids", [1, 2]),
    ("bad_words", ["x"]),
    ("truncate_prompt_tokens", 4),
])
def test_result_changing_vllm_extras_are_a_400_naming_the_field(field, value):
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": "hello", field: value}, MODEL)
    assert err.value.status == 400 and err.value.param == field
    # their defaults change nothing and are accepted
    harmless = {"include_stop_str_in_output": False, "allowed_token_ids": None, "bad_words": [],
                "truncate_prompt_tokens": None}[field]
    parse_completion({"prompt": "hello", field: harmless}, MODEL)


def test_token_id_prompts_are_decoded_only_for_echo():
    """A token-id prompt's text is needed for echo alone: decoding a 16k-token prompt cost 10 ms of every
    such request. The ids still pass the range check (a bad id is named)."""

    class CountingTokenizer(FakeTokenizer):
        calls = 0

        def decode(self, ids, *a, **kw):
            CountingTokenizer.calls += 1
            return super().decode(ids, *a, **kw)

    model = ModelInfo(name="m", max_model_len=128, tokenizer=CountingTokenizer(), vocab_size=FakeTokenizer.vocab_size)
    ids = [5, 6, 7, 8]
    parsed = parse_completion({"model": "m", "prompt": [ids, ids], "max_tokens": 2}, model)
    assert [p.tolist() for p in parsed.prompts] == [ids, ids] and parsed.echo_texts == [] and CountingTokenizer.calls == 0
    parsed = parse_completion({"model": "m", "prompt": ids, "max_tokens": 2, "echo": True}, model)
    assert parsed.echo_texts == [FakeTokenizer().decode(ids)] and CountingTokenizer.calls == 1
    with pytest.raises(APIError, match="token id 100000 outside"):
        parse_completion({"model": "m", "prompt": [1, 100000, -1], "max_tokens": 2}, model)
    with pytest.raises(APIError, match="token id -3 outside"):
        parse_completion({"model": "m", "prompt": [1, -3], "max_tokens": 2}, model)
    with pytest.raises(APIError, match="prompt"):
        parse_completion({"model": "m", "prompt": [1, True], "max_tokens": 2}, model)
    with pytest.raises(APIError, match="token id 1180591620717411303424 outside"):    # past 64 bits
        parse_completion({"model": "m", "prompt": [1, 2 ** 70], "max_tokens": 2}, model)
    with pytest.raises(APIError, match="prompt"):
        parse_completion({"model": "m", "prompt": [[1, 2], [3, 4.5]], "max_tokens": 2}, model)
    parsed = parse_completion({"model": "m", "prompt": [[1, 2], [3, 4.0]], "max_tokens": 2}, model)   # JSON Schema's
    assert [p.tolist() for p in parsed.prompts] == [[1, 2], [3, 4]]                                  # integer

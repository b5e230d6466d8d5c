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

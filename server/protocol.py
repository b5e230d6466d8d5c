"""Request parsing and validation: an OpenAI / vLLM JSON body -> prompts + SamplingParams.

Every refusal is an APIError naming the field and its allowed range: 422 for a wrong JSON type or a
missing required field, 400 for a value out of range, past a ServerLimits cap, or a feature this
server does not provide. Parsing tokenizes, so the server runs it off its event loop.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from engine.detokenizer import stop_matcher
from engine.request import ParamRangeError, SamplingParams
from server.errors import APIError, invalid, wrong_type
from server.fields import Fields, all_ints, check_token_ids, token_id_array
from server.limits import ServerLimits
from server.reasoning import Reasoning, request_reasoning
from server.structured import Constraint, parse_constraint
from server.tools import ToolConfig, message_extras, output_constraint, parse_tools

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5             # a temperature this small samples greedily (as vLLM does)
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Fields that would change the result in ways this server does not implement: refused, never ignored.
# Each maps to the value(s) that are harmless (the default), checked with `_is_harmless`.
UNSUPPORTED_FIELDS = {
    "suffix": (None, ""),
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "functions": (None, []),
    "prompt_embeds": (None,),
    "continue_final_message": (None, False),
    "lora_request": (None,),
    "include_stop_str_in_output": (None, False),
    "allowed_token_ids": (None,),
    "bad_words": (None, []),
    "truncate_prompt_tokens": (None,),
}
CHAT_ONLY_HARMLESS = {"echo": (None, False)}
# Template variables the server sets itself: chat_template_kwargs may not name them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")


@dataclass
class ModelInfo:
    """What validation needs to know about the served model."""
    name: str
    max_model_len: int
    tokenizer: TokenizerBase
    vocab_size: int | None = None
    max_n: int = 16
    limits: ServerLimits = field(default_factory=ServerLimits)
    max_token_bytes: int | None = None          # the most bytes of text one token covers

    @property
    def max_text_chars(self) -> int | None:
        """A longer text cannot fit max_model_len tokens (a character is at least a byte)."""
        return self.max_model_len * self.max_token_bytes if self.max_token_bytes else None
    adapters: dict[str, str] = field(default_factory=dict)   # LoRA adapters served now: name -> path
    reasoning_parser: str | None = None         # --reasoning-parser (server/reasoning.py)


@dataclass
class ParsedRequest:
    """A validated request: one or more prompts, each generated with the same params (n samples each)."""
    kind: str                                   # "completion" | "chat"
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False              # vLLM's continuous_usage_stats: each chunk its choice's usage
    echo: bool = False
    echo_texts: list[str] = field(default_factory=list)   # per prompt, when echo
    logprobs: int | None = None                 # top-k alternatives to report; None: no logprobs
    tokens_as_ids: bool = False                 # logprobs name tokens "token_id:<id>" (vLLM extra)
    user: str | None = None
    prompt_only: bool = False                   # echo with max_tokens 0: the prompt (scored), nothing generated
    constraint: Constraint | None = None        # structured output (params.grammar is its grammar)
    tools: ToolConfig | None = None             # chat tools: the output's tool calls are parsed
    lora_name: str | None = None                # the LoRA adapter the 'model' field names (None: the base)
    prompt_logprobs: int | None = None          # vLLM's prompt_logprobs: top-k per prompt token (None: not asked)
    reasoning: Reasoning | None = None          # chat with a reasoning parser: where the output's thinking is
    request_fields: dict = field(default_factory=dict)   # what the response repeats of the request (Responses API)


def parse_completion(body: dict, model: ModelInfo) -> ParsedRequest:
    """POST /v1/completions."""
    f = Fields(body)
    lora_name = _check_common(f, model, chat=False)
    echo = f.boolean("echo", False)
    prompts, texts = _completion_prompts(body.get("prompt"), model, echo)
    logprobs = f.integer("logprobs", None, 0, MAX_LOGPROBS)
    max_tokens = _max_tokens(f, model, prompts, 16, allow_zero=echo)
    params = _sampling_params(f, model, max_tokens)
    params.logprobs = logprobs
    prompt_logprobs = _prompt_logprobs(f, params, logprobs if echo else None)
    for key in ("tools", "tool_choice"):
        if body.get(key) not in (None, []):
            raise invalid(f"'{key}' is only supported on /v1/chat/completions", key)
    constraint = parse_constraint(body)
    params.grammar = constraint.grammar if constraint else None
    return ParsedRequest("completion", prompts, params, **_stream_fields(f), echo=echo,
                         echo_texts=texts if echo else [], logprobs=logprobs, user=f.string("user"),
                         tokens_as_ids=f.boolean("return_tokens_as_token_ids", False),
                         prompt_only=max_tokens == 0, constraint=constraint, lora_name=lora_name,
                         prompt_logprobs=prompt_logprobs)


def parse_chat(body: dict, model: ModelInfo) -> ParsedRequest:
    """POST /v1/chat/completions: the messages rendered through the model's chat template."""
    f = Fields(body)
    lora_name = _check_common(f, model, chat=True)
    ids, tools = conversation_ids(body, f, model)
    prompt = np.array(ids, np.int32)
    want_logprobs = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", None, 0, MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise invalid("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    params = _sampling_params(f, model, _max_tokens(f, model, [prompt], None))
    params.logprobs = logprobs
    prompt_logprobs = _prompt_logprobs(f, params, None)
    constraint = output_constraint(body, tools)
    params.grammar = constraint.grammar if constraint else None
    reasoning = request_reasoning(model.reasoning_parser, model.tokenizer, prompt, constraint is not None,
                                  f.boolean("include_reasoning", True))
    return ParsedRequest("chat", [prompt], params, **_stream_fields(f), logprobs=logprobs, user=f.string("user"),
                         tokens_as_ids=f.boolean("return_tokens_as_token_ids", False), constraint=constraint,
                         tools=tools if tools and tools.parse else None, lora_name=lora_name,
                         prompt_logprobs=prompt_logprobs, reasoning=reasoning)


def conversation_ids(body: dict, f: Fields, model: ModelInfo) -> tuple[list[int], ToolConfig | None]:
    """A chat body's prompt ids (its messages, tools and template variables through the chat template) and its
    tools: what /v1/chat/completions runs and /tokenize counts."""
    messages = parse_messages(body.get("messages"))
    add_generation_prompt = f.boolean("add_generation_prompt", True)
    tools = parse_tools(body, model.tokenizer)
    ids = render_chat(model.tokenizer, messages, add_generation_prompt, tools.template_tools if tools else None,
                      model.max_text_chars, template_kwargs(f))
    return ids, tools


def parse_messages(messages) -> list[dict]:
    """Validate chat messages; content may be a string or a list of text parts (joined by newlines)."""
    if messages is None:
        raise wrong_type("'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list of message objects", "messages")
    out = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise wrong_type(f"'{where}' must be an object with 'role' and 'content'", where)
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise invalid(f"'{where}.role' must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                          f"{where}.role")
        out.append({"role": role, "content": _message_text(msg.get("content"), role, where),
                    **message_extras(msg, where)})
    return out


def render_chat(tokenizer: TokenizerBase, messages: list[dict], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, max_chars: int | None = None,
                template_kwargs: dict | None = None) -> list[int]:
    """Prompt ids of a conversation (and the tools offered, and the template's own variables: vLLM's
    chat_template_kwargs); a template that refuses it (e.g. roles that must alternate, or no template at
    all) is the request's problem: 400 naming `messages`, as is a conversation of more than max_chars
    characters (refused before it is tokenized)."""
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    try:
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as exc:
        raise invalid(f"'messages' could not be rendered by the model's chat template: {exc}",
                      "messages") from None
    if isinstance(rendered, str):
        check_text_fits(rendered, max_chars, "messages")
        return encode_text(tokenizer, rendered, add_special_tokens=False)
    return list(rendered)


def template_kwargs(f: Fields) -> dict:
    """vLLM's chat_template_kwargs: variables for the chat template (e.g. Qwen3's enable_thinking)."""
    kwargs = f.raw("chat_template_kwargs", {})
    if not isinstance(kwargs, dict):
        raise wrong_type("'chat_template_kwargs' must be an object of template variables", "chat_template_kwargs")
    reserved = [k for k in RESERVED_TEMPLATE_KWARGS if k in kwargs]
    if reserved:
        raise invalid(f"'chat_template_kwargs' may not set {reserved[0]!r}: the request's own fields give it",
                      "chat_template_kwargs")
    return kwargs


def check_text_fits(text: str, max_chars: int | None, name: str) -> None:
    """Refuse, without tokenizing it, a text too long to fit max_model_len (ModelInfo.max_text_chars)."""
    if max_chars is not None and len(text) > max_chars:
        raise invalid(f"'{name}' has {len(text)} characters, more than the model's context length "
                      f"(max_model_len) can hold in any tokenization (at most {max_chars})", name)


def encode_text(tokenizer: TokenizerBase, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; a rendered chat template already carries its special tokens."""
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _message_text(content, role: str, where: str) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise wrong_type(f"'{where}.content' is required for role {role!r}", f"{where}.content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(f"'{where}.content[{j}]' must be a text part "
                              "{\"type\": \"text\", \"text\": ...}; only text content is supported",
                              f"{where}.content")
            parts.append(part["text"])
        return "\n".join(parts)            # as vLLM renders a message of text parts for the template
    raise wrong_type(f"'{where}.content' must be a string or a list of text parts", f"{where}.content")


def _completion_prompts(prompt, model: ModelInfo, echo: bool) -> tuple[list[list[int]], list[str]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids; with `echo`, each
    prompt's text too (token ids are decoded only then: 10 ms for a 16k-token prompt)."""
    if prompt is None:
        raise wrong_type("'prompt' is required", "prompt")
    if isinstance(prompt, str):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all_ints(prompt):
        items = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        items = prompt
    elif (isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt)
          and all(all_ints(p) for p in prompt)):
        items = prompt
    else:
        raise wrong_type("'prompt' must be a string, a list of strings, a list of token ids, "
                         "or a list of lists of token ids (non-empty)", "prompt")
    if len(items) > model.limits.max_prompts:
        raise invalid(f"'prompt' is a list of {len(items)} prompts; at most {model.limits.max_prompts} "
                      "are accepted in one request", "prompt")
    prompts, texts = [], []
    for item in items:
        if isinstance(item, str):
            check_text_fits(item, model.max_text_chars, "prompt")
            ids = np.array(encode_text(model.tokenizer, item), np.int32)     # travels as an array (fields.py)
            texts.append(item)
        else:
            ids = token_id_array(item, model.vocab_size, "prompt")
            if echo:
                texts.append(model.tokenizer.decode(ids.tolist()))
        if len(ids) == 0:
            raise invalid("'prompt' must not be empty", "prompt")
        prompts.append(ids)
    return prompts, texts


def _max_tokens(f: Fields, model: ModelInfo, prompts: list[list[int]], default: int | None,
                allow_zero: bool = False) -> int:
    """max_tokens (or max_completion_tokens), checked against the room the longest prompt leaves;
    0 (score the prompt, generate nothing) only where allow_zero (completions with echo)."""
    longest = max(len(p) for p in prompts)
    room = model.max_model_len - longest
    if room < 1:
        raise invalid(f"'prompt' has {longest} tokens; the model's context length (max_model_len) is "
                      f"{model.max_model_len}, leaving no room to generate", "prompt")
    name = "max_completion_tokens" if f.raw("max_completion_tokens") is not None else "max_tokens"
    lo = 0 if allow_zero else 1
    max_tokens = f.integer(name, default, lo, None, ">= 0 (0 with echo)" if allow_zero else ">= 1 (0 only with echo)")
    if max_tokens is None:
        max_tokens = room
    if longest + max_tokens > model.max_model_len:
        raise invalid(f"prompt ({longest} tokens) + '{name}' ({max_tokens}) = {longest + max_tokens} "
                      f"exceeds the model's context length (max_model_len) of {model.max_model_len}; "
                      f"'{name}' must be in [{lo}, {room}]", name)
    return max_tokens


def _sampling_params(f: Fields, model: ModelInfo, max_tokens: int) -> SamplingParams:
    """The sampling fields; max_tokens 0 (prompt only) runs as 1 generated token the server drops."""
    top_k = f.integer("top_k", -1, -1, None, "-1 (off) or >= 1")
    if top_k == 0:
        top_k = -1
    temperature = f.number("temperature", 1.0)
    if 0 < temperature < GREEDY_BELOW:
        temperature = 0.0
    params = SamplingParams(
        temperature=temperature,
        top_p=f.number("top_p", 1.0),
        top_k=top_k,
        min_p=f.number("min_p", 0.0),
        seed=f.integer("seed", None, -(2 ** 63), 2 ** 64 - 1),
        presence_penalty=f.number("presence_penalty", 0.0),
        frequency_penalty=f.number("frequency_penalty", 0.0),
        repetition_penalty=f.number("repetition_penalty", 1.0),
        logit_bias=_logit_bias(f, model),
        max_tokens=max(max_tokens, 1),
        min_tokens=f.integer("min_tokens", 0, 0, max_tokens, f"in [0, max_tokens={max_tokens}]"),
        ignore_eos=f.boolean("ignore_eos", False),
        stop=_stop_strings(f, model.limits),
        stop_token_ids=_stop_token_ids(f, model),
        n=f.integer("n", 1, 1, model.max_n),
        skip_special_tokens=f.boolean("skip_special_tokens", True),
    )
    try:
        params.validate()              # the value ranges are the contract's: "<field> must be ..."
    except ParamRangeError as exc:
        raise invalid(f"'{exc.name}' {exc.rule}, got {exc.value}", exc.name) from None
    stop_matcher(params.stop)          # built here, off the engine thread, for the engine's detokenizer
    return params


def _prompt_logprobs(f: Fields, params: SamplingParams, echo_logprobs: int | None) -> int | None:
    """vLLM's prompt_logprobs (top-k of each prompt token's distribution; not with a stream, as vLLM); the
    engine computes the larger of it and echo's logprobs."""
    k = f.integer("prompt_logprobs", None, 0, MAX_LOGPROBS,
                  f"in [0, {MAX_LOGPROBS}] (-1, the whole vocabulary, is not served)")
    if k is not None and f.boolean("stream", False):
        if k > 0:
            raise invalid("'prompt_logprobs' are not available with 'stream'", "prompt_logprobs")
        k = None
    wanted = [n for n in (k, echo_logprobs) if n is not None]
    params.prompt_logprobs = max(wanted) if wanted else None
    return k


def _stop_strings(f: Fields, limits: ServerLimits) -> list[str]:
    stop = f.strings("stop")
    if len(stop) > limits.max_stop_strings:
        raise invalid(f"'stop' has {len(stop)} strings; at most {limits.max_stop_strings} are accepted", "stop")
    longest = max(stop, key=len, default="")
    if len(longest) > limits.max_stop_chars:
        raise invalid(f"'stop' has a string of {len(longest)} characters; at most {limits.max_stop_chars} "
                      "are accepted", "stop")
    return stop


def _stop_token_ids(f: Fields, model: ModelInfo) -> list[int]:
    ids = f.token_ids("stop_token_ids", model.vocab_size)
    if len(ids) > model.limits.max_stop_token_ids:
        raise invalid(f"'stop_token_ids' has {len(ids)} ids; at most {model.limits.max_stop_token_ids} are "
                      "accepted", "stop_token_ids")
    return ids


def _logit_bias(f: Fields, model: ModelInfo) -> dict[int, float]:
    value = f.raw("logit_bias", {})
    if not isinstance(value, dict):
        raise wrong_type("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    if len(value) > model.limits.max_logit_bias:
        raise invalid(f"'logit_bias' has {len(value)} entries; at most {model.limits.max_logit_bias} "
                      "are accepted", "logit_bias")
    bias = {}
    for key, b in value.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise invalid(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        check_token_ids([token], model.vocab_size, "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not -100 <= b <= 100:
            raise invalid(f"'logit_bias' values must be numbers in [-100, 100], got {b!r}", "logit_bias")
        bias[token] = float(b)
    return bias


def check_model_name(f: Fields, model: ModelInfo) -> str | None:
    """`model`, where given, must name the served model or one of its LoRA adapters; returns the
    adapter it names, if any."""
    name = f.string("model")
    if name is not None and name != model.name and name not in model.adapters:
        served = ", ".join(f"'{n}'" for n in [model.name, *model.adapters])
        raise APIError(404, f"model '{name}' does not exist; this server serves {served}",
                       "model", "model_not_found")
    return name if name is not None and name != model.name else None


def _check_common(f: Fields, model: ModelInfo, chat: bool) -> str | None:
    """Refuse what this server does not do; returns the LoRA adapter the 'model' field names, if any."""
    lora_name = check_model_name(f, model)
    refused = dict(UNSUPPORTED_FIELDS, **(CHAT_ONLY_HARMLESS if chat else {}))
    for key, harmless in refused.items():
        if key in f.body and not _is_harmless(f.body[key], harmless):
            raise invalid(f"'{key}' is not supported by this server (got {_short(f.body[key])})", key)
    return lora_name


def _stream_fields(f: Fields) -> dict:
    """stream, and stream_options' usage: include_usage (OpenAI's; vLLM's continuous_usage_stats, which
    without include_usage implies it) -- options refused without stream, as OpenAI and vLLM do."""
    stream = f.boolean("stream", False)
    opts = f.raw("stream_options", None)
    opts = {} if opts is None else opts
    if not isinstance(opts, dict):
        raise wrong_type("'stream_options' must be an object", "stream_options")
    if opts and not stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")
    options = Fields(opts)
    continuous = options.boolean("continuous_usage_stats", False)
    include = options.boolean("include_usage", continuous)
    return {"stream": stream, "include_usage": include, "continuous_usage": include and continuous}


def _is_harmless(value, harmless: tuple) -> bool:
    return any(value == h and type(value) is type(h) for h in harmless if h is not None) or value is None




def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."

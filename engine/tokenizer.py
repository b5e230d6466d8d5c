"""Tokenizer: a `tokenizers` BPE plus the model folder's special tokens, eos ids and chat template
(rendered with jinja2 the way transformers' `apply_chat_template` does)."""
from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from engine.model_files import ModelLoadError, read_json_object

SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")      # SentencePiece byte-fallback tokens


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE: the printable character that stands for each byte, inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


BYTE_LEVEL_CHARS = _byte_level_alphabet()


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask markers) render their body as is."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):             # {"content": "<s>", ...} (AddedToken serialization)
        return value.get("content")
    return value


def _plain(value: Any) -> Any:
    """A tokenizer_config value with every AddedToken serialization replaced by its text."""
    if isinstance(value, dict):
        return value["content"] if "content" in value else {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


class TokenizerBase:
    """What the engine and the server ask of every tokenizer they load (a model folder's `Tokenizer`, the
    GGUF conversion's, a test's stand-in), declared once: a part a tokenizer lacks keeps its default here,
    so callers read it instead of probing for it."""
    vocab_size: int | None = None           # ids are below it (None: not known)
    eos_token_ids: Sequence[int] = ()       # the ids that end a generation
    chat_template: str | None = None        # the Jinja source (None: the model has none)
    max_token_bytes: int | None = None      # the most bytes of text one token covers (None: not known)
    tok: HFTokenizer | None = None          # the `tokenizers` tokenizer grammars compile over (None: no grammars)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """The prompt text of a conversation; ValueError where the model has no template or refuses it."""
        raise ValueError("this model has no chat template (tokenizer_config.json / chat_template.jinja)")

    def token_bytes(self, token_id: int) -> bytes | None:
        """The bytes one token stands for (None: not known; its decoded text is all there is)."""
        return None

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """Each id's vocabulary string (HF's convert_ids_to_tokens); here, where there is no vocabulary, its text."""
        return [self.decode([i]) for i in ids]

    def has_marker_tokens(self, *markers: str) -> bool:
        """Whether each marker (reasoning's `<think>`) is one token of the vocabulary, as in a model trained
        to write it; True where the tokenizer names no tokens (a byte tokenizer writes any text)."""
        return True

    def info(self) -> dict[str, Any] | None:
        """tokenizer_config.json as a client reads it (vLLM's /tokenizer_info); None: nothing to describe."""
        return None


class Tokenizer(TokenizerBase):
    def __init__(self, tokenizer: HFTokenizer, tokenizer_config: dict | None = None,
                 chat_template: str | None = None, eos_token_ids: list[int] | None = None):
        self.tok = tokenizer
        self.config = tokenizer_config or {}
        self.special_tokens = {k: _token_text(self.config.get(k)) for k in SPECIAL_KEYS}
        template = chat_template or self.config.get("chat_template")
        if isinstance(template, list):      # [{"name": "default", "template": ...}, ...]
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = template
        eos = list(eos_token_ids or [])
        if self.eos_token_id is not None and self.eos_token_id not in eos:
            eos.append(self.eos_token_id)
        self.eos_token_ids: list[int] = eos

    @classmethod
    def from_folder(cls, folder: str, generation_config: dict | None = None) -> "Tokenizer":
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tokenizer.json not found in {folder}")
        config = read_json_object(os.path.join(folder, "tokenizer_config.json"), required=False)
        for key, value in read_json_object(os.path.join(folder, "special_tokens_map.json"), required=False).items():
            if key in SPECIAL_KEYS and config.get(key) is None:
                config[key] = value
        template_path = os.path.join(folder, "chat_template.jinja")
        template = None
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        eos = (generation_config or {}).get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        try:
            tok = HFTokenizer.from_file(path)
        except Exception as e:              # the tokenizers library raises a bare Exception
            raise ModelLoadError(f"{path}: not a tokenizer the tokenizers library reads ({e})") from None
        return cls(tok, config, template, eos_ids)

    # --- ids <-> text -----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def _special_id(self, key: str) -> int | None:
        text = self.special_tokens.get(key)
        return None if text is None else self.tok.token_to_id(text)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (special-token strings in it map to their ids). As in transformers,
        add_special_tokens applies the tokenizer's post-processor (e.g. a BOS for Llama 3); pass
        False for text rendered by a chat template, which writes its own. (encode_batch: the same
        ids, but it lets other Python threads run meanwhile, which a long text needs; a long text of a
        known tokenizer is cut into parts encoded in parallel, engine/text_pieces.py.)"""
        if self._splitter is not None:
            ids = self._splitter.encode(text, add_special_tokens)
            if ids is not None:
                return ids
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    @cached_property
    def _splitter(self):
        """Long texts cut where the pre-tokenizer cuts and encoded on all cores (engine/text_pieces.py),
        where that is known to give the same ids; else None."""
        from engine.text_pieces import splitter
        return splitter(self.tok)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        try:  # ints (and numpy ints) go straight through; anything int()-able is converted first
            return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        except TypeError:
            return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tok.id_to_token(int(token_id))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def has_marker_tokens(self, *markers: str) -> bool:
        return all(self.tok.token_to_id(m) is not None for m in markers)

    def is_special(self, token_id: int) -> bool:
        added = self.tok.get_added_tokens_decoder().get(int(token_id))
        return bool(added is not None and added.special)

    @cached_property
    def _added_ids(self) -> frozenset[int]:
        return frozenset(self.tok.get_added_tokens_decoder())

    @cached_property
    def _byte_level(self) -> bool:
        decoder = self.tok.decoder
        if isinstance(decoder, decoders.ByteLevel):
            return True
        return decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode(errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, also where it is only part of a UTF-8 character (its
        decoded text is then U+FFFD)."""
        piece = self.tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if int(token_id) not in self._added_ids:
            if self._byte_level and all(c in BYTE_LEVEL_CHARS for c in piece):
                return bytes(BYTE_LEVEL_CHARS[c] for c in piece)
            if m := _BYTE_PIECE.fullmatch(piece):
                return bytes([int(m.group(1), 16)])
            if not self._byte_level:
                return piece.replace("\u2581", " ").encode()
        return piece.encode()

    @cached_property
    def max_token_bytes(self) -> int:
        """An upper bound on the bytes of text one token covers: a text of more than
        max_model_len * max_token_bytes bytes has more than max_model_len tokens."""
        vocab = self.tok.get_vocab(with_added_tokens=True)
        return max((len(self.token_bytes(i)) for i in vocab.values()), default=1) or 1

    def info(self) -> dict[str, Any]:
        """tokenizer_config.json as a client reads it (vLLM's /tokenizer_info): the special tokens
        as text, the tokenizer class and the chat template."""
        config = {k: _plain(v) for k, v in self.config.items() if k not in ("vocab_file", "merges_file")}
        config.update(self.special_tokens)
        config["tokenizer_class"] = self.config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        if self.chat_template:
            config["chat_template"] = self.chat_template
        return config

    # --- chat ---------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **kwargs: Any) -> str:
        """Render a conversation to the prompt text, as transformers' apply_chat_template(tokenize=False)."""
        if not self.chat_template:
            raise ValueError("this model has no chat template (tokenizer_config.json / chat_template.jinja)")
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts, got {m!r}")
        variables = {k: v for k, v in self.special_tokens.items() if v is not None}
        variables.update(kwargs)
        return compile_chat_template(self.chat_template).render(
            messages=messages, tools=tools, documents=documents,
            add_generation_prompt=add_generation_prompt, **variables)

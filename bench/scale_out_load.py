"""The scale-out benchmark's load: multi-turn conversations, and what their follow-up turns cost.

Each of U users holds one conversation of T turns; the users share S system prompts (user u the u % S-th),
each of exactly --system-tokens tokens. A turn appends "\\n\\nUser: <message>\\n\\nAssistant:" (the message
exactly --user-tokens tokens of random text) to the conversation so far, streams a completion of exactly
--output-tokens tokens (ignore_eos; logprobs naming the token ids), and appends the reply's text: the history
grows by every turn's message and reply. A user thinks before each turn (its first too, so the users start
spread out): a random time, exponential with a mean of --think-ms (seeded per user), after its previous reply
ended — a closed loop. Every turn of a conversation carries its session id in the `x-session-id` header (the
header vllm-router's kv_aware session affinity keys on; a server or router without affinity ignores it). Without think time the users move in lockstep, and a round-robin router over R replicas
then sends every turn of a user to one replica whenever R divides the number of users.

Per turn: TTFT (request sent -> first token), prompt tokens and cached tokens (usage.prompt_tokens_details),
the reply's token ids. A follow-up turn's ideal hit is what its previous turn left in the KV cache, the
previous prompt and its reply but the reply's last token (whose KV is never computed), in whole 16-token
blocks, as far as this prompt's tokens equal them (the server's /tokenize of this prompt; a reply's text
need not tokenize back into its ids), and at most this prompt's length - 1: what one replica holding
everything would hit.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import numpy as np

from bench.common import auth_headers, make_client, send_request
from bench.common_data import allowed_token_ids, exact_length_prompt
from memory.kv_pool import BLOCK_SIZE

SESSION_HEADER = "x-session-id"


@dataclass
class Turn:
    user: int
    turn: int                       # 0 = the first
    prompt: str
    sent: float = 0.0               # perf_counter() when it was sent
    ttft: float = 0.0               # seconds
    latency: float = 0.0            # sent -> its last token
    prompt_tokens: int = 0
    cached: int = 0
    output_ids: list[int] = field(default_factory=list)
    ideal: int = 0
    error: str = ""


@dataclass
class Workload:
    """The issue's scale by default: 64 users x 6 turns, 2k-token shared system prompts."""
    users: int = 64
    turns: int = 6                  # per user
    system_prompts: int = 4         # shared: user u has the (u % system_prompts)-th
    system_tokens: int = 2048       # each system prompt's length
    user_tokens: int = 192          # each message's length
    output_tokens: int = 128        # each reply's length
    seed: int = 0                   # of the texts and the pauses
    think_ms: int = 1000            # the mean of a user's pause before each turn


def texts(tokenizer, w: Workload) -> tuple[list[str], list[list[str]]]:
    """(the system prompts, each user's messages), random text of exact token lengths, from w.seed."""
    rng = np.random.default_rng(w.seed)
    allowed = allowed_token_ids(tokenizer)

    def text(n: int) -> str:
        return exact_length_prompt(tokenizer, rng.choice(allowed, n).tolist(), allowed, rng)[0]
    systems = [text(w.system_tokens) for _ in range(w.system_prompts)]
    return systems, [[text(w.user_tokens) for _ in range(w.turns)] for _ in range(w.users)]


async def run_conversations(url: str, model: str, systems: list[str], messages: list[list[str]],
                            w: Workload, api_key: str | None = None) -> list[Turn]:
    """Every user's conversation through `url`; the turns in order of (user, turn)."""
    client, headers = make_client(url), auth_headers(api_key)
    output_tokens = w.output_tokens

    async def user(u: int) -> list[Turn]:
        history, done = systems[u % len(systems)], []
        session = {**headers, SESSION_HEADER: f"conversation-{w.seed}-{u}"}
        pauses = np.random.default_rng((w.seed, u)).exponential(w.think_ms / 1000, len(messages[u]))
        for k, message in enumerate(messages[u]):
            await asyncio.sleep(pauses[k])
            turn = Turn(u, k, f"{history}\n\nUser: {message}\n\nAssistant:")
            payload = {"model": model, "prompt": turn.prompt, "max_tokens": output_tokens, "min_tokens": output_tokens,
                       "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
                       "logprobs": 0, "return_tokens_as_token_ids": True}
            r = await send_request(client, "/v1/completions", payload, 0, session)
            turn.sent, turn.ttft, turn.latency, turn.prompt_tokens = r.start_time, r.ttft, r.latency, r.prompt_len
            turn.cached, turn.output_ids, turn.error = r.cached_tokens or 0, r.token_ids, r.error
            done.append(turn)
            if r.error:
                break
            history = turn.prompt + r.generated_text
        return done
    try:
        per_user = await asyncio.gather(*(user(u) for u in range(len(messages))))
    finally:
        await client.aclose()
    return [t for turns in per_user for t in turns]


async def fill_ideal(url: str, model: str, turns: list[Turn], api_key: str | None = None) -> None:
    """Each follow-up turn's ideal hit, from the server's tokens of its prompt and of the previous one."""
    client, headers = make_client(url), auth_headers(api_key)

    async def tokens(text: str) -> list[int]:
        async with client.request("POST", "/tokenize", {"model": model, "prompt": text}, headers) as r:
            return json.loads(await r.read())["tokens"]
    try:
        previous: dict[int, tuple[list[int], Turn]] = {}
        for t in sorted(turns, key=lambda t: (t.user, t.turn)):
            ids = await tokens(t.prompt)
            if t.turn > 0 and t.user in previous:
                before, last = previous[t.user]
                t.ideal = ideal_hit(ids, before + last.output_ids[:-1])
            previous[t.user] = (ids, t)
    finally:
        await client.aclose()


def ideal_hit(prompt: list[int], cached: list[int]) -> int:
    """Tokens of `prompt` a cache holding `cached` (whole blocks of it) can serve: their common prefix, in whole
    blocks, leaving at least one token of the prompt to compute."""
    n = min(len(prompt) - 1, len(cached))
    a, b = np.asarray(prompt[:n]), np.asarray(cached[:n])
    diff = np.flatnonzero(a != b)
    common = int(diff[0]) if diff.size else n
    return common // BLOCK_SIZE * BLOCK_SIZE


def summary(turns: list[Turn]) -> dict:
    """Follow-up turns' TTFT p50 / p90 (ms), their cache-hit rate, the ideal one, and the hit over the ideal;
    first turns' TTFT p50 for reference."""
    ok = [t for t in turns if not t.error]
    follow = [t for t in ok if t.turn > 0]
    firsts = [t for t in ok if t.turn == 0]

    def ms(values: list[float], q: float) -> float | None:
        return round(float(np.percentile(values, q)) * 1000, 1) if values else None
    prompt = sum(t.prompt_tokens for t in follow)
    cached, ideal = sum(t.cached for t in follow), sum(t.ideal for t in follow)
    return {"turns": len(turns), "errors": len(turns) - len(ok), "follow_up_turns": len(follow),
            "follow_up_ttft_p50_ms": ms([t.ttft for t in follow], 50),
            "follow_up_ttft_p90_ms": ms([t.ttft for t in follow], 90),
            "first_turn_ttft_p50_ms": ms([t.ttft for t in firsts], 50),
            "follow_up_prompt_tokens": prompt, "follow_up_cached_tokens": cached, "follow_up_ideal_tokens": ideal,
            "hit_rate": round(cached / prompt, 4) if prompt else None,
            "ideal_hit_rate": round(ideal / prompt, 4) if prompt else None,
            "hit_over_ideal": round(cached / ideal, 4) if ideal else None,
            "wall_s": round(max(t.sent + t.latency for t in ok) - min(t.sent for t in ok), 2) if ok else None}

"""A deterministic stand-in model for engine tests: it really uses the paged KV layout.

Each step writes every fed token id into its KV slot (block_table[p // 16] * 16 + p % 16);
the logits at position p are a pseudo-random vector seeded by a hash of the whole context
read back through the block table. A wrong block table, a stale or shared-and-overwritten
block, or a missing token changes the logits, so engine bugs change the output.
The tokenizer is byte-level with a few multi-byte and special tokens.
"""
from __future__ import annotations

import numpy as np

from engine.batch import BLOCK_SIZE, ModelBatch, PromptLogprobResult, StepOutput
from engine.executor.base import ExecutorBase
from engine.executor.options import ExecutorOptions
from engine.sampling import prompt_logprobs, sample_step
from engine.tokenizer import TokenizerBase

EOS = 256
EXTRA = {257: "é".encode(), 258: b"ab", 259: "€".encode()[:2], 260: "€".encode()[2:], 261: b" the"}
VOCAB = 262


class FakeTokenizer(TokenizerBase):
    eos_token_ids = [EOS]
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = b""
        for t in ids:
            if t < 256:
                out += bytes([t])
            elif t == EOS:
                out += b"" if skip_special_tokens else b"</s>"
            else:
                out += EXTRA[t]
        return out.decode("utf-8", errors="replace")


# Limits well above what the engine tests ask for (the engine takes its own from EngineConfig).
FAKE_OPTIONS = ExecutorOptions().replace(max_model_len=1 << 16, max_num_batched_tokens=1 << 16, max_num_seqs=1024)


class FakeExecutor(ExecutorBase):
    supports_host_tier = True
    supports_block_copies = True
    supports_draft_verify = True        # sample_step verifies draft rows

    def __init__(self, num_kv_blocks: int = 64, vocab_size: int = VOCAB, scale: float = 4.0,
                 fail_on_token: int | None = None, host_kv_blocks: int = 0):
        self.options = FAKE_OPTIONS.replace(host_kv_blocks=host_kv_blocks)
        self.host = np.full((host_kv_blocks, BLOCK_SIZE), -1, dtype=np.int64)
        self.num_kv_blocks = num_kv_blocks
        self.vocab_size = vocab_size
        self.scale = scale
        self.fail_on_token = fail_on_token       # raise when this token id is fed (error tests)
        self.kv = np.full(num_kv_blocks * BLOCK_SIZE, -1, dtype=np.int64)
        self.steps: list[ModelBatch] = []

    replay_tokens = None                        # its model keeps no state a replay rebuilds

    def _row_logits(self, context: np.ndarray) -> np.ndarray:
        h = 1469598103934665603
        for t in context.tolist():
            h = ((h ^ (t + 1)) * 1099511628211) % (1 << 64)
        rng = np.random.default_rng(h)
        return (rng.standard_normal(self.vocab_size) * self.scale).astype(np.float32)

    def forward_logits(self, batch: ModelBatch) -> np.ndarray:
        if self.fail_on_token is not None and self.fail_on_token in batch.input_ids:
            raise RuntimeError("injected failure")
        blocks = self.kv.reshape(-1, BLOCK_SIZE)
        for src, dst in batch.block_copies.tolist():         # partial prefix hits, before the step writes
            assert src != dst and (blocks[src] >= 0).any(), f"block copy {src} -> {dst} of a block never written"
            blocks[dst] = blocks[src]
        written = batch.slot_mapping >= 0                   # -1: a replayed position, its KV restored
        self.kv[batch.slot_mapping[written]] = batch.input_ids[written]
        rows = []
        for i, s in enumerate(batch.seqs):
            table = batch.block_tables[i]
            positions = np.arange(s.context_len)
            context = self.kv[table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE]
            assert (context >= 0).all(), f"seq {s.seq_id} reads a KV slot never written"
            for p in range(s.start_pos, s.context_len):
                rows.append(self._row_logits(context[: p + 1]))
        return np.stack(rows)

    def execute(self, batch: ModelBatch) -> StepOutput:
        self.steps.append(batch)
        logits = self.forward_logits(batch)
        sampled = sample_step(logits[batch.sample_rows], [s for s in batch.seqs if s.sample])
        plps = []
        for i, s in enumerate(batch.seqs):
            if s.want_prompt_logprobs:
                rows = logits[batch.cu_seqlens[i]: batch.cu_seqlens[i + 1] - 1]
                k = s.params.prompt_logprobs or 0
                lps, tops, ranks = prompt_logprobs(rows, s.token_ids[1:], k)
                plps.append(PromptLogprobResult(s.seq_id, s.start_pos, lps, tops, ranks))
        return StepOutput(sampled, plps)

    def copy_blocks(self, offloads, restores) -> None:
        kv = self.kv.reshape(-1, BLOCK_SIZE)
        for block, slot in offloads:
            self.host[slot] = kv[block]
        for slot, block in restores:
            kv[block] = self.host[slot]


def make_engine(executor=None, tokenizer=None, max_model_len: int = 512, **config):
    """An EngineLoop driven by hand (no thread): add with `submit`, then `run_until_idle`."""
    from engine.config import EngineConfig
    from engine.engine_loop import EngineLoop
    from engine.loop_options import options_within
    executor = executor or FakeExecutor()
    tokenizer = tokenizer or FakeTokenizer()
    eos = getattr(tokenizer, "eos_token_ids", [EOS])
    config = EngineConfig(**config)
    return EngineLoop(executor, tokenizer, options_within(executor.options, config, max_model_len), eos)


def submit(engine, req) -> list:
    """Queue req on a hand-driven engine; returns the list its events are appended to."""
    events: list = []
    engine.add_request(req, events.append)
    engine.drain_inbox()
    return events


def run_until_idle(engine, max_steps: int = 100000, on_step=None) -> int:
    steps = 0
    engine.drain_inbox()
    while engine.has_work():
        engine.step()
        steps += 1
        if on_step is not None:
            on_step(steps)
        engine.drain_inbox()
        assert steps < max_steps, "engine did not finish"
    return steps

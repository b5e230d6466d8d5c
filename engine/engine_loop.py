"""The engine loop: one thread owns the executor and runs schedule -> execute -> emit events.

Other threads talk to it only through `add_request` / `abort` (a queue) and the sinks they
hand in (called on the engine thread with each TokenEvent, then None when the request is
done). A failing request gets an Error and is dropped; the loop keeps serving the rest.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import random
import threading
from dataclasses import dataclass, field
from typing import Callable

from engine.batch import BLOCK_SIZE, ModelBatch, SampledToken, StepOutput
from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.events import (Error, Finished, PromptLogprobs, Rejected, Scheduled, Token,
                           TokenEvent, TopLogprob, Usage)
from engine.executor.base import DoneStep, submit
from engine.request import GenerateRequest
from engine.scheduler import Scheduler, SchedulerOutput, blocks_for
from engine.sequence import Sequence, SeqStatus
from engine.stats import EngineStats
from memory.block_manager import BlockManager
from memory.host_tier import HostKVTier

log = logging.getLogger("openinfer.engine")

Sink = Callable[[TokenEvent | None], None]


@dataclass
class _Request:
    req: GenerateRequest
    sink: Sink
    seqs: list[Sequence]
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    unfinished: int = 1
    cached_tokens: int = 0
    scheduled: bool = False
    prompt_lp: dict[int, tuple[float, list]] = field(default_factory=dict)


class EngineLoop:
    def __init__(self, executor, tokenizer, config: EngineConfig, max_model_len: int,
                 eos_token_ids: list[int]):
        self.executor = executor
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = int(executor.vocab_size)
        self.block_manager = BlockManager(executor.num_kv_blocks, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens, self._host_tier(executor, config))
        self.requests: dict[str, _Request] = {}
        self._decoders = {skip: self._make_decoder(skip) for skip in (False, True)}
        self._inbox: queue.Queue = queue.Queue()
        self._seed_rng = random.Random(config.seed)
        self._stats = EngineStats(kv_blocks_total=executor.num_kv_blocks)
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._steps = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._after_step: list[Callable[[], None]] = []
        self._deferred: list[tuple[Sequence, SampledToken]] = []   # tokens to send after the next launch
        self._plan: tuple[SchedulerOutput, ModelBatch] | None = None  # the next decode step, planned ahead
        self._planned_steps = 0

    @staticmethod
    def _host_tier(executor, config: EngineConfig) -> HostKVTier | None:
        """The host KV tier's bookkeeping, with its bytes allocated by the executor (None: off)."""
        if not config.host_kv_blocks or not config.enable_prefix_caching:
            return None
        enable = getattr(executor, "enable_host_tier", None)
        if enable is None:
            raise ValueError(f"host_kv_blocks={config.host_kv_blocks}: {type(executor).__name__} has no host KV tier")
        enable(config.host_kv_blocks)
        return HostKVTier(config.host_kv_blocks)

    def _copy_tier_blocks(self) -> None:
        """Before the step: the host tier's offloads of evicted blocks, then its restores."""
        tier = self.scheduler.host_tier
        if tier is None:
            return
        offloads, restores = tier.end_step()
        if not offloads and not restores:
            return
        try:
            self.executor.copy_blocks(offloads, restores)
        except Exception:                 # its slots no longer hold what they claim: stop using it
            log.exception("host KV tier copy failed; the tier is switched off")
            self.scheduler.host_tier = None
            raise

    # -- thread-safe surface -------------------------------------------------------------
    def add_request(self, req: GenerateRequest, sink: Sink) -> None:
        self._inbox.put(("add", req, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="openinfer-engine", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        """The loop thread is running (it has not stopped or died)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            block = not self.scheduler.has_work()
            self.drain_inbox(block=block)
            if self.scheduler.has_work() and not self._stopping:
                try:
                    self.step()
                except Exception as e:  # a bug in here: fail what is in flight, keep serving
                    log.exception("engine step raised")
                    for rid in list(self.requests):
                        self._fail(rid, f"internal engine error: {type(e).__name__}: {e}")
            else:                   # an abort can free the last request without a step
                self._publish_stats()
            self._run_after_step()
        for rid in list(self.requests):
            self._fail(rid, "engine shut down")
        self._run_after_step()

    def call_after_step(self, fn: Callable[[], None]) -> None:
        """Engine thread: run fn once, after the current step has sent all its events (sinks use
        it to hand a step's events to their consumer in one batch)."""
        self._after_step.append(fn)

    def _run_after_step(self) -> None:
        fns, self._after_step = self._after_step, []
        for fn in fns:
            try:
                fn()
            except Exception:
                log.exception("delivering a step's events failed")

    def drain_inbox(self, block: bool = False) -> None:
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return
            block = False
            if msg[0] == "add":
                self._add(msg[1], msg[2])
            elif msg[0] == "abort":
                self._abort(msg[1])
            else:
                self._stopping = True
                return

    def step(self) -> None:
        """One engine step: schedule (or confirm the step planned ahead), launch, emit the previous
        step's deferred tokens and plan the next decode step while the device runs this one, wait for
        its sampled ids, turn them into events."""
        out, batch = self._take_plan()
        if out is None:
            out = self.scheduler.schedule()
        self._copy_tier_blocks()
        for seq in out.preempted:
            log.debug("preempted seq %d of %s", seq.seq_id, seq.request_id)
        self._register_forks(out.forked)
        for seq in out.admitted:
            self._on_scheduled(seq)
        if out.steps:
            try:
                if batch is None:
                    batch = ModelBatch.build(out.steps)
                pending = (submit(self.executor, batch) if self.config.overlap_steps
                           else DoneStep(self.executor.execute(batch)))
                if self._deferred:          # the previous step's tokens, while the device runs this one
                    self._emit_deferred()
                    self._run_after_step()  # and hand them to their consumers now, not after this step
                if self.config.schedule_ahead and not isinstance(pending, DoneStep):
                    self._plan_ahead(out)
                result = pending.result()
                if len(result.sampled) != sum(s.sample for s in out.steps):
                    raise RuntimeError(f"executor sampled {len(result.sampled)} sequences, "
                                       f"expected {sum(s.sample for s in out.steps)}")
            except Exception as e:  # a broken step fails its requests, not the engine
                log.exception("engine step failed")
                self._emit_deferred()
                for rid in {seq.request_id for seq in out.seqs}:
                    self._fail(rid, f"engine step failed: {type(e).__name__}: {e}")
            else:
                self._process(out, result, defer=not isinstance(pending, DoneStep))
        if not out.steps or not self.scheduler.has_work():
            self._emit_deferred()
        self._steps += 1
        self._publish_stats()

    def _plan_ahead(self, out: SchedulerOutput) -> None:
        """While `out` runs: the next decode step's schedule and batch, its tokens still placeholders."""
        plan = self.scheduler.plan_decode_ahead(out)
        if plan is not None:
            self._plan = (plan, ModelBatch.build(plan.steps))

    def _take_plan(self) -> tuple[SchedulerOutput | None, ModelBatch | None]:
        """The step planned ahead with its sampled tokens patched in, if the scheduler confirms it is
        still exactly the next step; else (None, None)."""
        plan, self._plan = self._plan, None
        if plan is None or not self.scheduler.confirm_decode_ahead(plan[0]):
            return None, None
        out, batch = plan
        batch.input_ids[:] = [step.token_ids[0] for step in out.steps]
        self._planned_steps += 1
        return out, batch

    # -- requests in ---------------------------------------------------------------------
    def validate(self, req: GenerateRequest) -> str | None:
        """The rejection reason for a request, or None if it can run."""
        p = req.params
        try:
            p.validate()
        except ValueError as e:
            return str(e)
        prompt = req.prompt_token_ids
        if req.lora_name is not None:
            return f"lora_name {req.lora_name!r}: LoRA adapters are not supported by this engine"
        if req.request_id in self.requests:
            return f"request_id {req.request_id!r} is already in flight"
        if not prompt:
            return "prompt is empty: at least one token is needed"
        bad = [t for t in prompt if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            return f"prompt token id {bad[0]!r} is out of the vocabulary range [0, {self.vocab_size})"
        if len(prompt) + p.max_tokens > self.max_model_len:
            return (f"prompt ({len(prompt)} tokens) + max_tokens ({p.max_tokens}) = "
                    f"{len(prompt) + p.max_tokens} exceeds max_model_len ({self.max_model_len})")
        if p.n > min(self.config.max_n, self.config.max_num_seqs):
            return f"n must be <= {min(self.config.max_n, self.config.max_num_seqs)}, got {p.n}"
        if blocks_for(len(prompt) + p.max_tokens) > self.block_manager.num_blocks:
            return (f"prompt + max_tokens ({len(prompt) + p.max_tokens} tokens) needs more KV "
                    f"cache than the engine has ({self.block_manager.num_blocks * BLOCK_SIZE} tokens)")
        for t in list(p.logit_bias) + list(p.stop_token_ids):
            if not 0 <= int(t) < self.vocab_size:
                return f"token id {t} (logit_bias / stop_token_ids) is out of the vocabulary range"
        return None

    def _add(self, req: GenerateRequest, sink: Sink) -> None:
        try:
            reason = self.validate(req)
        except Exception as e:
            reason = f"invalid request: {type(e).__name__}: {e}"
        if reason is not None:
            self._send(sink, Rejected(req.request_id, reason))
            self._send(sink, None)
            return
        p = req.params
        stops = list(p.stop_token_ids) + ([] if p.ignore_eos else
                                          [t for t in self.eos_token_ids if t not in p.stop_token_ids])
        # any int seed (OpenAI's are signed 64-bit) maps to the sampler's non-negative range
        seed = p.seed % (1 << 64) if p.seed is not None else self._seed_rng.getrandbits(63)
        params = dataclasses.replace(p, seed=seed, stop_token_ids=stops)
        seq = Sequence(seq_id=self.scheduler.new_seq_id(), request_id=req.request_id,
                       token_ids=list(req.prompt_token_ids), prompt_len=len(req.prompt_token_ids),
                       params=params, arrival=req.arrival_time, fork_count=p.n,
                       want_prompt_logprobs=p.prompt_logprobs is not None)
        state = _Request(req, sink, [seq], unfinished=p.n)
        state.detoks[0] = self._detokenizer(req)
        self.requests[req.request_id] = state
        self.scheduler.add(seq)

    def _detokenizer(self, req: GenerateRequest) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self._decoders[req.params.skip_special_tokens], req.params.stop)

    def _make_decoder(self, skip: bool) -> Callable[[list[int]], str]:
        """tokenizer.decode, with the text of single tokens memoized (a pure function of the id;
        the detokenizer's window start and top logprobs decode one token each per step)."""
        pieces: dict[int, str] = {}
        decode = self.tokenizer.decode

        def decoder(ids: list[int]) -> str:
            if len(ids) != 1:
                return decode(ids, skip_special_tokens=skip)
            text = pieces.get(ids[0])
            if text is None:
                text = pieces[ids[0]] = decode(ids, skip_special_tokens=skip)
            return text
        return decoder

    def _register_forks(self, forked: list[Sequence]) -> None:
        for seq in forked:
            state = self.requests[seq.request_id]
            state.seqs.append(seq)
            state.detoks[seq.index] = self._detokenizer(state.req)

    def _on_scheduled(self, seq: Sequence) -> None:
        state = self.requests[seq.request_id]
        if not state.scheduled:
            state.scheduled = True
            state.cached_tokens = seq.num_cached_tokens
            self._prompt_tokens += seq.prompt_len
            self._send(state.sink, Scheduled(seq.request_id, seq.num_cached_tokens))

    # -- results out ---------------------------------------------------------------------
    def _process(self, out: SchedulerOutput, result: StepOutput, defer: bool = False) -> None:
        """Account the step and its sampled tokens. With `defer` (the executor launched the step
        asynchronously), a token that does not end its sequence by id or length is appended now (the
        next step's input) but detokenized and sent after the next step's launch (_emit_deferred),
        overlapping the device; a stop string found then ends the sequence one step late (the extra
        step's token is dropped, its KV slot freed with the sequence)."""
        self._register_forks(self.scheduler.advance(out))
        for plp in result.prompt_logprobs:
            self._collect_prompt_logprobs(out, plp)
        sampled = iter(result.sampled)
        for seq, step in zip(out.seqs, out.steps):
            token = next(sampled) if step.sample else None
            if seq.status is not SeqStatus.RUNNING or seq.request_id not in self.requests:
                continue
            try:
                if seq.want_prompt_logprobs and seq.num_computed >= seq.prompt_len:
                    self._emit_prompt_logprobs(seq)
                if token is None:
                    continue
                seq.token_ids.append(token.token_id)
                self._generation_tokens += 1
                if defer and self._end_by_token(seq, token.token_id) is None:
                    self._deferred.append((seq, token))
                else:
                    self._emit_token(seq, token)
            except Exception as e:
                log.exception("request %s failed", seq.request_id)
                self._fail(seq.request_id, f"{type(e).__name__}: {e}")

    def _emit_deferred(self) -> None:
        pending, self._deferred = self._deferred, []
        for seq, token in pending:
            if seq.status is SeqStatus.FINISHED or seq.request_id not in self.requests:
                continue                    # aborted or failed in between (a preempted one still sends)
            try:
                self._emit_token(seq, token)
            except Exception as e:
                log.exception("request %s failed", seq.request_id)
                self._fail(seq.request_id, f"{type(e).__name__}: {e}")

    def _collect_prompt_logprobs(self, out: SchedulerOutput, plp) -> None:
        seq = next((s for s in out.seqs if s.seq_id == plp.seq_id), None)
        if seq is None or seq.request_id not in self.requests:
            return
        state = self.requests[seq.request_id]
        for i, (lp, top) in enumerate(zip(plp.logprobs, plp.top_logprobs)):
            state.prompt_lp[plp.start_pos + 1 + i] = (lp, top)

    def _emit_prompt_logprobs(self, seq: Sequence) -> None:
        seq.want_prompt_logprobs = False
        state = self.requests[seq.request_id]
        prompt = seq.token_ids[:seq.prompt_len]
        lps: list[float | None] = [None]
        tops: list[list[TopLogprob]] = [[]]
        for pos in range(1, seq.prompt_len):
            lp, top = state.prompt_lp.get(pos, (None, []))
            lps.append(lp)
            tops.append(self._top(top))
        self._send(state.sink, PromptLogprobs(seq.request_id, prompt, lps, tops))

    def _top(self, pairs) -> list[TopLogprob]:
        if not pairs:
            return []
        decode = self._decoders[False]
        return [TopLogprob(t, decode([t]), lp) for t, lp in pairs]

    def _end_by_token(self, seq: Sequence, token: int) -> str | None:
        """How the sequence (token already appended) ends without looking at its text: "stop" (a stop
        token past min_tokens), "length" (max_tokens or max_model_len), or None."""
        p = seq.params
        num_generated = len(seq.token_ids) - seq.prompt_len
        if num_generated >= p.min_tokens and token in p.stop_token_ids:
            return "stop"
        if num_generated >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _emit_token(self, seq: Sequence, sampled) -> None:
        """Detokenize the sequence's newest token (already appended), send it, end the sequence on
        a stop token, stop string or length."""
        state = self.requests[seq.request_id]
        token = sampled.token_id
        detok = state.detoks[seq.index]
        end = self._end_by_token(seq, token)
        reason, stop_reason = None, None
        if end == "stop":
            reason = "stop"
            stop_reason = token if token in state.req.params.stop_token_ids else None
            delta = detok.finish()
        else:
            delta, stop_str = detok.add(token, check_stop=seq.num_generated >= seq.params.min_tokens)
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
            elif end == "length":
                reason = "length"
                delta += detok.finish()
        self._send(state.sink, Token(seq.request_id, token, delta, seq.index, sampled.logprob,
                                     self._top(sampled.top_logprobs)))
        if reason is not None:
            self._finish_seq(seq, reason, stop_reason)

    def _finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        state = self.requests[seq.request_id]
        self.scheduler.finish(seq)
        usage = Usage(seq.prompt_len, seq.num_generated, state.cached_tokens)
        self._send(state.sink, Finished(seq.request_id, reason, usage, seq.index, stop_reason))
        state.unfinished -= 1
        if state.unfinished == 0:
            del self.requests[seq.request_id]
            self._send(state.sink, None)

    def _abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        live = [s for s in state.seqs if s.status is not SeqStatus.FINISHED]
        # samples not forked yet also end, as aborted
        for index in range(len(state.seqs), state.req.params.n):
            state.unfinished -= 1
            usage = Usage(len(state.req.prompt_token_ids), 0, state.cached_tokens)
            self._send(state.sink, Finished(request_id, "abort", usage, index))
        for seq in live:
            seq.fork_count = 1
            self._finish_seq(seq, "abort")

    def _fail(self, request_id: str, message: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            if seq.status is not SeqStatus.FINISHED:
                try:
                    self.scheduler.finish(seq)
                except Exception:
                    log.exception("could not release seq %d of %s", seq.seq_id, request_id)
        self._send(state.sink, Error(request_id, message))
        self._send(state.sink, None)

    def _send(self, sink: Sink, event: TokenEvent | None) -> None:
        try:
            sink(event)
        except Exception:  # a consumer that went away must not stop the engine: drop its request
            log.debug("dropping an event for a closed consumer", exc_info=True)
            if event is not None and event.request_id in self.requests:
                self.abort(event.request_id)

    def _publish_stats(self) -> None:
        bm, tier = self.block_manager, self.scheduler.host_tier
        self._stats = EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_requests=len(self.requests), kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks, prefix_cache_queries=bm.query_tokens,
            prefix_cache_hits=bm.hit_tokens, prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._steps,
            num_steps_planned_ahead=self._planned_steps,
            host_kv_stored_blocks=tier.stored_blocks if tier else 0,
            host_kv_restored_blocks=tier.restored_blocks if tier else 0)

"""Output handling on the engine thread: each running request's state, its sampled tokens turned
into TokenEvents (detokenize, stop tokens / strings / length, logprobs), its end (finish, abort,
failure) and the token counters. Tokens of an asynchronously launched step can be deferred: appended
at once (they are the next step's input) but detokenized and sent after the next launch."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from engine.batch import SampledToken, StepOutput
from engine.detokenizer import IncrementalDetokenizer
from engine.events import Error, Finished, PromptLogprobs, Scheduled, Token, TokenEvent, TopLogprob, Usage
from engine.request import GenerateRequest
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SeqStatus

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

log = logging.getLogger("openinfer.engine")

Sink = Callable[[TokenEvent | None], None]


@dataclass
class RequestState:
    req: GenerateRequest
    sink: Sink
    seqs: list[Sequence]
    detoks: dict[int, IncrementalDetokenizer] = field(default_factory=dict)
    unfinished: int = 1
    cached_tokens: int = 0
    scheduled: bool = False
    prompt_lp: dict[int, tuple[float, list, int | None]] = field(default_factory=dict)   # pos -> (lp, top, rank)


class OutputProcessor:
    def __init__(self, tokenizer: TokenizerBase, scheduler: Scheduler, max_model_len: int,
                 abort: Callable[[str], None]):
        self.scheduler = scheduler
        self.max_model_len = max_model_len
        self.abort_later = abort                 # queues an abort (a consumer went away)
        self.requests: dict[str, RequestState] = {}
        self.decoders = {skip: make_decoder(tokenizer, skip) for skip in (False, True)}
        self.deferred: list[tuple[Sequence, SampledToken]] = []   # tokens to send after the next launch
        self.prompt_tokens = 0
        self.generation_tokens = 0

    # -- requests ------------------------------------------------------------------------
    def add(self, req: GenerateRequest, sink: Sink, seq: Sequence) -> None:
        state = RequestState(req, sink, [seq], unfinished=req.params.n)
        state.detoks[0] = self.detokenizer(req)
        self.requests[req.request_id] = state

    def detokenizer(self, req: GenerateRequest) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.decoders[req.params.skip_special_tokens], req.params.stop)

    def register_forks(self, forked: list[Sequence]) -> None:
        for seq in forked:
            state = self.requests[seq.request_id]
            state.seqs.append(seq)
            state.detoks[seq.index] = self.detokenizer(state.req)

    def on_scheduled(self, seq: Sequence) -> None:
        state = self.requests[seq.request_id]
        if not state.scheduled:
            state.scheduled = True
            state.cached_tokens = seq.num_cached_tokens
            self.prompt_tokens += seq.prompt_len
            self.send(state.sink, Scheduled(seq.request_id, seq.num_cached_tokens))

    # -- a step's results ----------------------------------------------------------------
    def process(self, out: SchedulerOutput, result: StepOutput, defer: bool = False) -> None:
        """Account the step and its sampled tokens. With `defer` (the executor launched the step
        asynchronously), a token that does not end its sequence by id or length, nor is its first, is appended
        now (the next step's input) but detokenized and sent after the next step's launch (emit_deferred),
        overlapping the device; a stop string found then ends the sequence one step late (the extra
        step's token is dropped, its KV slot freed with the sequence)."""
        sampled = iter(result.sampled)
        tokens = [next(sampled) if step.sample else None for step in out.steps]
        accepted = [len(t.accepted) if t is not None else 0 for t in tokens] if any(
            step.num_drafts for step in out.steps) else None
        self.register_forks(self.scheduler.advance(out, accepted))
        for plp in result.prompt_logprobs:
            self._collect_prompt_logprobs(out, plp)
        for seq, token in zip(out.seqs, tokens):
            if seq.status is not SeqStatus.RUNNING or seq.request_id not in self.requests:
                continue
            try:
                if seq.want_prompt_logprobs and seq.num_computed >= seq.prompt_len:
                    self._emit_prompt_logprobs(seq)
                if token is not None:
                    self._take(seq, token, defer)
            except Exception as e:
                log.exception("request %s failed", seq.request_id)
                self.fail(seq.request_id, f"{type(e).__name__}: {e}")

    def _take(self, seq: Sequence, sampled: SampledToken, defer: bool) -> None:
        """Append the step's tokens of seq (a verify step's accepted drafts, then the token after them) and
        send them, one by one, until one ends the sequence (the rest are dropped)."""
        for token in sampled.emitted():
            seq.token_ids.append(token.token_id)
            self.generation_tokens += 1
            if seq.grammar is not None:
                self._advance_grammar(seq, token.token_id)
            # a request's first token goes out now: the step after a prefill is not launched ahead, so
            # deferring it would hold the first token through that step's scheduling and launch (~1 ms);
            # several tokens of a verify step go out now too (in order, the last may end the sequence)
            if (defer and not sampled.accepted and seq.num_generated > 1
                    and self.end_by_token(seq, token.token_id) is None):
                self.deferred.append((seq, token))
            else:
                self._emit_token(seq, token)
            if seq.status is SeqStatus.FINISHED:
                return

    def emit_deferred(self) -> None:
        pending, self.deferred = self.deferred, []
        for seq, token in pending:
            if seq.status is SeqStatus.FINISHED or seq.request_id not in self.requests:
                continue                    # aborted or failed in between (a preempted one still sends)
            try:
                self._emit_token(seq, token)
            except Exception as e:
                log.exception("request %s failed", seq.request_id)
                self.fail(seq.request_id, f"{type(e).__name__}: {e}")

    def _collect_prompt_logprobs(self, out: SchedulerOutput, plp) -> None:
        seq = next((s for s in out.seqs if s.seq_id == plp.seq_id), None)
        if seq is None or seq.request_id not in self.requests:
            return
        state = self.requests[seq.request_id]
        ranks = plp.ranks or [None] * len(plp.logprobs)
        for i, (lp, top, rank) in enumerate(zip(plp.logprobs, plp.top_logprobs, ranks)):
            state.prompt_lp[plp.start_pos + 1 + i] = (lp, top, rank)

    def _emit_prompt_logprobs(self, seq: Sequence) -> None:
        seq.want_prompt_logprobs = False
        state = self.requests[seq.request_id]
        prompt = seq.token_ids[:seq.prompt_len]
        lps: list[float | None] = [None]
        tops: list[list[TopLogprob]] = [[]]
        ranks: list[int | None] = [None]
        for pos in range(1, seq.prompt_len):
            lp, top, rank = state.prompt_lp.get(pos, (None, [], None))
            lps.append(lp)
            tops.append(self._top(top))
            ranks.append(rank)
        self.send(state.sink, PromptLogprobs(seq.request_id, prompt, lps, tops, ranks))

    def _top(self, pairs) -> list[TopLogprob]:
        if not pairs:
            return []
        decode = self.decoders[False]
        return [TopLogprob(t, decode([t]), lp) for t, lp in pairs]

    @staticmethod
    def _advance_grammar(seq: Sequence, token: int) -> None:
        """The sequence's grammar takes its new token (sampling allowed only such tokens: a refusal is
        the grammar's own failure, e.g. a mask step over its limits, which fails the request)."""
        if not seq.grammar.accept(token):
            raise RuntimeError(f"structured output failed: {seq.grammar.error or f'the grammar refused token {token}'}")

    def end_by_token(self, seq: Sequence, token: int) -> str | None:
        """How the sequence (token already appended) ends without looking at its text: "stop" (a stop
        token past min_tokens, or its grammar complete: it admits no further token), "length"
        (max_tokens or max_model_len), or None."""
        p = seq.params
        num_generated = len(seq.token_ids) - seq.prompt_len
        if seq.grammar is not None and seq.grammar.done:
            return "stop"
        if num_generated >= p.min_tokens and token in p.stop_token_ids:
            return "stop"
        if num_generated >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _emit_token(self, seq: Sequence, sampled: SampledToken) -> None:
        """Detokenize the sequence's newest token (already appended), send it, end the sequence on
        a stop token, stop string or length."""
        state = self.requests[seq.request_id]
        token = sampled.token_id
        detok = state.detoks[seq.index]
        end = self.end_by_token(seq, token)
        reason, stop_reason = None, None
        if end == "stop" and token in seq.params.stop_token_ids:     # a stop token: its text is not sent
            reason = "stop"
            stop_reason = token if token in state.req.params.stop_token_ids else None
            delta = detok.finish()
        else:
            delta, stop_str = detok.add(token, check_stop=seq.num_generated >= seq.params.min_tokens)
            if stop_str is not None:
                reason, stop_reason = "stop", stop_str
            elif end is not None:                                     # length, or the grammar complete
                reason = end
                delta += detok.finish()
        self.send(state.sink, Token(seq.request_id, token, delta, seq.index, sampled.logprob,
                                    self._top(sampled.top_logprobs)))
        if reason is not None:
            self.finish_seq(seq, reason, stop_reason)

    # -- endings -------------------------------------------------------------------------
    def finish_seq(self, seq: Sequence, reason: str, stop_reason=None) -> None:
        state = self.requests[seq.request_id]
        self.scheduler.finish(seq)
        usage = Usage(seq.prompt_len, seq.num_generated, state.cached_tokens)
        self.send(state.sink, Finished(seq.request_id, reason, usage, seq.index, stop_reason))
        state.unfinished -= 1
        if state.unfinished == 0:
            del self.requests[seq.request_id]
            self.send(state.sink, None)

    def abort(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        live = [s for s in state.seqs if s.status is not SeqStatus.FINISHED]
        # samples not forked yet also end, as aborted
        for index in range(len(state.seqs), state.req.params.n):
            state.unfinished -= 1
            usage = Usage(len(state.req.prompt_token_ids), 0, state.cached_tokens)
            self.send(state.sink, Finished(request_id, "abort", usage, index))
        for seq in live:
            seq.fork_count = 1
            self.finish_seq(seq, "abort")

    def fail(self, request_id: str, message: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            if seq.status is not SeqStatus.FINISHED:
                try:
                    self.scheduler.finish(seq)
                except Exception:
                    log.exception("could not release seq %d of %s", seq.seq_id, request_id)
        self.send(state.sink, Error(request_id, message))
        self.send(state.sink, None)

    def send(self, sink: Sink, event: TokenEvent | None) -> None:
        try:
            sink(event)
        except Exception:  # a consumer that went away must not stop the engine: drop its request
            log.debug("dropping an event for a closed consumer", exc_info=True)
            if event is not None and event.request_id in self.requests:
                self.abort_later(event.request_id)


def make_decoder(tokenizer: TokenizerBase, skip: bool) -> Callable[[list[int]], str]:
    """tokenizer.decode, with the text of single tokens memoized (a pure function of the id; the
    detokenizer's window start and top logprobs decode one token each per step)."""
    pieces: dict[int, str] = {}
    decode = tokenizer.decode

    def decoder(ids: list[int]) -> str:
        if len(ids) != 1:
            return decode(ids, skip_special_tokens=skip)
        text = pieces.get(ids[0])
        if text is None:
            text = pieces[ids[0]] = decode(ids, skip_special_tokens=skip)
        return text
    return decoder

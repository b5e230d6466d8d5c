"""The engine loop: one thread owns the executor and runs schedule -> launch -> collect.

Other threads talk to it only through `add_request` / `abort` (a queue) and the sinks they hand in
(called on the engine thread with each TokenEvent, then None when the request is done). Admission
(engine/admission.py) decides whether a request can run; output handling (engine/outputs.py) turns
sampled tokens into events. Here: the step driver. While the device runs step N it sends step N-1's
tokens and plans decode step N+1 (the scheduler's plan-ahead; with speculative decoding, only where the
speculator predicts N+1 draft-free). A failing request gets an Error and is
dropped; a failing step fails its requests; the loop keeps serving the rest.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Callable

from engine.admission import Admission, AdmissionLimits
from engine.batch import ModelBatch
from engine.events import Error, Finished, Rejected, Usage
from engine.executor.base import DoneStep
from engine.grammar import GrammarCache
from engine.host_tier import HostTier, host_slots
from engine.kv_events import kv_event_log
from engine.loop_options import LoopOptions
from engine.lora_registry import lora_registry
from engine.outputs import OutputProcessor, RequestState, Sink
from engine.request import GenerateRequest
from engine.scheduler import Scheduler, SchedulerOutput
from engine.speculator import speculator_for
from engine.stats import EngineStats
from engine.step_trace import NoTrace, StepTrace
from memory.block_manager import BlockManager
from memory.state_slots import StateSlots

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

log = logging.getLogger("openinfer.engine")

__all__ = ["EngineLoop", "EngineStats", "Sink"]


def spec_decode_stats(speculator) -> dict:
    """EngineStats' spec_decode_* fields (none while speculation is off)."""
    if speculator is None:
        return {}
    c = speculator.counters
    return {"spec_decode_num_drafts": c.num_drafts, "spec_decode_num_draft_tokens": c.num_draft_tokens,
            "spec_decode_num_accepted_tokens": c.num_accepted_tokens,
            "spec_decode_accepted_per_pos": tuple(c.accepted_per_pos)}


def prefix_caching(options: LoopOptions, state_slots: StateSlots | None, replay: Callable | None) -> bool:
    """Whether the block manager caches prefixes: as configured, except for a line with per-sequence state
    that a cached KV prefix does not restore and replaying a few tokens cannot rebuild (replay None: Qwen3.5's
    linear-attention state, which a hit would skip the tokens of), where it is off (logged)."""
    if options.enable_prefix_caching and state_slots is not None and replay is None:
        log.info("prefix caching off: the model keeps per-sequence linear-attention state, which a cached "
                 "KV prefix does not restore")
        return False
    return options.enable_prefix_caching


class EngineLoop:
    def __init__(self, executor, tokenizer: TokenizerBase, options: LoopOptions, eos_token_ids: list[int]):
        self.executor = executor
        self.tokenizer = tokenizer
        self.options = options
        self.limits = limits = options.limits
        self.max_model_len = max_model_len = limits.max_model_len
        slots = StateSlots(executor.num_state_slots) if executor.num_state_slots else None
        # a line whose state a prefix hit rebuilds by recomputing its last tokens (DeepSeek-V4's compressor rings)
        replay = executor.replay_tokens if slots is not None else None     # asked only of a line with state
        self.block_manager = BlockManager(executor.num_kv_blocks, prefix_caching(options, slots, replay))
        host = host_slots(executor, options.host_kv_blocks)
        # subscribed before the host tier: an eviction is recorded before the host-tier store it causes
        self.kv_events = kv_event_log(options.kv_events_config, self.block_manager, host, self._lora_name,
                                      options.data_parallel_rank)
        tier = HostTier(host, self.block_manager, executor) if host is not None else None
        self.scheduler = Scheduler(self.block_manager, limits, tier, state_slots=slots, max_loras=options.max_loras,
                                   step_cost=executor.step_cost, replay=replay)
        self.scheduler.copy_on_write = executor.supports_block_copies
        self.loras = lora_registry(executor, options, self.scheduler)
        self.admission = Admission(AdmissionLimits(vocab_size=int(executor.vocab_size), max_model_len=max_model_len,
                                                   max_n=options.max_n,
                                                   num_kv_blocks=executor.num_kv_blocks),
                                   eos_token_ids, options.seed,
                                   GrammarCache(tokenizer, int(executor.vocab_size), eos_token_ids), self.loras)
        self.outputs = OutputProcessor(tokenizer, self.scheduler, max_model_len, self.abort)
        # speculative decoding: drafts before each step; a step with drafts needs the last one's tokens, so only
        # steps the speculator predicts draft-free are planned or launched ahead (_ahead_ok)
        self.speculator = speculator_for(options.speculative_config, executor, max_model_len)
        self._inbox: queue.Queue = queue.Queue()
        self._stats = EngineStats(kv_blocks_total=executor.num_kv_blocks)
        self._warming = True            # the executor's warm-up (graph captures) runs while the engine idles
        self.warm_listeners: list[Callable[[], None]] = []   # engine thread: called once the warm-up is done
        self._steps = 0
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._fetching: dict[str, tuple[GenerateRequest, Sink]] = {}    # requests waiting for their adapter's read
        self._after_step: list[Callable[[], None]] = []
        self._plan: tuple[SchedulerOutput, ModelBatch] | None = None  # the next decode step, planned ahead
        self._inflight: tuple | None = None    # async scheduling: (plan, batch, pending) already queued
        self._async = options.async_scheduling and executor.supports_fed_steps and (
            self.speculator is None or self.speculator.feeds_ok)
        self._planned_steps = 0
        self._admitted_ahead = 0                # prompts admitted into steps launched ahead
        self.trace = StepTrace(options.step_trace) if options.step_trace else NoTrace()

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.outputs.requests

    def _lora_name(self, lora_id: int) -> str | None:
        return (self.loras.names({lora_id}) or None) if self.loras is not None else None

    # -- thread-safe surface -------------------------------------------------------------
    def add_request(self, req: GenerateRequest, sink: Sink) -> None:
        self._inbox.put(("add", req, sink))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def call(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread, between steps (LoRA adapter loads and unloads)."""
        self._inbox.put(("call", fn))

    def stats(self) -> EngineStats:
        return self._stats

    def reset_prefix_cache(self) -> int:
        """Engine thread, between steps: evict every unreferenced cached device block (with a host tier they
        are offloaded to it now, not with the next step); returns how many."""
        self._land_all_copies()             # blocks held by write-through copies become evictable
        if self.kv_events is not None:
            self.kv_events.begin_reset()
        n = self.block_manager.reset_prefix_cache()
        self.scheduler.issue_copies()
        if self.kv_events is not None:      # nothing left cached anywhere: vLLM's AllBlocksCleared
            tier = self.scheduler.host_tier
            self.kv_events.end_reset((tier is None or not tier.on) and not self.block_manager.cached)
            self.kv_events.flush(time.time())
        self._publish_stats()
        return n

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

    def has_work(self) -> bool:
        """Sequences to schedule, or a step already queued (async scheduling) to collect."""
        return self.scheduler.has_work() or self._inflight is not None

    def call_after_step(self, fn: Callable[[], None]) -> None:
        """Engine thread: run fn once, after the current step has sent all its events (sinks use
        it to hand a step's events to their consumer in one batch)."""
        self._after_step.append(fn)

    # -- the loop ------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stopping:
            idle = not self.has_work()
            self.drain_inbox(block=idle and not self._warming)
            if idle and self._warming and not self.has_work() and not self._stopping:
                try:
                    self._warming = self.executor.warm_up()
                except Exception:
                    log.exception("executor warm-up failed; later steps capture what they need")
                    self._warming = False
                if not self._warming:
                    self._publish_stats()
                    for fn in self.warm_listeners:
                        fn()
                self._run_after_step()
                continue
            if self.has_work() and not self._stopping:
                try:
                    self.step()
                except Exception as e:  # a bug in here: fail what is in flight, keep serving
                    log.exception("engine step raised")
                    for rid in list(self.requests):
                        self.outputs.fail(rid, f"internal engine error: {type(e).__name__}: {e}")
            else:                   # an abort can free the last request without a step
                self._publish_stats()
            if self.loras is not None:
                self.loras.after_step()     # unloads waiting for their adapter's last sequence
            self._run_after_step()
        for rid in list(self.requests):
            self.outputs.fail(rid, "engine shut down")
        for rid, (_, sink) in list(self._fetching.items()):
            self.outputs.send(sink, Error(rid, "engine shut down"))
            self.outputs.send(sink, None)
        self._run_after_step()
        if self.kv_events is not None:
            self.kv_events.close(time.time())
        self.trace.close()

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
                if not self._abort_fetching(msg[1]):
                    self.outputs.abort(msg[1])
            elif msg[0] == "call":
                try:
                    msg[1]()
                except Exception:
                    log.exception("an engine-thread call failed")
            else:
                self._stopping = True
                return

    def _add(self, req: GenerateRequest, sink: Sink) -> None:
        try:
            reason = self.admission.reject_reason(req, self.requests)
        except Exception as e:
            reason = f"invalid request: {type(e).__name__}: {e}"
        if reason is None and req.request_id in self._fetching:
            reason = f"request_id {req.request_id!r} is already in flight"
        if reason is not None:
            self._reject(sink, req.request_id, reason)
            return
        if req.lora_name is not None and not self.loras.in_host(req.lora_name):
            self._fetching[req.request_id] = (req, sink)       # admitted once its adapter is read again
            self.loras.fetch(req.lora_name, lambda err, rid=req.request_id: self._fetched(rid, err), self.call)
            return
        seq = self.admission.sequence(req, self.scheduler.new_seq_id())
        self.outputs.add(req, sink, seq)
        self.scheduler.add(seq)

    def _fetched(self, request_id: str, err) -> None:
        """Engine thread: the adapter a waiting request names is in host memory again (or could not be read)."""
        req, sink = self._fetching.pop(request_id, (None, None))
        if req is None:                     # aborted while the adapter was read
            return
        if err is not None:
            self._reject(sink, request_id, f"lora_name {req.lora_name!r}: {err}")
        else:
            self._add(req, sink)

    def _reject(self, sink: Sink, request_id: str, reason: str) -> None:
        self.outputs.send(sink, Rejected(request_id, reason))
        self.outputs.send(sink, None)

    def _abort_fetching(self, request_id: str) -> bool:
        req, sink = self._fetching.pop(request_id, (None, None))
        if req is None:
            return False
        for index in range(req.params.n):
            self.outputs.send(sink, Finished(request_id, "abort", Usage(len(req.prompt_token_ids), 0), index))
        self.outputs.send(sink, None)
        return True

    def _schedule(self) -> SchedulerOutput:
        """The next step: the running sequences' drafts first (speculative decoding), then the scheduler's pick."""
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running)
        return self.scheduler.schedule()

    def step(self) -> None:
        """One engine step: schedule (or take the step planned or launched ahead), launch, emit the
        previous step's deferred tokens and plan (or, with async scheduling, launch) the next decode
        step while the device runs this one, wait for its sampled ids, turn them into events."""
        outputs, trace = self.outputs, self.trace
        trace.begin()
        launched, self._inflight = self._inflight, None
        out, batch, pending = launched if launched is not None else (*self._take_plan(), None)
        planned = out is not None
        if out is None:
            out = self._schedule()
        trace.mark("schedule")
        if pending is None:
            self.scheduler.issue_copies()
        for seq in out.preempted:
            log.debug("preempted seq %d of %s", seq.seq_id, seq.request_id)
        outputs.register_forks(out.forked)
        for seq in out.admitted:
            outputs.on_scheduled(seq)
        trace.mark("copy")
        if out.steps:
            try:
                if batch is None:
                    batch = self._build(out.steps)
                trace.mark("build")
                if pending is None:
                    pending = (self.executor.submit(batch) if self.options.overlap_steps
                               else DoneStep(self.executor.execute(batch)))
                trace.mark("launch")
                if outputs.deferred:        # the previous step's tokens, while the device runs this one
                    outputs.emit_deferred()
                    self._run_after_step()  # and hand them to their consumers now, not after this step
                trace.mark("emit")
                if self.options.schedule_ahead and not isinstance(pending, DoneStep) and self._ahead_ok(out):
                    if not (self._async and self._launch_ahead(out)):
                        self._plan_ahead(out)
                trace.mark("plan")
                result = pending.result()
                trace.mark("wait")
                if len(result.sampled) != sum(s.sample for s in out.steps):
                    raise RuntimeError(f"executor sampled {len(result.sampled)} sequences, "
                                       f"expected {sum(s.sample for s in out.steps)}")
            except Exception as e:  # a broken step fails its requests, not the engine
                log.exception("engine step failed")
                self.executor.discard_step_times()
                outputs.emit_deferred()
                failed = {seq.request_id for seq in out.seqs}
                if self._inflight is not None:      # the step queued behind it ran on the same inputs
                    failed |= {seq.request_id for seq in self._inflight[0].seqs}
                    self._inflight = None
                for rid in failed:
                    outputs.fail(rid, f"engine step failed: {type(e).__name__}: {e}")
            else:
                outputs.process(out, result, defer=not isinstance(pending, DoneStep))
                if self.speculator is not None:
                    self.speculator.record(out.steps, result.sampled, self.scheduler.running)
                trace.mark("process")
                trace.end(out, planned, self.executor)
        if not out.steps or not self.scheduler.has_work():
            outputs.emit_deferred()
        tier = self.scheduler.host_tier
        if not out.steps and self.scheduler.has_work() and tier is not None:
            tier.wait_oldest()              # nothing could run: wait for the oldest copies in flight
        self._steps += 1
        if self.kv_events is not None:      # the step's prefix-cache changes, one batch for the publisher
            self.kv_events.flush(time.time())
        self._publish_stats()

    def _ahead_ok(self, out: SchedulerOutput) -> bool:
        """Whether the step after `out` may be planned or launched ahead: always without speculation; with it,
        where `out` verifies no drafts and the speculator predicts none for the next step either."""
        sp = self.speculator
        return sp is None or (not any(step.num_drafts for step in out.steps)
                              and sp.draft_free_next(self.scheduler.running))

    def _launch_ahead(self, out: SchedulerOutput) -> bool:
        """Async scheduling: plan the next step and queue it now, its decode rows' input ids taken on
        the device from `out`'s sampled ids (a sequence that ends at `out` by a stop token or string
        computes one token more, which is dropped), waiting prompts admitted after them with their own
        ids. False where no such step can be planned."""
        plan = self.scheduler.plan_decode_ahead(out, fed=True)
        if plan is None:
            return False
        # its admissions are announced now (they are running): an abort handled before the plan's own
        # step(), or a failed launch (they are then scheduled afresh), finds them known
        self.outputs.register_forks(plan.forked)
        for seq in plan.admitted:
            self.outputs.on_scheduled(seq)
        self._admitted_ahead += len(plan.admitted)
        plan.forked, plan.admitted = [], []
        self.scheduler.issue_copies()       # blocks the plan evicted reach the host tier before it runs
        batch = self._build(plan.steps)
        fed = any(step.token_ids[0] < 0 for step in plan.steps)     # no decode rows: prompt chunks alone
        self._inflight = (plan, batch, self.executor.submit(batch, fed=fed))
        self._planned_steps += 1
        return True

    def _build(self, steps) -> ModelBatch:
        """The step's batch, its LoRA adapters made resident in the executor first."""
        return ModelBatch.build(steps, None if self.loras is None else self.loras.prepare(steps))

    def _land_all_copies(self) -> None:
        """Wait for every asynchronous host-tier copy in flight and let the scheduler take back what they held."""
        tier = self.scheduler.host_tier
        while tier is not None and tier.wait_oldest():
            self.scheduler.land_copies()

    def _plan_ahead(self, out: SchedulerOutput) -> None:
        """While `out` runs: the next decode step's schedule and batch, its tokens still placeholders."""
        plan = self.scheduler.plan_decode_ahead(out)
        if plan is not None:
            self._plan = (plan, self._build(plan.steps))

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

    def _publish_stats(self) -> None:
        bm, sched, reg = self.block_manager, self.scheduler, self.loras
        host = sched.host_tier.stats(self.executor.kv_block_bytes) if sched.host_tier is not None else {}
        lora = {} if reg is None else dict(
            lora_max_adapters=reg.max_loras, lora_adapters_loaded=len(reg.loaded),
            lora_adapters_resident=len(reg.slot_of), lora_slot_loads=reg.loads,
            lora_running_adapters=reg.names({s.lora_id for s in sched.running} | {s.lora_id for s in sched.loading}),
            lora_waiting_adapters=reg.names({s.lora_id for s in sched.waiting}))
        self._stats = EngineStats(
            num_running=len(self.scheduler.running) + len(self.scheduler.loading),   # loading: admitted
            num_waiting=len(self.scheduler.waiting),
            num_requests=len(self.requests), kv_blocks_used=bm.num_used_blocks,
            kv_blocks_total=bm.num_blocks, prefix_cache_queries=bm.query_tokens,
            prefix_cache_hits=bm.hit_tokens, prompt_tokens_total=self.outputs.prompt_tokens,
            generation_tokens_total=self.outputs.generation_tokens,
            num_preemptions=self.scheduler.num_preemptions, num_steps=self._steps,
            num_steps_planned_ahead=self._planned_steps, num_prompts_admitted_ahead=self._admitted_ahead,
            warming_up=int(self._warming), **lora, **host,
            **spec_decode_stats(self.speculator))

"""EngineHandle: the engine as the server (or a script) sees it.

    handle = EngineHandle(EngineConfig(model="path/or/file.gguf"))
    async for event in handle.submit(GenerateRequest("r1", ids, SamplingParams(max_tokens=8))):
        ...                                   # Scheduled, Token..., Finished (or Rejected / Error)
    outputs = handle.generate(["Hello"], SamplingParams(temperature=0))   # blocking, offline

The engine loop runs in its own thread and owns the executor; `submit` may be called from
any asyncio event loop, `abort`, `stats` and `generate` from any thread.
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from memory.kv_format import is_fp8
from memory.kv_pool import BLOCK_SIZE
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop, EngineStats
from engine.events import (Error, Finished, PromptLogprobs, Rejected,
                           Scheduled, Token, TokenEvent)
from engine.engine_calls import LocalEngineCalls
from engine.loop_options import LoopOptions, options_within
from engine.request import GenerateRequest, SamplingParams
from memory.block_manager import KVEvent

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

log = logging.getLogger("openinfer.engine")

__all__ = ["EngineHandle", "EngineStats", "RequestStream", "RequestOutput", "SampleOutput"]


class _Mailbox:
    """Hands events from the engine thread to one asyncio loop: the events of an engine step
    are collected (engine thread only, no lock) and go over as one list, one loop wake-up per
    step, once the step has sent them all."""

    def __init__(self, loop: asyncio.AbstractEventLoop, engine: EngineLoop):
        self.loop = loop
        self._engine = engine
        self._pending: list[tuple[RequestStream, TokenEvent | None]] = []

    def post(self, stream: "RequestStream", event: TokenEvent | None) -> None:   # engine thread
        if self.loop.is_closed():
            raise RuntimeError(f"the event loop of request {stream.request_id!r} is closed")
        if not self._pending:
            self._engine.call_after_step(self._flush)
        self._pending.append((stream, event))

    def _flush(self) -> None:                                           # engine thread
        items, self._pending = self._pending, []
        try:
            self.loop.call_soon_threadsafe(_deliver, items)
        except RuntimeError:                     # the loop closed meanwhile: nobody is listening
            for rid in {stream.request_id for stream, event in items if event is not None}:
                self._engine.abort(rid)


def _deliver(items: list[tuple["RequestStream", TokenEvent | None]]) -> None:   # the asyncio loop
    for stream, event in items:
        stream._events.append(event)
        waiter = stream._waiter
        if waiter is not None:
            stream._waiter = None
            if not waiter.done():
                waiter.set_result(None)


class RequestStream:
    """Async iterator over one request's TokenEvents; ends after its last terminal event.
    Leaving it early (aclose, or breaking out of `async for` and calling abort) frees the
    request in the engine."""

    def __init__(self, handle: "EngineHandle", request_id: str, mailbox: _Mailbox):
        self.request_id = request_id
        self._handle = handle
        self._mailbox = mailbox
        self._events: collections.deque[TokenEvent | None] = collections.deque()
        self._waiter: asyncio.Future | None = None
        self._done = False

    def _push(self, event: TokenEvent | None) -> None:   # engine thread
        self._mailbox.post(self, event)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> TokenEvent:
        if self._done:
            raise StopAsyncIteration
        while not self._events:
            self._waiter = self._mailbox.loop.create_future()
            await self._waiter
        event = self._events.popleft()
        if event is None:
            self._done = True
            raise StopAsyncIteration
        return event

    async def aclose(self) -> None:
        if not self._done:
            self._done = True
            self._handle.abort(self.request_id)


@dataclass
class SampleOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[list] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    """What `generate` returns per prompt: all samples, finished."""
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SampleOutput]
    cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    error: str | None = None                 # the Rejected / Error reason, if it failed


class EngineHandle(LocalEngineCalls):
    def __init__(self, config: EngineConfig | None = None, *, executor=None, tokenizer: TokenizerBase | None = None,
                 model_name: str | None = None, max_model_len: int | None = None,
                 eos_token_ids: list[int] | None = None):
        """Build from config (loads the model and its executor), or wrap an already built
        executor + tokenizer (then max_model_len defaults to what the KV pool holds)."""
        self.config = config or EngineConfig()
        self.config.validate()
        self.model_path = None
        info = None
        if executor is None:
            executor, tokenizer, info = _build(self.config)
            self.config = info["config"]                   # sizes resolved against the model (kv_offload_gib)
            limits = info["limits"]
            model_name = model_name or info["model_name"]
            max_model_len = max_model_len or info["max_model_len"]
            self.model_path = info["model_path"]
        if tokenizer is None:
            raise ValueError("EngineHandle needs a tokenizer with an executor")
        self.tokenizer = tokenizer
        self.executor = executor
        self.model_name = self.config.served_model_name or model_name or "openinfer"
        pool_tokens = executor.num_kv_blocks * BLOCK_SIZE
        self.max_model_len = (self.config.max_model_len or max_model_len
                              or min(executor.options.max_model_len, pool_tokens))
        if self.max_model_len > pool_tokens:
            # a longer sequence could never be scheduled; advertising it would make every request
            # that fills the context (a chat's default max_tokens) a rejection
            log.warning("max_model_len %d is more than the KV pool holds; serving %d",
                        self.max_model_len, pool_tokens)
            self.max_model_len = pool_tokens
        if eos_token_ids is None:
            eos_token_ids = tokenizer.eos_token_ids
        if info is None:                               # an executor built elsewhere: the config within its limits
            options = options_within(executor.options, self.config, self.max_model_len)
        else:
            if limits.max_model_len != self.max_model_len:          # cut to what the KV pool holds
                limits = dataclasses.replace(limits, max_model_len=self.max_model_len)
            options = LoopOptions.of(self.config, limits)
        self._engine = EngineLoop(executor, tokenizer, options, eos_token_ids)
        self._ids = itertools.count()
        self._mailboxes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # loop -> _Mailbox
        self._mailbox_lock = threading.Lock()
        self._closed = False
        self._engine.start()

    @property
    def max_n(self) -> int:
        """The largest n (samples per request) the engine admits: max_n, capped by max_num_seqs."""
        return self._engine.admission.limits.max_n

    @property
    def engine(self) -> EngineLoop:
        """The loop itself (tests inspect its block manager and scheduler)."""
        return self._engine

    def submit(self, req: GenerateRequest) -> RequestStream:
        """Queue a request; iterate the result with `async for`. Call from a running loop."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        loop = asyncio.get_running_loop()
        with self._mailbox_lock:
            mailbox = self._mailboxes.get(loop)
            if mailbox is None:
                mailbox = self._mailboxes[loop] = _Mailbox(loop, self._engine)
        stream = RequestStream(self, req.request_id, mailbox)
        self._engine.add_request(req, stream._push)
        return stream

    def abort(self, request_id: str) -> None:
        """End a request early: its samples finish with reason "abort", its KV is freed."""
        self._engine.abort(request_id)

    def is_healthy(self) -> bool:
        """Not shut down and the engine thread alive: what /health reports."""
        return not self._closed and self._engine.is_alive()

    def stats(self) -> EngineStats:
        """A snapshot published after every engine step (safe from any thread)."""
        return self._engine.stats()

    def subscribe_kv_events(self, callback: Callable[[KVEvent], None]) -> None:
        """callback(BlockStored | BlockRemoved) for every prefix-cache change; it runs on the
        engine thread, so it must be quick and must not call back into the engine."""
        self._engine.block_manager.subscribe(callback)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None
                 ) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion; blocks. One RequestOutput per prompt,
        in order."""
        params = params or SamplingParams()
        sinks = []
        for prompt in prompts:
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"generate-{next(self._ids)}"
            q: queue.Queue = queue.Queue()
            self._engine.add_request(GenerateRequest(rid, ids, params), q.put)
            sinks.append((rid, ids, q))
        return [collect_events(rid, ids, iter(q.get, None), params.n) for rid, ids, q in sinks]

    def shutdown(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()
            self.executor.close()

    def __enter__(self) -> "EngineHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def collect_events(rid: str, ids: list[int], events, n: int) -> RequestOutput:
    """A request's RequestOutput from its events, in order (a list, or an iterator ending at None)."""
    out = RequestOutput(rid, ids, [SampleOutput(i) for i in range(n)])
    for event in events:
        if event is None:
            break
        if isinstance(event, Scheduled):
            out.cached_tokens = event.cached_tokens
        elif isinstance(event, PromptLogprobs):
            out.prompt_logprobs = event
        elif isinstance(event, Token):
            sample = out.outputs[event.index]
            sample.text += event.text
            sample.token_ids.append(event.token_id)
            sample.logprobs.append(event.logprob)
            sample.top_logprobs.append(event.top_logprobs)
        elif isinstance(event, Finished):
            out.outputs[event.index].finish_reason = event.reason
            out.outputs[event.index].stop_reason = event.stop_reason
        elif isinstance(event, (Rejected, Error)):
            out.error = event.reason if isinstance(event, Rejected) else event.message
    return out


def host_blocks_for_gib(gib: float, layout, itemsize: int) -> int:
    """Host-tier slots that fit `gib` GiB of this KV layout's blocks (at least one)."""
    return max(1, int(gib * 2**30) // layout.block_bytes(itemsize))


def _build(config: EngineConfig):
    """Load the model named by config (the demo model when None) and build its executor."""
    import os

    from engine.executor.factory import create_executor, resolve_device
    from engine.executor.options import resolved_options
    from engine.loader import load_model
    from engine.speculative import check_device
    path = config.model
    if path is None:
        from engine.loader.demo import demo_model_path
        path = demo_model_path()
    device = resolve_device(config.device)
    check_device(config.speculative_config, device, config.tensor_parallel_size)      # before the model is read
    t0 = time.perf_counter()
    model = load_model(path, quantization=config.quantization)
    t1 = time.perf_counter()
    if config.kv_offload_gib:              # the host tier in GiB -> slots of this model's KV blocks
        itemsize = 1 if is_fp8(config.kv_cache_dtype) else 2 if device == "cuda" else 4
        blocks = host_blocks_for_gib(config.kv_offload_gib, model.model.kv_layout(), itemsize)
        config = dataclasses.replace(config, host_kv_blocks=blocks, kv_offload_gib=0.0)
    limits, options = resolved_options(config, device, model.config.max_position_embeddings)
    executor = create_executor(model, options, device)
    log.info("start: model read in %.2f s, executor up in %.2f s (weights to the device, buffers, kernels)",
             t1 - t0, time.perf_counter() - t1)
    name = os.path.basename(os.path.normpath(str(path)))
    if name.endswith(".gguf"):
        name = name[:-5]
    info = {"model_name": name, "max_model_len": options.max_model_len, "model_path": model.path, "config": config,
            "limits": limits}
    return executor, model.tokenizer, info

"""The engine in a process of its own: EngineClient has EngineHandle's serving surface (submit, abort,
stats, is_healthy, generate, shutdown, the tokenizer and limits) and runs the engine loop in a child.

Why: the engine thread launches hundreds of kernels per step, and every foreign call releases the GIL.
In one process with the HTTP server, a busy event loop (hundreds of streams) takes the GIL at each of
those releases and holds it for up to the switch interval (5 ms): the engine's host time per step grows
with the number of streams (H200, Qwen3-4B, 500 streams: 97 ms of launch time per 8k-token step). In its
own process the engine thread shares the GIL with nothing but two small pipe threads.

Protocol (multiprocessing pipes, pickled): parent -> child ("add", GenerateRequest), ("abort", id),
("op", call id, op), ("stop",); child -> parent ("ready", info) once the engine is up (or ("error",
kind, message)), then ("events", [(request id, TokenEvent | None), ...], EngineStats) after every engine
step that produced events, ("op", call id, status, message) answering a run-time op
(engine/engine_calls.py), and ("stopping", signal name) when a SIGTERM was sent to the child: it exits
once its requests have ended (engine/process_tree.py: how the child is tied to its parent). The child
pickles on the engine thread (one dumps per step) and a sender thread writes; the parent's reader
thread hands each batch to the asyncio loops of its streams in one wake-up per loop. The parent loads only the tokenizer (for the server's prompt encoding and chat templates).
"""
from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import pickle
import queue
import signal
import threading
import uuid
from collections import defaultdict

from engine.config import EngineConfig
from engine.events import Error, TokenEvent
from engine.handle import RequestOutput, RequestStream, _deliver, collect_events
from engine.engine_calls import RemoteEngineCalls, child_engine_op
from engine.env import set_in_this_process
from engine.model_files import ModelLoadError
from engine.process_tree import ParentLink, StopOnSigterm, detach_from_parent
from engine.request import GenerateRequest, SamplingParams
from engine.stats import EngineStats

log = logging.getLogger("openinfer.engine")
START_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "MemoryError": MemoryError,
                "ModelLoadError": ModelLoadError}
POLL_S = 0.25                    # the child's wait for a message: how soon it sees a SIGTERM's stop


class _LoopBox:
    """What a RequestStream needs of its mailbox here: the loop its events arrive on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop


class EngineClient(RemoteEngineCalls):
    def __init__(self, config: EngineConfig, start_timeout_s: float = 1800.0, notes=None, *,
                 env: dict[str, str] | None = None, siblings: tuple["EngineClient", ...] = (), wait: bool = True):
        """`notes(handle, device) -> [(log level, line)]`, if given, runs in the engine process once the
        engine is up (what to say at start about the device: only that process may touch CUDA, a forked
        child cannot use a CUDA context its parent created); its lines are `startup_notes`. env: variables set
        in the engine process before its engine is built (a data-parallel replica's CUDA_VISIBLE_DEVICES);
        siblings: engine processes started before this one, whose pipe ends its process closes (else their
        input would never see EOF); wait False: return once the process is started, `wait_ready` then waits."""
        config.validate()
        self.config = config
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        self._to_child, child_in = ctx.Pipe(duplex=False)[::-1]
        child_out, self._from_child = ctx.Pipe(duplex=False)[::-1]
        ends = self.parent_ends + tuple(end for sibling in siblings for end in sibling.parent_ends)
        link = ParentLink.here(ends, forked=ctx.get_start_method() == "fork")
        self._proc = ctx.Process(target=_child_main, args=(config, child_in, child_out, notes, link, env or {}),
                                 name="openinfer-engine", daemon=True)
        self._reap_lock = threading.Lock()
        self._proc.start()
        child_in.close()
        child_out.close()
        self._closed = self._gone = self._ready = False
        if wait:
            self.wait_ready(start_timeout_s)

    @property
    def parent_ends(self) -> tuple:
        """This process's ends of the engine process's pipes."""
        return self._to_child, self._from_child

    @property
    def pid(self) -> int:
        return self._proc.pid

    def wait_ready(self, timeout_s: float = 1800.0, tokenizer=None) -> None:
        """Until the engine process is up (its start-up error raised here); tokenizer: the model's, where
        another client already loaded it."""
        msg = self._wait_ready(timeout_s)
        if msg[0] == "error":
            self.wait(10)
            raise START_ERRORS.get(msg[1], RuntimeError)(msg[2])
        info = msg[1]
        self.model_name, self.max_model_len, self.max_n = info["model_name"], info["max_model_len"], info["max_n"]
        self.vocab_size, self.model_path = info["vocab_size"], info["model_path"]
        self.num_kv_blocks: int = info["num_kv_blocks"]
        self.startup_notes: list[tuple[int, str]] = info["notes"]
        self.tokenizer = tokenizer or _load_tokenizer(self.model_path)
        self._stats = EngineStats()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._stopping: str | None = None       # the signal the child was sent, once it said so
        self._end: tuple[str, bool] | None = None
        self._on_end = None
        self._reader = threading.Thread(target=self._read, name="openinfer-engine-reader", daemon=True)
        self._reader.start()
        self._ready = True
        atexit.register(self.shutdown)          # before multiprocessing's own exit handler SIGTERMs the child

    def kill(self) -> None:
        """End the engine process now (one that has not said it is ready: nothing to drain)."""
        self._closed = True
        self._proc.kill()
        self.wait(10)

    def _wait_ready(self, timeout: float) -> tuple:
        """The child's first message: ("ready", info) or ("error", kind, message)."""
        try:
            if self._from_child.poll(timeout):
                return self._from_child.recv()
        except EOFError:
            raise RuntimeError(f"the engine process ended while starting ({exit_text(self.wait(10))})") from None
        self._proc.kill()
        raise RuntimeError(f"the engine process did not start in {timeout:.0f} s")

    # -- the serving surface (EngineHandle's) -------------------------------------------------
    def submit(self, req: GenerateRequest) -> RequestStream:
        if self._closed or not self._alive():
            raise RuntimeError("engine is shut down")
        if self._stopping:
            raise RuntimeError(f"the engine process is stopping ({self._stopping})")
        stream = RequestStream(self, req.request_id, _LoopBox(asyncio.get_running_loop()))
        with self._lock:
            self._streams[req.request_id] = stream
        self._send(("add", req))
        return stream

    def abort(self, request_id: str) -> None:
        if not (self._closed or self._gone):
            try:
                self._send(("abort", request_id))
            except OSError:                  # the engine process has just ended: nothing left to abort
                pass

    def stats(self) -> EngineStats:
        return self._stats

    def in_flight(self) -> int:
        """Requests sent and not yet ended (running or waiting in the engine, or their last events on the way)."""
        return len(self._streams)

    def holds(self, request_id: str) -> bool:
        return request_id in self._streams

    def is_healthy(self) -> bool:
        return not (self._closed or self._gone or self._stopping) and self._alive()

    def on_end(self, callback) -> None:
        """callback(why, failed), once, from the reader thread (or here, if it already happened): when the
        engine process says it is stopping (a SIGTERM sent to it; failed False) or ends without shutdown()
        (killed, crashed; failed True)."""
        with self._lock:
            self._on_end, end = callback, self._end
        if end is not None:
            callback(*end)

    def _report_end(self, why: str, failed: bool) -> None:
        with self._lock:
            if self._end is not None:
                return
            self._end, callback = (why, failed), self._on_end
        if callback is not None:
            callback(why, failed)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion; blocks (not from a running event loop)."""
        return generate_through(self, prompts, params)

    def shutdown(self) -> None:
        if self._closed:
            return
        if not self._ready:
            self.kill()
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        try:
            self._send(("stop",))
        except OSError:
            pass
        if self.wait(30) is None:
            self._proc.kill()
        self._to_child.close()

    def wait(self, timeout: float | None = None) -> int | None:
        """The engine process's exit code once it has ended (None: still running after `timeout` s). Waits one
        thread at a time: multiprocessing's join or is_alive in two threads at once can reap the child in one
        and answer "still running" in the other."""
        with self._reap_lock:
            self._proc.join(timeout)
            return self._proc.exitcode

    def _alive(self) -> bool:
        with self._reap_lock:
            return self._proc.is_alive()

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- the pipes ------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        with self._send_lock:
            self._to_child.send(msg)

    def _read(self) -> None:
        """Reader thread: hand each batch of events to its streams' loops; on the child's end, fail
        every open stream."""
        try:
            while True:
                msg = pickle.loads(self._from_child.recv_bytes())
                if msg[0] == "op":               # the answer to a run-time op (engine_calls.py)
                    self.engine_op_reply(msg)
                    continue
                if msg[0] == "stopping":
                    self._stopping = msg[1]
                    log.warning("the engine process received %s: it ends once its running requests have", msg[1])
                    self._report_end(f"the engine process received {msg[1]}", failed=False)
                    continue
                kind, items, stats = msg
                self._stats = stats
                self._dispatch(items)
        except (EOFError, OSError):
            pass
        self._gone = True
        self.engine_op_reply(("op", None, 503, "the engine process ended"))
        with self._lock:
            left = list(self._streams.items())
            self._streams.clear()
        if not self._closed:
            why = f"the engine process ended ({exit_text(self.wait(5))})"
            log.log(logging.INFO if self._stopping else logging.ERROR, "%s", why)
            self._report_end(why, failed=not self._stopping)
        self._dispatch_to([(s, Error(rid, "the engine process ended")) for rid, s in left]
                          + [(s, None) for _, s in left])

    def _dispatch(self, items: list[tuple[str, TokenEvent | None]]) -> None:
        pairs = []
        with self._lock:
            for rid, event in items:
                stream = self._streams.get(rid)
                if stream is None:
                    continue
                if event is None:
                    del self._streams[rid]
                pairs.append((stream, event))
        self._dispatch_to(pairs)

    @staticmethod
    def _dispatch_to(pairs: list) -> None:
        by_loop = defaultdict(list)
        for stream, event in pairs:
            by_loop[stream._mailbox.loop].append((stream, event))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
            except RuntimeError:             # that loop closed: nobody is listening
                pass


def generate_through(handle, prompts: list[str | list[int]], params: SamplingParams | None = None
                     ) -> list[RequestOutput]:
    """Run prompts (text or token ids) to completion through `handle.submit`; blocks (not from a running loop)."""
    params = params or SamplingParams()

    async def run() -> list[RequestOutput]:
        async def one(prompt) -> RequestOutput:
            tokens = handle.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            rid = f"generate-{uuid.uuid4().hex}"
            events = [e async for e in handle.submit(GenerateRequest(rid, tokens, params))]
            return collect_events(rid, tokens, events, params.n)
        return list(await asyncio.gather(*(one(p) for p in prompts)))
    return asyncio.run(run())


def exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    return f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


def _load_tokenizer(folder: str):
    from engine.loader.hf import read_generation_config
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder, read_generation_config(folder, ModelConfig.from_file(folder)))


# ---- the child ------------------------------------------------------------------------------------
def _child_main(config: EngineConfig, inbox, outbox, notes=None, link: ParentLink | None = None,
                env: dict[str, str] | None = None) -> None:
    from engine.handle import EngineHandle

    if link is not None:
        detach_from_parent(link, keep=(inbox, outbox))
    set_in_this_process(env or {})               # before anything here touches CUDA
    # Ctrl-C reaches the whole process group: the parent drains, then stops the engine ("stop")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        handle = EngineHandle(config)
    except Exception as e:                       # a bad flag or model: the parent raises it
        outbox.send(("error", type(e).__name__, str(e)))
        return
    engine = handle.engine
    outbox.send(("ready", dict(model_name=handle.model_name, max_model_len=handle.max_model_len, max_n=handle.max_n,
                               vocab_size=handle.executor.vocab_size, model_path=handle.model_path,
                               num_kv_blocks=handle.executor.num_kv_blocks,
                               notes=notes(handle, config.device) if notes else [])))
    sender = _Sender(outbox)
    pending: list = []

    def flush() -> None:                         # engine thread, after a step's events
        items = pending[:]
        pending.clear()
        sender.put(pickle.dumps(("events", items, engine.stats()), protocol=pickle.HIGHEST_PROTOCOL))

    # the stats reach the parent with a step's events: the end of the warm-up has none, so it sends them
    def send_stats() -> None:
        sender.put(pickle.dumps(("events", [], engine.stats()), protocol=pickle.HIGHEST_PROTOCOL))

    engine.warm_listeners.append(send_stats)
    if not engine.stats().warming_up:           # done before the listener was in place (a sent twice is harmless)
        send_stats()

    running: set[str] = set()

    def sink_for(rid: str):
        def sink(event) -> None:
            if not pending:
                engine.call_after_step(flush)
            pending.append((rid, event))
            if event is None:
                running.discard(rid)
        return sink

    _serve_inbox(engine, inbox, sender, sink_for, running)
    handle.shutdown()
    sender.close()


def _serve_inbox(engine, inbox, sender: "_Sender", sink_for, running: set[str]) -> None:
    """The child's main thread: the parent's messages to the engine, until "stop", the parent's end (EOF)
    or, after a SIGTERM, the end of the last running request."""
    stopping = pickle.dumps(("stopping", "SIGTERM"))
    stop = StopOnSigterm(lambda: sender.put(stopping))      # SimpleQueue.put: safe in a signal handler
    try:
        while not (stop.requested and not running):
            if not inbox.poll(POLL_S):
                continue
            msg = inbox.recv()
            if msg[0] == "add":
                running.add(msg[1].request_id)
                engine.add_request(msg[1], sink_for(msg[1].request_id))
            elif msg[0] == "abort":
                engine.abort(msg[1])
            elif msg[0] == "op":
                child_engine_op(engine, msg[1], msg[2], lambda answer: sender.put(pickle.dumps(answer)))
            else:
                break
    except (EOFError, OSError):                  # the parent is gone
        pass


class _Sender:
    """A thread that writes pickled batches to the pipe, so the engine thread never waits on it."""

    def __init__(self, conn):
        self.conn, self.q = conn, queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="openinfer-engine-sender", daemon=True)
        self.thread.start()

    def put(self, data: bytes) -> None:
        self.q.put(data)

    def _run(self) -> None:
        while (data := self.q.get()) is not None:
            try:
                self.conn.send_bytes(data)
            except OSError:
                return

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(10)

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
step that produced events, and ("op", call id, status, message) answering a run-time op
(engine/engine_calls.py). The child pickles on the engine thread (one dumps per step) and a sender thread
writes; the parent's reader thread hands each batch to the asyncio loops of its streams in one wake-up
per loop. The parent loads only the tokenizer (for the server's prompt encoding and chat templates).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import pickle
import queue
import threading
from collections import defaultdict

from engine.config import EngineConfig
from engine.events import Error, TokenEvent
from engine.handle import RequestOutput, RequestStream, _deliver, collect_events
from engine.engine_calls import RemoteEngineCalls, child_engine_op
from engine.request import GenerateRequest, SamplingParams
from engine.stats import EngineStats

log = logging.getLogger("openinfer.engine")
START_ERRORS = {"ValueError": ValueError, "FileNotFoundError": FileNotFoundError, "MemoryError": MemoryError}


class _LoopBox:
    """What a RequestStream needs of its mailbox here: the loop its events arrive on."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop


class EngineClient(RemoteEngineCalls):
    def __init__(self, config: EngineConfig, start_timeout_s: float = 1800.0, notes=None):
        """`notes(handle, device) -> [(log level, line)]`, if given, runs in the engine process once the
        engine is up (what to say at start about the device: only that process may touch CUDA, a forked
        child cannot use a CUDA context its parent created); its lines are `startup_notes`."""
        config.validate()
        self.config = config
        ctx = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")
        self._to_child, child_in = ctx.Pipe(duplex=False)[::-1]
        child_out, self._from_child = ctx.Pipe(duplex=False)[::-1]
        self._proc = ctx.Process(target=_child_main, args=(config, child_in, child_out, notes), name="openinfer-engine",
                                 daemon=True)
        self._proc.start()
        child_in.close()
        child_out.close()
        if not self._from_child.poll(start_timeout_s):
            self._proc.kill()
            raise RuntimeError(f"the engine process did not start in {start_timeout_s:.0f} s")
        msg = self._from_child.recv()
        if msg[0] == "error":
            self._proc.join(10)
            raise START_ERRORS.get(msg[1], RuntimeError)(msg[2])
        info = msg[1]
        self.model_name, self.max_model_len, self.max_n = info["model_name"], info["max_model_len"], info["max_n"]
        self.vocab_size, self.model_path = info["vocab_size"], info["model_path"]
        self.startup_notes: list[tuple[int, str]] = info["notes"]
        self.tokenizer = _load_tokenizer(self.model_path)
        self._stats = EngineStats()
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = self._gone = False
        self._reader = threading.Thread(target=self._read, name="openinfer-engine-reader", daemon=True)
        self._reader.start()

    # -- the serving surface (EngineHandle's) -------------------------------------------------
    def submit(self, req: GenerateRequest) -> RequestStream:
        if self._closed or not self._proc.is_alive():
            raise RuntimeError("engine is shut down")
        stream = RequestStream(self, req.request_id, _LoopBox(asyncio.get_running_loop()))
        with self._lock:
            self._streams[req.request_id] = stream
        self._send(("add", req))
        return stream

    def abort(self, request_id: str) -> None:
        if not self._closed:
            self._send(("abort", request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def is_healthy(self) -> bool:
        return not (self._closed or self._gone) and self._proc.is_alive()

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion; blocks (not from a running event loop)."""
        params = params or SamplingParams()

        async def run() -> list[RequestOutput]:
            async def one(prompt) -> RequestOutput:
                ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
                rid = f"generate-{next(self._ids)}"
                events = [e async for e in self.submit(GenerateRequest(rid, ids, params))]
                return collect_events(rid, ids, events, params.n)
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        return asyncio.run(run())

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send(("stop",))
        except OSError:
            pass
        self._proc.join(30)
        if self._proc.is_alive():
            self._proc.kill()
        self._to_child.close()

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
            log.error("the engine process ended (exit code %s)", self._proc.exitcode)
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


def _load_tokenizer(folder: str):
    from engine.loader.hf import read_generation_config
    from engine.model_config import ModelConfig
    from engine.tokenizer import Tokenizer

    return Tokenizer.from_folder(folder, read_generation_config(folder, ModelConfig.from_file(folder)))


# ---- the child ------------------------------------------------------------------------------------
def _child_main(config: EngineConfig, inbox, outbox, notes=None) -> None:
    import signal

    from engine.handle import EngineHandle

    # the parent decides when the engine stops ("stop"): a signal to the whole process group (Ctrl-C,
    # systemd's SIGTERM) must not end the engine in the middle of the server's drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        handle = EngineHandle(config)
    except Exception as e:                       # a bad flag or model: the parent raises it
        outbox.send(("error", type(e).__name__, str(e)))
        return
    engine = handle.engine
    outbox.send(("ready", dict(model_name=handle.model_name, max_model_len=handle.max_model_len, max_n=handle.max_n,
                               vocab_size=handle.executor.vocab_size, model_path=handle.model_path,
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

    def sink_for(rid: str):
        def sink(event) -> None:
            if not pending:
                engine.call_after_step(flush)
            pending.append((rid, event))
        return sink

    try:
        while True:
            msg = inbox.recv()
            if msg[0] == "add":
                engine.add_request(msg[1], sink_for(msg[1].request_id))
            elif msg[0] == "abort":
                engine.abort(msg[1])
            elif msg[0] == "op":
                child_engine_op(engine, msg[1], msg[2], lambda answer: sender.put(pickle.dumps(answer)))
            else:
                break
    except (EOFError, OSError):                  # the parent is gone
        pass
    handle.shutdown()
    sender.close()


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

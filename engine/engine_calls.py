"""Run-time engine ops, as the server calls them on either engine handle: LoRA adapter loads and unloads,
the device prefix cache's reset, and a request's grammar check. Each op runs next to the engine loop
(`run_engine_op`) and answers once, with None or an error that carries the HTTP status the server
answers with (LoRAError for the LoRA ops, GrammarError for the check, EngineCallError otherwise),
whatever fails: an unexpected exception in any part of an op is its answer too (a 500 naming the op),
and an op on an engine that has stopped answers 503 at once. The prefix-cache reset answers once the
host tier's offload of the evicted blocks has landed (a request right after it then waits for no
device-to-host copy).

`EngineCalls` is the surface EngineHandle (engine in this process, `LocalEngineCalls`) and EngineClient
(engine in a child process, engine/process.py, `RemoteEngineCalls`) share: `lora_adapters` (the served
names -> paths), `load_lora_adapter`, `unload_lora_adapter`, `reset_prefix_cache`, `check_grammar`
(coroutines). An adapter folder is read on a thread of its own (never the engine thread), then
registered on the engine thread; an unload answers once no sequence uses the adapter; the reset runs
between two steps; a grammar compiles and is probed on a worker of the engine's grammar cache
(engine/grammar.py), where the request's admission then finds it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
from typing import TYPE_CHECKING, Callable

from engine.config import EngineConfig
from engine.grammar import GrammarError
from engine.lora import LoRAError

if TYPE_CHECKING:
    from engine.tokenizer import TokenizerBase

log = logging.getLogger("openinfer.engine")
NOT_ENABLED = "LoRA is not enabled: start the server with --enable-lora"
LORA_OPS = ("load", "unload")
NO_GRAMMARS = "structured output is not available with this tokenizer"


class EngineCallError(Exception):
    """A run-time op that failed outside LoRA (the engine process has ended); `status`: the HTTP status."""

    def __init__(self, message: str, status: int = 503):
        super().__init__(message)
        self.status = status


def run_engine_op(engine, op: tuple, reply: Callable[[Exception | None], None]) -> None:
    """op ("load", name, path, in_place), ("unload", name), ("reset_prefix_cache",) or ("check_grammar",
    grammar) on an EngineLoop; reply(None or the error) once, from whichever thread finishes it. Every part runs guarded: whatever
    it raises is the op's answer (`op_failure`), so no caller waits for ever."""
    guard = functools.partial(_guarded, op, reply)
    guard(lambda: _start_op(engine, op, reply, guard))()


def _start_op(engine, op: tuple, reply: Callable[[Exception | None], None], guard) -> None:
    if op[0] == "check_grammar":
        _check_grammar(engine.admission.grammars, op[1], reply, guard)
        return
    if op[0] == "reset_prefix_cache":
        def reset() -> None:                   # engine thread; the answer once the offload has landed
            engine.reset_prefix_cache()
            landed = engine.executor.copy_fence()

            def wait() -> None:
                try:
                    landed()
                except Exception as e:         # noqa: BLE001 - the caller gets it as the op's error
                    reply(EngineCallError(f"prefix cache reset: the host tier's copies failed: {e}", 500))
                    return
                reply(None)
            threading.Thread(target=guard(wait), name="openinfer-reset-wait", daemon=True).start()
        engine.call(guard(reset))
        return
    registry = engine.loras
    if registry is None:
        reply(LoRAError(NOT_ENABLED))
        return
    if op[0] == "unload":
        engine.call(guard(lambda: registry.remove(op[1], reply)))
        return

    def add(adapter) -> None:                  # engine thread
        registry.add(adapter, replace=op[3])
        reply(None)

    def read() -> None:
        adapter = registry.read(op[1], op[2])
        engine.call(guard(lambda: add(adapter)))

    threading.Thread(target=guard(read), name="openinfer-lora-read", daemon=True).start()


def _check_grammar(grammars, grammar: str, reply: Callable[[Exception | None], None], guard) -> None:
    """reply(None or the GrammarError) once `grammar` is compiled and probed in `grammars` (the engine's
    GrammarCache; None: structured output is off), beside the engine thread, never on it."""
    if grammars is None:
        reply(GrammarError(NO_GRAMMARS))
        return

    def answer() -> None:
        problem = grammars.check(grammar)
        reply(None if problem is None else GrammarError(problem))
    grammars.run_check(grammar, guard(answer))


def op_failure(op: tuple, err: Exception) -> LoRAError | EngineCallError:
    """The answer to an op that raised an unexpected `err`: a 500 naming the op and the error."""
    what = {"load": "loading LoRA adapter {!r} from {}", "unload": "unloading LoRA adapter {!r}",
            "check_grammar": "checking a grammar"}.get(op[0], "the prefix cache reset").format(*op[1:3])
    message = f"{what} failed: {type(err).__name__}: {err}"
    return LoRAError(message, 500) if op[0] in LORA_OPS else EngineCallError(message, 500)


def _guarded(op: tuple, reply: Callable[[Exception | None], None], fn: Callable[[], None]) -> Callable[[], None]:
    def run() -> None:
        try:
            fn()
        except (LoRAError, EngineCallError) as e:
            reply(e)
        except Exception as e:                 # noqa: BLE001 - answered as the op's error, never lost
            log.exception("engine op %s failed", op[0])
            reply(op_failure(op, e))
    return run


def settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


class EngineCalls:
    """The base of the engine handles: what the server asks of an engine besides submit / abort / stats, each
    declared here; `_engine_op(op)` sends one op to run_engine_op."""
    config: EngineConfig            # the engine's settings (enable_lora, lora_modules)
    max_n: int                      # the most samples (n) a request may ask for
    tokenizer: TokenizerBase        # the model's (the server encodes prompts and renders chats with it)
    executor = None                 # the executor, where the engine runs in this process (EngineHandle)
    data_parallel_size = 1          # engines behind the handle (DataParallelClient: its replicas)
    _lora_served: dict[str, str] | None = None

    def is_healthy(self) -> bool:
        """Whether the engine still serves requests."""
        raise NotImplementedError

    def on_end(self, callback: Callable[[str, bool], None]) -> None:
        """callback(why, failed), once, when an engine in a process of its own ends (EngineClient); an engine
        in this process reports nothing."""

    @property
    def lora_adapters(self) -> dict[str, str]:
        """The adapters served now: name -> path (--lora-modules, then run-time loads and unloads)."""
        if self._lora_served is None:
            self._lora_served = dict(self.config.lora_modules)
        return self._lora_served

    async def load_lora_adapter(self, name: str, path: str, in_place: bool = False) -> None:
        """Load an adapter under a new name, or with `in_place` under a loaded one (vLLM's load_inplace):
        requests from then on use the new adapter, those running end on the old."""
        if not self.config.enable_lora:
            raise LoRAError(NOT_ENABLED)
        if name in self.lora_adapters and not in_place:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded (load it with 'load_inplace' to replace it)")
        await self._engine_op(("load", name, path, in_place))
        self.lora_adapters[name] = path

    async def unload_lora_adapter(self, name: str) -> None:
        """Returns once no request uses the adapter; the name is not served from the call on."""
        if not self.config.enable_lora:
            raise LoRAError(NOT_ENABLED)
        path = self.lora_adapters.pop(name, None)
        try:
            await self._engine_op(("unload", name))
        except LoRAError:
            if path is not None:
                self.lora_adapters[name] = path
            raise

    async def reset_prefix_cache(self) -> None:
        """Evict every unreferenced block of the device prefix cache (to the host tier where there is one);
        returns once done, between steps."""
        await self._engine_op(("reset_prefix_cache",))

    async def check_grammar(self, grammar: str) -> None:
        """Compile and probe a request's grammar in the engine's grammar cache, the one its admission
        uses (one compile per grammar); GrammarError naming why it cannot be enforced."""
        await self._engine_op(("check_grammar", grammar))

    async def engine_op(self, op: tuple) -> None:
        """One op as run_engine_op takes it, on this engine (a data-parallel client sends each replica its ops)."""
        await self._engine_op(op)

    async def _engine_op(self, op: tuple) -> None:
        raise NotImplementedError


class LocalEngineCalls(EngineCalls):
    """EngineHandle's: run_engine_op on its own engine loop."""

    async def _engine_op(self, op: tuple) -> None:
        if not self.engine.is_alive():
            raise EngineCallError("the engine is not running", 503)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        run_engine_op(self.engine, op, lambda err: loop.call_soon_threadsafe(settle, future, err))
        err = await future
        if err is not None:
            raise err


class RemoteEngineCalls(EngineCalls):
    """EngineClient's: the op goes down the pipe as ("op", call id, op); the child answers
    ("op", call id, status, message) (status 0: done), which the reader thread hands to `engine_op_reply`;
    a failed op raises LoRAError for the LoRA ops, GrammarError for the grammar check (status 400),
    EngineCallError for the others."""
    _ops_waiting: dict | None = None     # call id -> (loop, future), from the first op on
    _gone = False                        # the reader has failed every waiting call already

    async def _engine_op(self, op: tuple) -> None:
        if self._ops_waiting is None:
            self._ops_waiting, self._op_ids = {}, iter(range(1, 1 << 62))
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._op_ids)
        self._ops_waiting[call_id] = (loop, future)
        try:
            if self._gone:
                raise EOFError
            self._send(("op", call_id, op))
        except (EOFError, OSError, ValueError):
            self._ops_waiting.pop(call_id, None)
            raise EngineCallError("the engine process ended", 503) from None
        status, message = await future
        if status == GrammarError.status and op[0] == "check_grammar":
            raise GrammarError(message)
        if status:
            raise (LoRAError if op[0] in LORA_OPS else EngineCallError)(message, status)

    def engine_op_reply(self, msg: tuple) -> None:
        """Reader thread: ("op", call id, status, message) from the child; (None, status, message)
        fails every call still waiting (the child has gone)."""
        _, call_id, status, message = msg
        waiting = self._ops_waiting or {}
        for key in list(waiting) if call_id is None else [call_id]:
            loop, future = waiting.pop(key, (None, None))
            if loop is not None:
                loop.call_soon_threadsafe(settle, future, (status, message))


def child_engine_op(engine, call_id: int, op: tuple, send: Callable[[tuple], None]) -> None:
    """The child's side of RemoteEngineCalls: run the op, send the answer tuple back."""
    def reply(err: Exception | None) -> None:
        send(("op", call_id, 0, "") if err is None else ("op", call_id, err.status, str(err)))

    run_engine_op(engine, op, reply)

"""Data parallelism on one host (vLLM's --data-parallel-size): N engine processes (engine/process.py), each
a whole engine with its own scheduler, KV pool and prefix cache, behind one EngineHandle surface, so one
HTTP endpoint serves them all.

- Placement (engine/process_placement.py): one GPU (or TP GPUs) each where enough are visible, else all on
  the one GPU with ~1/N of the memory each, or N numpy engines on the CPU.
- Dispatch (engine/process_dispatch.py): each request to the least loaded replica, or to a nearly as idle one
  holding a longer prefix of its prompt; a request naming a replica (GenerateRequest.data_parallel_rank,
  vLLM's X-data-parallel-rank header) goes there.
- Aborts go to the replica serving the request; run-time ops (LoRA loads and unloads, the prefix-cache reset,
  grammar checks) to every replica, answered once all have (a load refused by some is undone on the others).
- stats() is the replicas' sum; replica_stats() each one's; healthy while all are; the first replica to end
  (killed, crashed, or SIGTERM'd) ends the whole, as one engine process's end does (on_end).
- KV events: replica r publishes with data_parallel_rank r on the endpoints' ports + r.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from functools import partial

from engine.config import EngineConfig
from engine.engine_calls import EngineCalls
from engine.handle import RequestOutput, RequestStream
from engine.process import EngineClient, generate_through
from engine.process_dispatch import Dispatcher, load_score, prompt_chain
from engine.process_placement import Placement, check_event_endpoints, place_replicas, visible_gpus
from engine.request import GenerateRequest, SamplingParams
from engine.stats import EngineStats

log = logging.getLogger("openinfer.engine")


def start_replicas(config: EngineConfig, placement: Placement, notes=None,
                   start_timeout_s: float = 1800.0) -> list[EngineClient]:
    """The replicas' engine processes, up (all at once, or one after another when they share a GPU); on a
    start-up error the started ones are ended and the error raised."""
    started: list[EngineClient] = []
    try:
        for place in placement.replicas:
            replica_config = dataclasses.replace(config, data_parallel_rank=place.rank,
                                                 gpu_memory_utilization=place.gpu_memory_utilization)
            client = EngineClient(replica_config, start_timeout_s, notes, env=place.env, siblings=tuple(started),
                                  wait=False)
            started.append(client)
            if placement.one_by_one:
                client.wait_ready(start_timeout_s, started[0].tokenizer if len(started) > 1 else None)
        if not placement.one_by_one:
            for client in started:
                client.wait_ready(start_timeout_s, started[0].tokenizer if client is not started[0] else None)
    except BaseException:
        for client in started:
            client.kill()
        raise
    return started


class DataParallelClient(EngineCalls):
    def __init__(self, config: EngineConfig, start_timeout_s: float = 1800.0, notes=None,
                 gpus: list[str] | None = None):
        """config.data_parallel_size replicas of config; notes as EngineClient's (run in each engine process);
        gpus: the visible GPUs' CUDA_VISIBLE_DEVICES entries (None: counted, engine/process_placement.py)."""
        config.validate()
        check_event_endpoints(config)
        self.config = config
        self.placement = place_replicas(config, visible_gpus(config.device) if gpus is None else gpus)
        self.replicas = start_replicas(config, self.placement, notes, start_timeout_s)
        first = self.replicas[0]
        self.model_name, self.max_model_len, self.max_n = first.model_name, first.max_model_len, first.max_n
        self.vocab_size, self.model_path, self.tokenizer = first.vocab_size, first.model_path, first.tokenizer
        self.data_parallel_size = len(self.replicas)
        self.dispatcher = Dispatcher([r.num_kv_blocks + config.host_kv_blocks for r in self.replicas])
        self.dispatched = [0] * self.data_parallel_size     # requests sent to each replica
        self.startup_notes = [(logging.INFO, self.placement.describe())] + [
            (level, f"{line} [engine process {rank}]") for rank, r in enumerate(self.replicas)
            for level, line in r.startup_notes]
        self._lock = threading.Lock()
        self._end: tuple[str, bool] | None = None
        self._on_end = None
        for rank, replica in enumerate(self.replicas):
            replica.on_end(partial(self._replica_ended, rank))

    # -- the serving surface (EngineHandle's) -------------------------------------------------
    def submit(self, req: GenerateRequest) -> RequestStream:
        rank = self._pick(req)
        self.dispatched[rank] += 1
        return self.replicas[rank].submit(req)

    def _pick(self, req: GenerateRequest) -> int:
        chain = prompt_chain(req.prompt_token_ids, req.lora_name)
        if req.data_parallel_rank is not None:
            if not 0 <= req.data_parallel_rank < self.data_parallel_size:
                raise ValueError(f"data_parallel_rank {req.data_parallel_rank} is out of range "
                                 f"[0, {self.data_parallel_size})")
            return self.dispatcher.pinned(req.data_parallel_rank, chain)
        loads = [load_score(r.in_flight(), r.stats().num_waiting) if r.is_healthy() else None
                 for r in self.replicas]
        return self.dispatcher.choose(chain, loads)

    def abort(self, request_id: str) -> None:
        for replica in self.replicas:
            if replica.holds(request_id):
                replica.abort(request_id)
                return

    def stats(self) -> EngineStats:
        """The replicas' stats added up (warming_up while any is)."""
        return summed_stats(self.replica_stats())

    def replica_stats(self) -> list[EngineStats]:
        return [r.stats() for r in self.replicas]

    def is_healthy(self) -> bool:
        return all(r.is_healthy() for r in self.replicas)

    def on_end(self, callback) -> None:
        """callback(why, failed), once: when the first replica ends or says it is stopping (EngineClient.on_end)."""
        with self._lock:
            self._on_end, end = callback, self._end
        if end is not None:
            callback(*end)

    def _replica_ended(self, rank: int, why: str, failed: bool) -> None:
        with self._lock:
            if self._end is not None:
                return
            self._end, callback = (f"replica {rank}: {why}", failed), self._on_end
        if callback is not None:
            callback(*self._end)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run prompts (text or token ids) to completion; blocks (not from a running event loop)."""
        return generate_through(self, prompts, params)

    def shutdown(self) -> None:
        """Stop every replica (each drains what it runs), at once."""
        threads = [threading.Thread(target=r.shutdown, name="openinfer-engine-stop") for r in self.replicas]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def __enter__(self) -> "DataParallelClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # -- run-time ops: every replica ------------------------------------------------------------
    async def reset_prefix_cache(self) -> None:
        await super().reset_prefix_cache()
        self.dispatcher.forget()

    async def _engine_op(self, op: tuple) -> None:
        """The op on every replica at once; the first failure (in rank order) raised once all have answered,
        a new adapter that only some replicas loaded unloaded from them first."""
        results = await asyncio.gather(*(r.engine_op(op) for r in self.replicas), return_exceptions=True)
        failed = [e for e in results if isinstance(e, BaseException)]
        if not failed:
            return
        if op[0] == "load" and not op[3]:
            loaded = [r for r, e in zip(self.replicas, results) if e is None]
            await asyncio.gather(*(r.engine_op(("unload", op[1])) for r in loaded), return_exceptions=True)
        raise failed[0]


SAME_ON_EVERY_REPLICA = ("warming_up", "lora_max_adapters", "lora_adapters_loaded")   # the largest, not the sum


def summed_stats(replicas: list[EngineStats]) -> EngineStats:
    """One EngineStats for several engines: counts and gauges added (per-position counts position by
    position), but for what each replica holds alike (SAME_ON_EVERY_REPLICA: the largest); the adapter names'
    union."""
    rows = [dataclasses.asdict(s) for s in replicas]
    total = {}
    for name, default in dataclasses.asdict(EngineStats()).items():
        values = [row[name] for row in rows]
        if name in SAME_ON_EVERY_REPLICA:
            total[name] = max(values, default=default)
        elif isinstance(default, str):
            total[name] = ",".join(sorted({n for v in values for n in v.split(",") if n}))
        elif isinstance(default, tuple):        # per position: added position by position
            longest = max(map(len, values), default=0)
            total[name] = tuple(sum(v[i] for v in values if i < len(v)) for i in range(longest))
        else:
            total[name] = sum(values)
    return EngineStats(**total)

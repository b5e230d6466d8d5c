"""Host (CPU) time per decode step of the real engine, with a model that costs nothing.

The real EngineHandle (engine thread + asyncio consumer draining every stream) runs with the real
Qwen tokenizer for detokenization and an executor whose device work is free:
  gpu-host  the GPU executor's own host code (GpuExecutor.submit -> DecodeGraphs.launch: batch
            checks, packing into the pinned input buffer, bucket padding, the greedy fast path and
            the SampledToken list) with every CUDA call stubbed out (memcpy, graph launch, D2H copy,
            event); the engine overlaps its output processing with the (free) step as on the GPU;
  instant   returns the sampled tokens directly (the engine core alone).
The model "samples" real text tokens, so detokenization does real work. Every engine step is
timed from outside (wrapped methods, no source edited): scheduler.schedule, ModelBatch.build,
executor.submit / execute, output processing (_process and the deferred _emit_deferred:
scheduler.advance, detokenize, stop checks, event posting), the stats snapshot, and the rest of step(). Only steps where all B sequences decode
count. A cProfile pass over the same decode steps ranks the functions.

    python bench/host_overhead.py --batches 1,8,32,64,128,256 --out bench/results/host-overhead.md
"""
from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import platform
import pstats
import random
import sys
import time
import types
from collections import defaultdict
from datetime import datetime, timezone

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # the repository root first
import engine.engine_loop as engine_loop
from engine.batch import ModelBatch, SampledToken, StepOutput
from engine.config import EngineConfig
from engine.executor.base import ExecutorBase
from engine.executor.options import ExecutorOptions
from engine.handle import EngineHandle
from engine.loop_options import options_within
from engine.request import GenerateRequest, SamplingParams
from engine.tokenizer import Tokenizer

TOKENIZER = "/work/shared/models/qwen-tokenizer"
PHASES = ("schedule", "build", "execute", "process", "stats", "other")
TEXT = os.path.join(os.path.dirname(__file__), "..", "README.md")


# ---- the free model ----------------------------------------------------------------------------
class TextModel:
    """Next token of a sequence: a fixed walk through real text tokens (no EOS, no specials)."""

    def __init__(self, tokenizer: Tokenizer):
        with open(TEXT, encoding="utf-8") as f:
            self.ids = np.asarray(tokenizer.encode(f.read() * 4, add_special_tokens=False), np.int64)

    def next_tokens(self, batch: ModelBatch) -> np.ndarray:
        """One token per sampled row, a function of the sequence and its context length."""
        seq_index = np.searchsorted(batch.cu_seqlens[1:], batch.sample_rows, side="right")
        seq_ids = np.fromiter((batch.seqs[i].seq_id for i in seq_index), np.int64, len(seq_index))
        return self.ids[(seq_ids * 7919 + batch.context_lens[seq_index]) % len(self.ids)]


class InstantExecutor(ExecutorBase):
    def __init__(self, model: TextModel, num_kv_blocks: int, vocab_size: int):
        self.model, self.num_kv_blocks, self.vocab_size = model, num_kv_blocks, vocab_size
        self.options = ExecutorOptions().replace(max_model_len=1 << 20, max_num_batched_tokens=1 << 16, max_num_seqs=4096)

    def execute(self, batch: ModelBatch) -> StepOutput:
        ids = self.model.next_tokens(batch)
        sampled = [s for s in batch.seqs if s.sample]
        return StepOutput([SampledToken(s.seq_id, int(t)) for s, t in zip(sampled, ids)])

    def close(self) -> None:
        pass


class _Dev:
    """A device buffer stand-in: slices are host arrays, the pointer is 0."""

    def __init__(self, n: int):
        self.host = np.zeros(n, np.int32)
        self.data = types.SimpleNamespace(ptr=0)

    def __getitem__(self, key):
        return self.host[key]


class _HostTwins:
    """StepInputs' staging buffers without events (the bench's device buffer is a host array)."""

    def __init__(self, n: int):
        self.buffers, self.turn = [np.zeros(n, np.int32) for _ in range(2)], 0

    @property
    def current(self) -> np.ndarray:
        return self.buffers[self.turn]

    def take(self) -> np.ndarray:
        self.turn ^= 1
        return self.current

    def sent(self, stream) -> None:
        pass


def _stub_cupy() -> None:
    """The few cupy entry points the executor's host path touches, as no-ops (even where cupy
    is installed: nothing here reaches a GPU)."""
    nvtx = types.SimpleNamespace(RangePush=lambda name: None, RangePop=lambda: None)
    runtime = types.SimpleNamespace(memcpyAsync=lambda *a: None, memcpyHostToDevice=1, memcpyDeviceToHost=2)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.ModuleType("cupy.cuda")
    cupy.cuda.runtime, cupy.cuda.nvtx = runtime, nvtx
    cupy.cuda.alloc_pinned_memory = bytearray
    cupy.cuda.Event = lambda **kw: types.SimpleNamespace(record=lambda stream=None: None, synchronize=lambda: None)
    sys.modules["cupy"], sys.modules["cupy.cuda"] = cupy, cupy.cuda


class GpuHostExecutor(ExecutorBase):
    """GpuExecutor's real host code on a Qwen3-8B-shaped executor whose device calls do nothing.
    Steps the decode graphs do not serve (prefill) return tokens directly."""

    def __init__(self, model: TextModel, num_kv_blocks: int, vocab_size: int, max_seqs: int,
                 max_model_len: int, max_num_batched_tokens: int = 2048):
        _stub_cupy()
        from engine.executor.gpu import GpuExecutor
        from engine.executor.gpu_graphs import DecodeGraphs
        from engine.executor.gpu_inputs import StepInputs
        from engine.executor.gpu_readback import Readback
        from engine.executor.gpu_ops import GpuOps
        from engine.executor.options import ExecutorOptions
        ex = GpuExecutor.__new__(GpuExecutor)
        ex.options = ExecutorOptions().replace(max_model_len=max_model_len, max_num_seqs=max_seqs,
                                               max_num_batched_tokens=max(max_num_batched_tokens, max_seqs))
        ex.vocab_size, ex.max_model_len, ex.num_kv_blocks = vocab_size, max_model_len, num_kv_blocks
        ex.plan = types.SimpleNamespace(kv=types.SimpleNamespace(heads=8))
        ex.stream = types.SimpleNamespace(ptr=0, synchronize=lambda: None)
        inputs = StepInputs.__new__(StepInputs)      # its real host code over a host-array "device" buffer
        inputs.stream, inputs.vocab_size, inputs.max_model_len = ex.stream, vocab_size, max_model_len
        inputs.max_tokens, inputs.max_seqs = ex.options.max_num_batched_tokens, max_seqs
        inputs.max_blocks = -(-max_model_len // 16)
        n_inputs = StepInputs.buffers(inputs.max_tokens, inputs.max_seqs, inputs.max_blocks)[0].shape[0]
        inputs.hosts, inputs.device = _HostTwins(n_inputs), _Dev(n_inputs)
        ex.inputs, ex.prefill, ex.piecewise, ex.lora_graphs, ex.num_state_slots = inputs, None, None, None, 0
        ex._fed = False
        ops = GpuOps.__new__(GpuOps)             # its real split choice (splits) over a Qwen3-8B shape
        ops.fast_attention, ops.num_heads, ops.head_dim = True, 32, 128
        ops.shared = types.SimpleNamespace(num_sms=132)
        ex.ops, ex.sampler = ops, types.SimpleNamespace(ids=_Dev(max_seqs))
        ex.last_host_s = 0.0
        ex.readback, ex.timer = Readback(max_seqs, ex.stream, ex.mapped_copy), None
        ex.graphs = DecodeGraphs(None, ops, {}, ex.sampler, ex.upload, ex.readback, ex.stream, ex.options.graph_sizes)
        graph = types.SimpleNamespace(launch=lambda stream=None: None)
        ex.graphs.graphs = {b: (graph, None) for b in ex.graphs.buckets}
        self.ex, self.model, self.batch, self.options = ex, model, None, ex.options
        self.num_kv_blocks, self.vocab_size = num_kv_blocks, vocab_size
        self.instant = InstantExecutor(model, num_kv_blocks, vocab_size)
        self.launched_at = self.result_at = 0.0     # the last graph launch; the last result() return

    def submit(self, batch: ModelBatch):
        from engine.executor.base import DoneStep
        self.batch = batch
        if not self.ex.graphs.serves(batch):
            return DoneStep(self.instant.execute(batch))
        pending = self.ex.submit(batch)
        self.launched_at = time.perf_counter()
        pending.ids_host[:] = self.model.next_tokens(batch)   # what the D2H copy brings
        return _Watched(pending, self)

    def execute(self, batch: ModelBatch) -> StepOutput:
        return self.submit(batch).result()

    def close(self) -> None:
        pass


class _Watched:
    """A launched step whose result() return time is noted: from then until the next launch the
    device would sit idle (the host's exposed time per step)."""

    def __init__(self, pending, owner: GpuHostExecutor):
        self.pending, self.owner = pending, owner

    def result(self) -> StepOutput:
        out = self.pending.result()
        self.owner.result_at = time.perf_counter()
        return out


# ---- timing from outside -------------------------------------------------------------------------
class StepTimer:
    """Wraps the engine's step phases; keeps per-step phase times of the steps that count."""

    def __init__(self, engine, batch: int):
        self.engine, self.batch = engine, batch
        self.cur: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.wanted = 0                         # decode steps to record, from the first one on
        self.decode_only = False
        self.seen_decode = False                # a step with all B sequences decoding ran
        self.profile: cProfile.Profile | None = None
        self.last_result_at = 0.0
        sched = engine.scheduler
        sched.schedule = self._timed("schedule", sched.schedule)
        ex = engine.executor
        if hasattr(ex, "submit"):
            ex.submit = self._timed("execute", ex.submit)
        ex.execute = self._timed("execute", ex.execute)
        engine.outputs.process = self._timed("process", engine.outputs.process)
        engine.outputs.emit_deferred = self._timed("process", engine.outputs.emit_deferred)
        engine._publish_stats = self._timed("stats", engine._publish_stats)
        build = ModelBatch.build
        timer = self

        class TimedBatch(ModelBatch):
            @classmethod
            def build(cls, seqs, *args, **kwargs):
                t0 = time.perf_counter()
                batch = build(seqs, *args, **kwargs)
                timer.cur["build"] += time.perf_counter() - t0
                timer.decode_only = batch.is_decode_only and len(seqs) == timer.batch
                timer.seen_decode |= timer.decode_only
                return batch

        engine_loop.ModelBatch = TimedBatch
        step = engine.step

        def timed_step():
            self.cur = defaultdict(float)
            self.decode_only = False
            recording = self.seen_decode and len(self.steps) < self.wanted
            prof = self.profile if recording else None
            t0 = time.perf_counter()
            if prof is not None:
                prof.enable()
            step()
            if prof is not None:
                prof.disable()
            total = time.perf_counter() - t0
            ex = self.engine.executor
            if recording and self.decode_only:
                self.cur["total"] = total
                self.cur["idle"] = getattr(ex, "launched_at", 0.0) - self.last_result_at
                self.cur["other"] = total - sum(self.cur[p] for p in PHASES if p != "other")
                self.steps.append(dict(self.cur))
            self.last_result_at = getattr(ex, "result_at", 0.0)

        engine.step = timed_step

    def _timed(self, name, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cur[name] += time.perf_counter() - t0
        return wrapper


# ---- one batch size --------------------------------------------------------------------------------
def run_batch(tokenizer: Tokenizer, model: TextModel, batch: int, steps: int, executor_kind: str,
              driver: str, profile: bool, seed: int, schedule_ahead: bool = True) -> tuple[dict, str]:
    rng = random.Random(seed)
    prompt_lens = [rng.randint(128, 2048) for _ in range(batch)]
    # long enough that the first sequence still decodes when the last one's prefill is done
    max_tokens = steps + 64 + batch + sum(prompt_lens) // max(2048 - batch, 256)
    max_model_len = 2048 + max_tokens + 16
    num_kv_blocks = batch * (-(-max_model_len // 16)) + 16
    vocab = tokenizer.vocab_size
    if executor_kind == "gpu-host":
        ex = GpuHostExecutor(model, num_kv_blocks, vocab, max_seqs=max(batch, 1), max_model_len=max_model_len)
    else:
        ex = InstantExecutor(model, num_kv_blocks, vocab)
    config = EngineConfig(max_num_seqs=batch, max_num_batched_tokens=2048, schedule_ahead=schedule_ahead)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    requests = []
    for i, n in enumerate(prompt_lens):                         # prompts of 128..2048 real text tokens
        start = rng.randrange(len(model.ids) - n)
        prompt = [int(t) for t in model.ids[start:start + n]]
        prompt[0] = rng.randrange(1000, 100_000)               # no shared prefixes across requests
        requests.append(GenerateRequest(f"r{i}", prompt, params))
    handle = None
    if driver == "handle":
        handle = EngineHandle(config, executor=ex, tokenizer=tokenizer, model_name="bench",
                              max_model_len=max_model_len)
        engine = handle.engine
    else:
        engine = engine_loop.EngineLoop(ex, tokenizer, options_within(ex.options, config, max_model_len),
                                        tokenizer.eos_token_ids)
    timer = StepTimer(engine, batch)
    timer.profile = cProfile.Profile() if profile else None
    timer.wanted = steps
    t0 = time.perf_counter()
    if handle is not None:
        asyncio.run(_drive_handle(handle, timer, requests))
        handle.shutdown()
    else:
        events: list = []
        for req in requests:
            engine.add_request(req, events.append)
        engine.drain_inbox()
        while len(timer.steps) < steps:
            if not engine.scheduler.has_work():
                raise RuntimeError(f"batch {batch}: requests ended before {steps} full decode steps")
            engine.step()
    wall = time.perf_counter() - t0
    rows = timer.steps[:steps]
    result = {p: float(np.median([r.get(p, 0.0) for r in rows])) * 1e3 for p in PHASES + ("total", "idle")}
    result.update(batch=batch, steps=len(rows), wall_s=wall,
                  mean=float(np.mean([r["total"] for r in rows])) * 1e3,
                  p90=float(np.percentile([r["total"] for r in rows], 90)) * 1e3)
    report = profile_table(timer.profile, len(rows)) if timer.profile is not None else ""
    return result, report


async def _drive_handle(handle: EngineHandle, timer: StepTimer, requests: list[GenerateRequest]) -> None:
    """Submit every request and drain its stream on this asyncio loop (as the server does)."""
    async def consume(stream) -> None:
        async for _ in stream:
            pass

    consumers = [asyncio.ensure_future(consume(handle.submit(r))) for r in requests]
    while len(timer.steps) < timer.wanted:                     # all sequences decode from the first such step
        await asyncio.sleep(0.002)
    for r in requests:
        handle.abort(r.request_id)
    await asyncio.gather(*consumers)


def profile_table(profile: cProfile.Profile, steps: int, top: int = 25) -> str:
    """The functions with the most own time, per decode step."""
    stats = pstats.Stats(profile).stats
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    lines = ["| function | calls / step | own µs / step | with callees µs / step |", "|---|---|---|---|"]
    for (path, line, name), (_, calls, own, cum, _) in rows:
        where = os.path.relpath(os.path.abspath(path), root) if path.startswith(("/", ".")) else path
        label = f"`{where}:{line} {name}`" if line else f"`{name}`"
        lines.append(f"| {label} | {calls / steps:.1f} | {own / steps * 1e6:.1f} | {cum / steps * 1e6:.1f} |")
    return "\n".join(lines)


def table(results: list[dict], idle: bool = False) -> str:
    """idle (gpu-host executor): also the host time from one step's result to the next launch, during
    which a real device would sit idle (what the overlaps leave exposed)."""
    head = ("| batch | steps | total ms | mean / p90 | scheduler | ModelBatch.build | executor call | output processing "
            "| stats | rest of step | µs / sequence |" + (" device idle ms (result -> next launch) |" if idle else ""))
    lines = [head, "|" + "---|" * (12 if idle else 11)]
    for r in results:
        cells = [f"{r[p]:.3f}" for p in PHASES]
        lines.append(f"| {r['batch']} | {r['steps']} | {r['total']:.3f} | {r['mean']:.3f} / {r['p90']:.3f} | "
                     + " | ".join(cells)
                     + f" | {r['total'] * 1e3 / r['batch']:.1f} |" + (f" {r['idle']:.3f} |" if idle else ""))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--steps", type=int, default=64, help="decode steps timed per batch size")
    ap.add_argument("--executor", choices=("gpu-host", "instant"), default="gpu-host")
    ap.add_argument("--driver", choices=("handle", "loop"), default="handle",
                    help="handle: EngineHandle thread + asyncio consumer; loop: EngineLoop stepped here, list sinks")
    ap.add_argument("--profile", default="", help="batch sizes to also run under cProfile, e.g. 64,256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--schedule-ahead", action=argparse.BooleanOptionalAction, default=True,
                    help="EngineConfig.schedule_ahead (plan the next decode step while one runs)")
    ap.add_argument("--out", default="", help="append the markdown section to this file")
    args = ap.parse_args()
    tokenizer = Tokenizer.from_folder(TOKENIZER)
    model = TextModel(tokenizer)
    batches = [int(b) for b in args.batches.split(",")]
    load = os.getloadavg()
    results = []
    for b in batches:
        gc.collect()                                           # the previous batch's engine is garbage
        r, _ = run_batch(tokenizer, model, b, args.steps, args.executor, args.driver, False, args.seed,
                         args.schedule_ahead)
        results.append(r)
        print(f"batch {b}: {r['total']:.3f} ms/step (median of {r['steps']}), wall {r['wall_s']:.1f} s",
              flush=True)
    profiles = []
    for b in [int(x) for x in args.profile.split(",") if x]:
        gc.collect()
        _, rep = run_batch(tokenizer, model, b, args.steps, args.executor, args.driver, True, args.seed,
                           args.schedule_ahead)
        profiles.append(f"cProfile (its own overhead inflates small functions), batch {b}, per decode step:\n\n{rep}")
    when = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = (f"## {when} — executor {args.executor}, driver {args.driver}\n\n"
               f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
               f"Python {platform.python_version()}, numpy {np.__version__}; load average before "
               f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}, after "
               f"{os.getloadavg()[0]:.2f}.\nCommand: `python bench/host_overhead.py {' '.join(sys.argv[1:])}`\n"
               f"Medians over {args.steps} decode steps with every sequence decoding (phase medians need not add "
               f"up to the total's); ms per step.\n\n"
               + table(results, idle=args.executor == "gpu-host") + "\n\n" + "\n\n".join(profiles) + "\n")
    print(section)
    if args.out:
        with open(args.out, "a", encoding="utf-8") as f:
            f.write(section + "\n")


if __name__ == "__main__":
    main()

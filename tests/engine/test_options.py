"""Every engine option reaches the part that uses it (EngineConfig -> ExecutorOptions -> executor,
scheduler, admission), combinations that cannot work are refused at start, and the GPU parts size
themselves from the plan (CPU-only checks of the structure)."""
from __future__ import annotations

import dataclasses
import json
import os
import random

import pytest

from engine.config import EngineConfig
from engine import env
from engine.executor.options import ExecutorOptions, GpuTuning, gpu_tuning_from_env, options_of, resolved_options
from engine.kv_events import KVEventsConfig
from engine.limits import StepLimits
from engine.speculative import SpeculativeConfig
from engine.model_config import ModelConfig
from engine.process_placement import place_replicas
from engine.request import GenerateRequest, SamplingParams
from harness.lora import tiny_adapter_path
from harness.models import tiny_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def non_default_config(model: str) -> EngineConfig:
    return EngineConfig(model=model, device="cpu", dtype="bfloat16", served_model_name="tiny-served",
                        max_model_len=400, max_num_seqs=5, max_num_batched_tokens=96, num_kv_blocks=77,
                        gpu_memory_utilization=0.55, enable_prefix_caching=True, enable_chunked_prefill=False,
                        enforce_eager=True, cuda_graph_sizes=(1, 3), max_n=3, seed=1234, overlap_steps=False,
                        schedule_ahead=False, async_scheduling=False, host_kv_blocks=9,
                        gpu=GpuTuning(decode_kernels="attention", gemm="cublas", pdl=False, nvtx="ops"),
                        progress=False, enable_lora=True, lora_modules=(("ad", tiny_adapter_path("qwen3_untied", "attn8")),),
                        max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                        kv_events_config=KVEventsConfig(True, endpoint="inproc://test-options-kv-events"), cpu_threads=3,
                        speculative_config=SpeculativeConfig("ngram", 2), data_parallel_size=2, data_parallel_rank=1,
                        kv_cache_dtype="fp8")


def block_bytes(path: str, itemsize: int) -> int:
    from engine.loader import load_model

    return load_model(path).model.kv_layout().block_bytes(itemsize)


def offload_slots(path: str, gib: float) -> int:
    """The host tier's slots of an engine given --kv-offload-gib (exclusive with host_kv_blocks, so not in
    the non-default config): the executor's and the scheduler's, which must agree."""
    from engine.handle import EngineHandle

    config = EngineConfig(model=path, device="cpu", kv_offload_gib=gib, num_kv_blocks=16, progress=False)
    with EngineHandle(config) as h:
        slots = h.executor.options.host_kv_blocks
        assert slots == h.engine.scheduler.host_tier.slots.num_slots == h.config.host_kv_blocks
        assert config.kv_offload_gib == gib and config.host_kv_blocks == 0       # the caller's config untouched
        return slots


def test_every_engine_config_field_reaches_its_consumer(tmp_path):
    """Each EngineConfig field, set to a non-default value, is found where it acts. A new field
    without a check here fails the test."""
    import numpy as np
    from ml_dtypes import bfloat16

    from engine.executor.cpu import CpuExecutor
    from engine.handle import EngineHandle
    from engine.loader import load_model

    path = tiny_model_path("qwen3_untied")
    config = non_default_config(path)
    # chunked prefill off: the step budget must hold a whole max_model_len prompt
    config.max_num_batched_tokens = 400
    config.step_trace = str(tmp_path / "steps.jsonl")
    with EngineHandle(config) as h:
        ex, eng = h.executor, h.engine
        opts = ex.options
        raw = load_model(path).weights["layers.0.qkv_proj"]
        checks = {
            "model": h.model_name == "tiny-served" and ex.config.hidden_size == 64,
            "device": isinstance(ex, CpuExecutor),
            "dtype": opts.dtype == "bfloat16" and np.array_equal(
                ex.weights["layers.0.qkv_proj"], np.asarray(raw).astype(bfloat16).astype(np.float32)),
            "served_model_name": h.model_name == "tiny-served",
            "max_model_len": h.max_model_len == 400 == opts.max_model_len == ex.max_model_len,
            "max_num_seqs": opts.max_num_seqs == 5 == eng.scheduler.max_num_seqs,
            "max_num_batched_tokens": opts.max_num_batched_tokens == 400 == eng.scheduler.max_num_batched_tokens,
            "num_kv_blocks": ex.num_kv_blocks == 77 == eng.block_manager.num_blocks,
            "gpu_memory_utilization": opts.gpu_memory_utilization == 0.55,
            "enable_prefix_caching": eng.block_manager.enable_prefix_caching is True,
            "enable_chunked_prefill": eng.scheduler.chunked_prefill is False,
            "enforce_eager": opts.cuda_graphs is False,
            "cuda_graph_sizes": opts.cuda_graph_sizes == (1, 3) and opts.graph_sizes == (1, 3, 5),
            "max_n": eng.admission.limits.max_n == 3,
            "seed": eng.admission.sequence(GenerateRequest("r", [1, 2], SamplingParams()), 1).params.seed
            == random.Random(1234).getrandbits(63),
            "overlap_steps": eng.options.overlap_steps is False,
            "schedule_ahead": eng.options.schedule_ahead is False,
            # off (the default is on, where the loop overlaps steps on an executor that takes fed steps)
            "async_scheduling": eng.options.async_scheduling is False and eng._async is False,
            "host_kv_blocks": opts.host_kv_blocks == 9 == eng.scheduler.host_tier.slots.num_slots
            and ex.host_kv.shape[2] == 9 * 16,
            "gpu": opts.gpu == config.gpu,
            "progress": opts.progress is False,
            "step_trace": opts.time_steps is True and eng.trace.file.name == config.step_trace,
            "enable_lora": eng.loras is not None and eng.admission.loras is eng.loras,
            "lora_modules": eng.loras.id_of("ad") == 1 and h.lora_adapters == dict(config.lora_modules),
            "max_loras": opts.max_loras == 2 == eng.scheduler.max_loras == eng.loras.max_loras
            and len(ex.ops.lora.slots) == 2,
            "max_lora_rank": opts.max_lora_rank == 8 == eng.loras.max_rank,
            "max_cpu_loras": eng.loras.max_cpu_loras == 3,
            "tensor_parallel_size": tensor_parallel_reaches_the_ranks(path),      # LoRA and TP exclude each other
            "quantization": quantization_reaches_the_weights(),   # needs widths of whole 128-blocks
            "kv_offload_gib": offload_slots(path, 0.001) == (0.001 * 2**30) // block_bytes(path, 4),
            # the event log records the block manager's and the host tier's changes
            "kv_events_config": eng.kv_events is not None and eng.scheduler.host_tier.slots.on_move is not None
            and eng.kv_events._on_block in eng.block_manager._stored_subscribers,
            "cpu_threads": opts.cpu_threads == 3 == ex.threads.threads,
            # the engine's speculator runs this config (k = 2: two per-position counters)
            # the server starts data_parallel_size engines (engine/process_replicas.py); this one publishes as rank 1
            "data_parallel_size": len(place_replicas(config, []).replicas) == 2,
            "data_parallel_rank": eng.kv_events.publisher.rank == 1,
            "speculative_config": eng.speculator.config is config.speculative_config
            and eng.speculator.counters.accepted_per_pos == [0, 0],
            # the pool and the host tier hold e4m3 bytes
            "kv_cache_dtype": opts.kv_cache_dtype == "fp8" and ex.kv.dtype.itemsize == ex.host_kv.dtype.itemsize == 1,
        }
        # one resolution: the scheduler plans within the very limits the executor was built for
        assert eng.scheduler.limits is eng.limits is opts.limits
        assert eng.limits == StepLimits(400, 5, 400, chunked_prefill=False)
        h.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert set(checks) == {f.name for f in dataclasses.fields(EngineConfig)}
    assert [name for name, ok in checks.items() if not ok] == []
    steps = [json.loads(line) for line in open(config.step_trace)]
    assert len(steps) == 3 and steps[0]["prefill"] == 3 and [s["decode"] for s in steps[1:]] == [1, 1]


def quantization_reaches_the_weights() -> bool:
    """--quantization fp8 (not in the non-default config: the tiny qwen3's width 64 is no whole 128-block):
    the executor's linear layers are the kept FP8 ones."""
    from engine.executor.cpu import CpuExecutor
    from engine.handle import EngineHandle
    from engine.models.quant_linear import Fp8Linear
    from harness.quant_models import tiny_source

    config = EngineConfig(model=tiny_source("qwen3"), device="cpu", quantization="fp8", num_kv_blocks=16,
                          max_model_len=128, progress=False)
    with EngineHandle(config) as h:
        return isinstance(h.executor, CpuExecutor) and isinstance(h.executor.weights["layers.0.qkv_proj"], Fp8Linear)


def tensor_parallel_reaches_the_ranks(path: str) -> bool:
    """tensor_parallel_size=2: the executor options carry it, rank 0's executor and one follower rank each
    hold half the KV heads."""
    from engine.handle import EngineHandle

    with EngineHandle(EngineConfig(model=path, device="cpu", tensor_parallel_size=2, num_kv_blocks=20,
                                   progress=False)) as h:
        ex = h.executor
        heads = ex.local.config.num_key_value_heads
        return (ex.options.tensor_parallel_size == 2 == ex.world_size and len(ex.followers.executors) == 1
                and ex.local.layout.heads == heads == ex.followers.executors[0].layout.heads
                and 2 * heads == ModelConfig.from_file(path).num_key_value_heads)


def test_every_engine_config_field_has_a_cli_flag():
    from server.cli import build_parser

    sub = build_parser()._subparsers._group_actions[0].choices["serve"]
    flags = {a.dest for a in sub._actions}
    # the GPU kernel choices are environment variables (docs/gpu.md); a replica's rank is set by the server that starts
    # the --data-parallel-size engines (engine/process_replicas.py)
    not_flags = {"gpu", "progress", "data_parallel_rank"}
    missing = [f.name for f in dataclasses.fields(EngineConfig) if f.name not in flags | not_flags]
    assert missing == []


def test_cli_flags_build_the_config():
    from server.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", "--max-num-batched-tokens", "8192", "--max-num-seqs", "300",
                                      "--no-enable-chunked-prefill", "--enforce-eager", "--cuda-graph-sizes", "1", "8",
                                      "--dtype", "bfloat16", "--enable-lora", "--lora-modules", "a=/x", "b=/y",
                                      "--max-loras", "4", "--max-lora-rank", "64", "--max-cpu-loras", "6"])
    c = engine_config(args)
    assert engine_config(build_parser().parse_args(["serve", "--tensor-parallel-size", "2"])).tensor_parallel_size == 2
    assert (c.max_num_batched_tokens, c.max_num_seqs, c.enable_chunked_prefill, c.enforce_eager,
            c.cuda_graph_sizes, c.dtype) == (8192, 300, False, True, (1, 8), "bfloat16")
    assert (c.enable_lora, c.lora_modules, c.max_loras, c.max_lora_rank, c.max_cpu_loras) == (
        True, (("a", "/x"), ("b", "/y")), 4, 64, 6)
    d = engine_config(build_parser().parse_args(["serve"]))
    assert d.max_num_seqs is None and d.max_num_batched_tokens is None      # the device's defaults


@pytest.mark.parametrize("device,limits", [("cuda", (256, 8192)), ("cpu", (64, 76))])
def test_device_defaults_follow_vllm_on_the_gpu(device, limits):
    o = resolved_options(EngineConfig(gpu=GpuTuning()), device, 40960)[1]
    assert (o.max_num_seqs, o.max_num_batched_tokens, o.max_model_len) == (*limits, 40960)
    o = resolved_options(EngineConfig(max_num_batched_tokens=16384, max_num_seqs=512, gpu=GpuTuning()), device, 8192)[1]
    assert (o.max_num_seqs, o.max_num_batched_tokens) == (512, 16384)


@pytest.mark.parametrize("config,device,words", [
    (EngineConfig(max_num_batched_tokens=2048, enable_chunked_prefill=False), "cuda", "chunked prefill off"),
    (EngineConfig(max_num_batched_tokens=64, max_num_seqs=128), "cuda", "must be >= max_num_seqs"),
    (EngineConfig(max_model_len=50000), "cuda", "more than the model's context"),
    (EngineConfig(dtype="float16"), "cuda", "runs bfloat16"),
    (EngineConfig(dtype="float32"), "cuda", "runs bfloat16"),
    (EngineConfig(cuda_graph_sizes=(0, 4)), "cuda", "cuda_graph_sizes"),
    (EngineConfig(gpu=GpuTuning(gemm="cutlass")), "cuda", "cutlass"),
    (EngineConfig(gpu=GpuTuning(decode_kernels="flash")), "cuda", "flash"),
    (EngineConfig(gpu=GpuTuning(prefill_attention="cute:0")), "cuda", "prefill attention"),
])
def test_combinations_that_cannot_work_are_refused_at_start(config, device, words):
    with pytest.raises(ValueError, match=words):
        resolved_options(config, device, 40960)[1]


def test_float_dtypes_are_fine_on_the_cpu():
    for dtype in ("float16", "float32", "auto"):
        assert resolved_options(EngineConfig(dtype=dtype, gpu=GpuTuning()), "cpu", 512)[1].dtype == dtype


@pytest.mark.parametrize("config,words", [
    (EngineConfig(lora_modules=(("a", "/x"),)), "lora_modules needs enable_lora"),
    (EngineConfig(enable_lora=True, lora_modules=(("a", "/x"), ("a", "/y"))), "names must be distinct"),
    (EngineConfig(enable_lora=True, max_lora_rank=512), "max_lora_rank must be in"),
    (EngineConfig(enable_lora=True, max_loras=0), "max_loras must be >= 1"),
    (EngineConfig(enable_lora=True, max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be >= max_loras \(4\)"),
])
def test_lora_settings_that_cannot_work_are_refused(config, words):
    with pytest.raises(ValueError, match=words):
        config.validate()


def test_lora_on_a_line_without_it_is_refused_at_start():
    from engine.executor.cpu import CpuExecutor
    from engine.loader import load_model

    with pytest.raises(ValueError, match="model type 'qwen3_moe' has no LoRA support"):
        CpuExecutor(load_model(tiny_model_path("qwen3_moe")), options_of(num_kv_blocks=8, max_model_len=64, max_loras=1))


def test_host_tier_without_prefix_caching_is_refused():
    EngineConfig(host_kv_blocks=4, enable_prefix_caching=False).validate()       # pure-host mode
    with pytest.raises(ValueError, match="kv_offload_gib or host_kv_blocks"):
        EngineConfig(host_kv_blocks=4, kv_offload_gib=1.0).validate()
    EngineConfig(kv_offload_gib=1.0, enable_prefix_caching=False).validate()


def test_environment_is_read_once_into_gpu_tuning():
    env = {"OPENINFER_DECODE_KERNELS": "attention,gemv:4", "OPENINFER_GEMM": "cublas",
           "OPENINFER_PREFILL_ATTENTION": "paged", "OPENINFER_PDL": "0", "OPENINFER_GEMV_UNROLL": "3",
           "OPENINFER_GEMV_UNROLL_NARROW": "6", "OPENINFER_LAYER_RANGES": "ops", "OPENINFER_CHUNK_ATTENTION": "0",
           "OPENINFER_ASYNC_HOST_TIER": "0"}
    assert gpu_tuning_from_env(env) == GpuTuning(decode_kernels="attention,gemv:4", gemm="cublas",
                                                 prefill_attention="paged", pdl=False, gemv_unroll=3,
                                                 gemv_unroll_narrow=6, nvtx="ops", chunk_attention=False,
                                                 async_host_tier=False)
    assert gpu_tuning_from_env({}) == GpuTuning()
    for name, value in (("OPENINFER_GEMV_UNROLL", "x"), ("OPENINFER_LAYER_RANGES", "2")):
        with pytest.raises(ValueError, match=name):
            gpu_tuning_from_env({name: value})
    # config.gpu overrides the environment; None reads it
    assert resolved_options(EngineConfig(gpu=GpuTuning(gemm="cute")), "cuda", 512)[1].gpu.gemm == "cute"


def test_no_module_but_env_reads_the_environment():
    """Environment variables are read in engine/env.py alone (the engine's and the server's), each declared
    there once with its default and meaning."""
    offenders = []
    for top in ("engine", "memory", "server", "openinfer_kernels/raw_cuda"):
        for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
            for f in files:
                path = os.path.join(dirpath, f)
                if f.endswith(".py") and path != os.path.join(ROOT, "engine", "env.py"):
                    text = open(path, encoding="utf-8").read()
                    if "environ" in text.replace("environment", "") or "getenv" in text:
                        offenders.append(os.path.relpath(path, ROOT))
    assert offenders == []
    names = [var.name for var in env.VARIABLES]
    assert len(names) == len(set(names)) and all(var.meaning and var.want for var in env.VARIABLES)
    for var in env.VARIABLES:
        assert var.read({}) == var.default


def test_server_defaults_come_from_the_environment(monkeypatch):
    from server.cli import build_parser

    for name, value in (("OPENINFER_API_KEY", "k"), ("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True"),
                        ("VLLM_LORA_RESOLVER_CACHE_DIR", "/r")):
        monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["serve"])
    assert (args.api_key, args.allow_runtime_lora_updating, args.lora_resolver_dir) == ("k", True, "/r")
    assert env.cache_root({"OPENINFER_CACHE": "~/c"}) == os.path.expanduser("~/c")


def test_graph_sizes_stop_at_max_num_seqs():
    assert ExecutorOptions().replace(max_num_seqs=40).graph_sizes == (1, 2, 4, 8, 16, 24, 32, 40)
    assert ExecutorOptions().replace(max_num_seqs=256, max_num_batched_tokens=8192).graph_sizes[-1] == 256
    assert options_of(max_num_seqs=8, gemm="cublas").gpu.gemm == "cublas"


def test_gpu_parts_size_themselves_from_the_plan():
    """Qwen3-4B at vLLM's defaults (8192 tokens, 256 sequences): each part's bytes from its own
    declaration; the logits stay a bounded buffer (chunked eager logits), not tokens x vocabulary."""
    from engine.executor.gpu_arena_sizes import parts_nbytes
    from engine.executor.gpu_ops import GpuOps
    from engine.executor.gpu_plan import DeviceInfo, gpu_plan
    from engine.models.registry import build_model

    cfg = ModelConfig.from_file(os.path.join(ROOT, "bench", "configs", "qwen3-4b", "config.json"))
    model = build_model(cfg)
    options = resolved_options(EngineConfig(gpu=GpuTuning()), "cuda", cfg.max_position_embeddings)[1]
    plan = gpu_plan(options, model, DeviceInfo("H200", 132, 141 << 30, "90"))
    assert plan.kv.block_bytes(2) == 36 * 2 * 16 * 8 * 128 * 2            # 144 KiB per block
    assert plan.logit_rows == 1024 and plan.width == 2 * 9728
    parts = parts_nbytes(plan, cute_max_m=128, prefill_on=True)
    assert parts["ops"] >= 10 * 8192 * plan.width * 2 + 1024 * cfg.vocab_size * 4
    assert sum(parts.values()) < 6 << 30
    smaller = gpu_plan(options.replace(max_num_batched_tokens=2048), model, plan.device)
    assert GpuOps.nbytes(smaller) < GpuOps.nbytes(plan)          # sized by the options, nothing fixed
    fewer_sms = gpu_plan(options, model, DeviceInfo("small", 16, 24 << 30, "90"))
    assert GpuOps.nbytes(fewer_sms) < GpuOps.nbytes(plan)        # the device's SM count, asked, not assumed


def test_the_engine_loop_reads_resolved_options_not_the_config():
    from engine.loop_options import LoopOptions

    limits = StepLimits(512, 4, 64)
    options = LoopOptions.of(EngineConfig(max_n=16, overlap_steps=False, max_loras=3), limits)
    assert options.limits is limits and options.max_n == 4                  # max_n capped by max_num_seqs
    assert options.async_scheduling is False and options.max_loras == 0      # no overlap / no --enable-lora
    names = {f.name for f in dataclasses.fields(LoopOptions)} - {"limits"}
    assert names <= {f.name for f in dataclasses.fields(EngineConfig)}
    assert "EngineConfig" not in open(os.path.join(ROOT, "engine", "engine_loop.py"), encoding="utf-8").read()

"""The `openinfer` command line: `serve` (the OpenAI-compatible server) and `generate` (one-off prompts).

With no --model both use the built-in demo model, SmolLM2-135M-Instruct (converted on first use, then
cached). Option names follow vLLM's where vLLM has one.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import signal
import socket
import sys

from engine import env as environment
from engine.models.registry import supported_model_types
from memory.kv_format import KV_CACHE_DTYPES
from server.limits import ServerLimits
from server.reasoning import REASONING_PARSERS

DEMO_MODEL_NAME = "SmolLM2-135M-Instruct"


def _engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options (EngineConfig), named as vLLM names them."""
    p.add_argument("--model", default=None,
                   help=f"HF model folder (model_type {', '.join(supported_model_types())}) or .gguf file "
                        f"(default: the built-in SmolLM2-135M-Instruct demo)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="cuda: the GPU executor; cpu: the numpy executor; auto: the GPU when CuPy sees one")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float16", "float32"), default="auto",
                   help="weights' dtype: the GPU runs bfloat16 (auto, bfloat16); the CPU computes in float32 "
                        "and with bfloat16 / float16 first rounds the weights to it")
    p.add_argument("--quantization", "-q", default=None, metavar="METHOD",
                   help="fp8: quantize a bf16 checkpoint's linear layers at load (per-channel e4m3 weights, dynamic "
                        "per-token activations: W8A8). Checkpoints already quantized (fp8, compressed-tensors) are "
                        "read from their quantization_config without it")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output token limit per request (default: the model's own)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step at most (default: 8192 on the GPU; 96 on the CPU, where a token's "
                        "attention over a long context counts as more than one)")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts over several steps (off: --max-num-batched-tokens must hold "
                        "--max-model-len)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's memory the engine takes (weights, activations, KV cache)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the KV cache's stored type: auto (the model's), bfloat16, fp8 = fp8_e4m3 (e4m3 with the "
                        "checkpoint's per-tensor k_scale / v_scale, else 1.0: twice the KV blocks in the same memory); "
                        "fp8_e5m2 is refused")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV pool size in 16-token blocks (default: what --gpu-memory-utilization leaves)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every decode step launches its kernels one by one")
    p.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes captured as CUDA graphs (default: 1 2 4 8 16 24 32 48 64 96 128 ... 512, "
                        "up to --max-num-seqs)")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampling of requests that bring no seed")
    p.add_argument("--overlap-steps", action=argparse.BooleanOptionalAction, default=True,
                   help="detokenize and stream a step's tokens while the GPU runs the next step")
    p.add_argument("--schedule-ahead", action=argparse.BooleanOptionalAction, default=True,
                   help="with --overlap-steps: schedule and build the next decode step while the GPU runs this one")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="queue the next decode step before this one's tokens reach the host (its input ids are "
                        "taken on the GPU): no host time between decode steps")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model across this many GPUs (one process each, NCCL); on the CPU, threads")
    p.add_argument("--cpu-threads", type=int, default=None, metavar="N",
                   help="the CPU executor's BLAS threads for steps of more than 16 tokens (decode-size steps run on "
                        "one; default: $OPENBLAS_NUM_THREADS, else the cores less one)")
    p.add_argument("--speculative-config", type=speculative_config, default=None, metavar="JSON",
                   help="speculative decoding, as vLLM configures it: e.g. '{\"method\": \"ngram\", "
                        "\"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4}' (prompt lookup; optional "
                        "\"prompt_lookup_min\", and \"num_speculative_tokens_per_batch_size\": [[lo, hi, k], ...] "
                        "or \"disable_by_batch_size\": n to draft fewer tokens, or none, at larger batches)")
    p.add_argument("--step-trace", default=None, metavar="FILE",
                   help="write one JSON line per engine step (tokens, host phases, GPU time): bench/step_profile.py "
                        "tabulates it")


def _serving_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's options that only serving uses: the name served, samples per request, many requests at
    once, prefixes shared between them, LoRA adapters a request names, the prefix cache's events for a
    router, the per-request trace."""
    p.add_argument("--served-model-name", default=None,
                   help="model name the API reports and accepts (default: the model folder's or file's name; "
                        "the demo model's: SmolLM2-135M-Instruct)")
    p.add_argument("--max-n", type=int, default=16, help="largest n (samples per request) accepted")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="sequences per engine step at most (default: 256 on the GPU, 64 on the CPU)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes seen before")
    p.add_argument("--host-kv-blocks", type=int, default=0,
                   help="host KV tier: keep up to this many evicted prefix-cache blocks in host memory "
                        "(pinned memory with the GPU executor)")
    p.add_argument("--kv-offload-gib", type=float, default=0.0,
                   help="host KV tier sized in GiB of host memory (instead of --host-kv-blocks): as many of the "
                        "model's KV blocks as fit")
    p.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters: a request's 'model' names one (the base model's name: none)")
    p.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) loaded at start, as name=path (or vLLM's JSON form)")
    p.add_argument("--max-loras", type=int, default=1,
                   help="LoRA adapters resident on the device at once (more wait in host memory)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="the largest LoRA rank accepted")
    p.add_argument("--max-cpu-loras", type=int, default=None,
                   help="LoRA adapters kept in host memory (>= --max-loras; default: every loaded one); the "
                        "others are read from their folders again when a request names them")
    p.add_argument("--kv-events-config", type=kv_events_config, default=None, metavar="JSON",
                   help="publish the prefix cache's changes for a KV-aware router, as vLLM does: e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (needs the kv-events extra)")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="N engine processes behind this one endpoint, each a whole engine with its own KV cache "
                        "(--max-num-seqs, --num-kv-blocks and --gpu-memory-utilization's share apply to each): one "
                        "GPU each (with -tp, TP GPUs each) where N x TP GPUs are visible, else all on the one GPU "
                        "with --gpu-memory-utilization / N each; on the CPU, N numpy engines. A request goes to the "
                        "least loaded engine, or to one nearly as idle that holds more of its prompt's prefix "
                        "(or to the one its X-data-parallel-rank header names)")
    p.add_argument("--request-trace", default=None, metavar="FILE",
                   help="write one JSON line per generation request (its moments from arrival to the first token "
                        "sent, on the step trace's clock): bench/request_trace.py tabulates it")


def kv_events_config(text: str):
    """--kv-events-config's JSON, parsed and checked (argparse reports a ValueError's message)."""
    from engine.kv_events import KVEventsConfig
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def speculative_config(text: str):
    """--speculative-config's JSON, parsed and checked (argparse reports a ValueError's message)."""
    from engine.speculative import SpeculativeConfig
    try:
        return SpeculativeConfig.from_json(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _limit_args(p: argparse.ArgumentParser) -> None:
    """ServerLimits (server/limits.py): what one request may ask for, how long the server waits."""
    d = ServerLimits()
    p.add_argument("--max-prompts", type=int, default=d.max_prompts,
                   help="prompts accepted in one /v1/completions request")
    p.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings, help="'stop' strings per request")
    p.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters in one stop string")
    p.add_argument("--max-stop-token-ids", type=int, default=d.max_stop_token_ids,
                   help="'stop_token_ids' per request")
    p.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="'logit_bias' entries per request")
    p.add_argument("--max-json-depth", type=int, default=d.max_json_depth, help="nesting of a request's JSON body")
    p.add_argument("--request-timeout", type=float, default=d.request_timeout,
                   help="seconds a request's headers, and then its whole body, may take to arrive")
    p.add_argument("--drain-timeout", type=float, default=d.drain_timeout,
                   help="on SIGTERM / Ctrl-C: seconds running requests may take to finish before they are "
                        "ended with finish_reason 'abort' (a second signal exits at once)")


def server_limits(args: argparse.Namespace) -> ServerLimits:
    limits = ServerLimits(max_prompts=args.max_prompts, max_stop_strings=args.max_stop_strings,
                          max_stop_chars=args.max_stop_chars, max_stop_token_ids=args.max_stop_token_ids,
                          max_logit_bias=args.max_logit_bias,
                          max_json_depth=args.max_json_depth, request_timeout=args.request_timeout,
                          drain_timeout=args.drain_timeout)
    limits.validate()
    return limits


def runtime_lora(args: argparse.Namespace) -> dict:
    """create_app's run-time LoRA arguments from --allow-runtime-lora-updating, --allowed-lora-path and
    --lora-resolver-dir, checked (ValueError): the folders need --enable-lora and the run-time switch and
    must exist; the switch with --enable-lora needs at least one folder (loads read nowhere else)."""
    switch = "--allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)"
    named = [("--allowed-lora-path", p) for p in args.allowed_lora_path]
    if args.lora_resolver_dir:
        named.append(("--lora-resolver-dir (or VLLM_LORA_RESOLVER_CACHE_DIR)", args.lora_resolver_dir))
    for flag, folder in named:
        if not args.enable_lora:
            raise ValueError(f"{flag} needs --enable-lora")
        if not args.allow_runtime_lora_updating:
            raise ValueError(f"{flag} needs {switch}")
        if not os.path.isdir(folder):
            raise ValueError(f"{flag} {folder!r} is not a folder")
    if args.enable_lora and args.allow_runtime_lora_updating and not named:
        raise ValueError(f"{switch} needs the folders adapters may be loaded from: --allowed-lora-path DIR "
                         f"(or --lora-resolver-dir DIR)")
    resolver = os.path.abspath(args.lora_resolver_dir) if args.lora_resolver_dir else None
    return {"allow_runtime_lora": args.enable_lora and args.allow_runtime_lora_updating,
            "allowed_lora_paths": tuple(os.path.abspath(p) for p in args.allowed_lora_path),
            "lora_resolver_dir": resolver}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each flag's default after its help, where it has one and the help does not already say it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    from server import __version__
    parser = argparse.ArgumentParser(prog="openinfer", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"openinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API", formatter_class=_HelpFormatter,
                           description="Serve the OpenAI-compatible HTTP API (with no --model: the demo model).")
    _engine_args(serve)
    _serving_engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="the port to listen on")
    serve.add_argument("--api-key", default=environment.API_KEY.read(),
                       help="require 'Authorization: Bearer <key>' on every route but /health, /version, /metrics "
                            "and /openapi.json (default: env OPENINFER_API_KEY, else none)")
    serve.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="run the engine in a process of its own, so a busy HTTP side never takes the engine "
                            "thread's GIL (engine/process.py)")
    serve.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                       help="split chat replies' thinking (<think>...</think>) into reasoning_content: qwen3 "
                            "(Qwen3, Qwen3.5), deepseek_r1 (DeepSeek-R1 and its distills)")
    serve.add_argument("--allow-runtime-lora-updating", action=argparse.BooleanOptionalAction,
                       default=environment.ALLOW_RUNTIME_LORA_UPDATING.read(),
                       help="with --enable-lora: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (and "
                            "--lora-resolver-dir); env VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
    serve.add_argument("--allowed-lora-path", action="append", default=[], metavar="DIR",
                       help="a folder run-time LoRA loads may read from (its adapters' real paths must lie "
                            "inside it; repeat for several)")
    serve.add_argument("--lora-resolver-dir", default=environment.LORA_RESOLVER_CACHE_DIR.read(), metavar="DIR",
                       help="with run-time LoRA updating: a request naming an unknown model loads DIR/<model> as a "
                            "LoRA adapter first, where that folder holds one (default: env VLLM_LORA_RESOLVER_CACHE_DIR)")
    _limit_args(serve)
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"),
                       help="the server's log level")
    gen = sub.add_parser("generate", help="generate a completion for one prompt and print it",
                         formatter_class=_HelpFormatter,
                         description="Generate a completion for one prompt and print it (no server).")
    _engine_args(gen)
    serving_defaults = argparse.ArgumentParser(add_help=False)
    _serving_engine_args(serving_defaults)
    gen.set_defaults(**vars(serving_defaults.parse_args([])))      # one prompt: what only serving uses stays off
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=128, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the top tokens of this much "
                                                               "probability")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                     help="render the prompt as a user message through the chat template "
                          "(default: when the model has one)")
    return parser


def engine_config(args: argparse.Namespace):
    from engine.config import EngineConfig
    from engine.executor.options import DEFAULT_GRAPH_SIZES
    from engine.lora import parse_lora_modules
    served = args.served_model_name or (DEMO_MODEL_NAME if args.model is None else None)
    config = EngineConfig(model=args.model, device=args.device, dtype=args.dtype, served_model_name=served,
                          quantization=args.quantization,
                          max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          enable_chunked_prefill=args.enable_chunked_prefill,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
                          enforce_eager=args.enforce_eager,
                          cuda_graph_sizes=tuple(args.cuda_graph_sizes or DEFAULT_GRAPH_SIZES),
                          max_n=args.max_n, seed=args.seed, overlap_steps=args.overlap_steps,
                          schedule_ahead=args.schedule_ahead, host_kv_blocks=args.host_kv_blocks,
                          kv_offload_gib=args.kv_offload_gib,
                          async_scheduling=args.async_scheduling, step_trace=args.step_trace,
                          enable_lora=args.enable_lora, lora_modules=parse_lora_modules(args.lora_modules),
                          max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                          max_cpu_loras=args.max_cpu_loras,
                          tensor_parallel_size=args.tensor_parallel_size,
                          kv_events_config=args.kv_events_config, cpu_threads=args.cpu_threads,
                          data_parallel_size=args.data_parallel_size,
                          speculative_config=args.speculative_config, kv_cache_dtype=args.kv_cache_dtype)
    config.validate()
    return config


LOGGERS = ("openinfer", "engine", "memory", "openinfer_kernels")     # openinfer.*, and module loggers (the executors')
log = logging.getLogger("openinfer.server")


def _setup_logging(level: str) -> None:
    """openinfer's log lines (start-up, one per request, shutdown) to stderr; Sanic keeps its own."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(level.upper())
        logger.propagate = False


def serve(args: argparse.Namespace) -> int:
    from engine.handle import EngineHandle
    from engine.process import EngineClient
    from engine.process_replicas import DataParallelClient
    from server.app import create_app
    from server.startup import startup_notes
    _setup_logging(args.log_level)
    config = engine_config(args)
    limits = server_limits(args)
    lora_access = runtime_lora(args)
    if config.data_parallel_size > 1 and not args.engine_process:
        raise ValueError("--data-parallel-size needs the engine processes (--engine-process)")
    sock = socket.create_server((args.host, args.port))     # fail fast if the port is taken
    if config.data_parallel_size > 1:
        handle = DataParallelClient(config, notes=startup_notes)
        notes = handle.startup_notes
    elif args.engine_process:                               # CUDA is touched in the engine process only
        handle = EngineClient(config, notes=startup_notes)
        notes = [(level, f"{line} [the engine process]") for level, line in handle.startup_notes]
    else:
        handle = EngineHandle(config)
        notes = startup_notes(handle, config.device)
    try:
        for level, line in notes:
            log.log(level, "%s", line)
        app = create_app(handle, api_key=args.api_key, limits=limits, request_trace=args.request_trace,
                         reasoning_parser=args.reasoning_parser, **lora_access)
        print(f"openinfer: serving '{app.ctx.model.name}' (max_model_len {handle.max_model_len}) "
              f"on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
        code = asyncio.run(_serve_until_signal(app, sock, handle))
    finally:
        handle.shutdown()
        log.info("shutdown: engine stopped")
    return code


async def _serve_until_signal(app, sock, handle) -> int:
    """SIGINT / SIGTERM: drain and stop (serve_until); a second one exits at once. The engine process
    ending on its own stops the server too, as vLLM's API server stops when its engine core dies: after a
    SIGTERM sent to it, with the same drain and exit code 0; killed or crashed (its requests have failed),
    with exit code 1, for a supervisor to restart it. Returns the exit code."""
    from server.background import serve_until
    stop = asyncio.Event()
    exit_code = 0

    def on_engine_end(why: str, failed: bool) -> None:
        nonlocal exit_code
        if stop.is_set():
            return
        if failed:
            log.error("shutdown: %s; the server stops (exit code 1)", why)
            exit_code = 1
        else:
            log.warning("shutdown: %s; draining the server", why)
        stop.set()

    signals: list[signal.Signals] = []          # the engine's end sets stop too: a first signal still drains

    def on_signal(sig: signal.Signals) -> None:
        signals.append(sig)
        if len(signals) > 1:
            log.warning("shutdown: second %s, exiting now without draining", sig.name)
            for child in multiprocessing.active_children():     # the engine process must not outlive us
                child.kill()
            logging.shutdown()
            os._exit(1)
        log.info("shutdown: %s received (send it again to exit at once)", sig.name)
        stop.set()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)

    def engine_ended(why: str, failed: bool) -> None:           # the engine client's reader thread
        try:
            loop.call_soon_threadsafe(on_engine_end, why, failed)
        except RuntimeError:                                    # this loop has closed: the server has stopped
            pass
    handle.on_end(engine_ended)
    await serve_until(app, sock, stop)
    return exit_code


def generate(args: argparse.Namespace) -> int:
    from engine.handle import EngineHandle
    from engine.request import GenerateRequest, SamplingParams
    from engine.events import Error, Finished, Rejected, Token
    from server.protocol import encode_text, render_chat
    with EngineHandle(engine_config(args)) as handle:
        tok = handle.tokenizer
        chat = args.chat if args.chat is not None else bool(tok.chat_template)
        ids = (render_chat(tok, [{"role": "user", "content": args.prompt}]) if chat
               else encode_text(tok, args.prompt))
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p,
                                max_tokens=min(args.max_tokens, handle.max_model_len - len(ids)))
        params.validate()

        async def run() -> int:
            async for event in handle.submit(GenerateRequest("generate-0", ids, params)):
                if isinstance(event, Token):
                    print(event.text, end="", flush=True)
                elif isinstance(event, Finished):
                    print(f"\n[finish_reason={event.reason} prompt_tokens={event.usage.prompt_tokens} "
                          f"completion_tokens={event.usage.completion_tokens}]", file=sys.stderr)
                elif isinstance(event, (Error, Rejected)):
                    why = event.message if isinstance(event, Error) else event.reason
                    print(f"\nerror: {why}", file=sys.stderr)
                    return 1
            return 0
        return asyncio.run(run())


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return serve(args) if args.command == "serve" else generate(args)
    except (ValueError, OSError, RuntimeError) as exc:    # bad option, missing model, port in use, no GPU
        print(f"openinfer: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Every environment variable the engine and the server read: each declared once below (its name,
type, default and meaning) and read here alone, through `EnvVar.read`, which refuses a value that does
not parse with the variable's name (a bad variable, like a bad flag, is refused at start).

The GPU executor's kernel choices are read into GpuTuning (engine/executor/options.py,
gpu_tuning_from_env), the CPU executor's BLAS threads by cpu_threads_from_env, the CLI's defaults by
server/cli.py. docs/serving.md and docs/gpu.md list them for users.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    """One variable: `parse` turns its (stripped) text into the value, ValueError where it cannot;
    unset or blank is `default`. `want` says what a value must look like (the error's words)."""
    name: str
    default: T
    parse: Callable[[str], T]
    want: str
    meaning: str

    def read(self, env: Mapping[str, str] | None = None) -> T:
        raw = (os.environ if env is None else env).get(self.name, "")
        if not raw.strip():
            return self.default
        try:
            return self.parse(raw.strip())
        except ValueError:
            raise ValueError(f"${self.name}={raw!r}: want {self.want}") from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


LAYER_RANGE_VALUES = {"0": "off", "off": "off", "1": "layers", "layers": "layers", "ops": "ops"}


def _layer_ranges(text: str) -> str:
    if text.lower() not in LAYER_RANGE_VALUES:
        raise ValueError(text)
    return LAYER_RANGE_VALUES[text.lower()]


def _off_at_0(text: str) -> bool:
    return text != "0"


def _on_at_1(text: str) -> bool:
    return text == "1"


def _vllm_bool(text: str) -> bool:
    """vLLM's reading of a boolean variable: "1" or "true" (any case)."""
    return text.lower() in ("1", "true")


# -- the GPU executor's kernel choices (GpuTuning's fields of the same meaning) -------------------------
DECODE_KERNELS = EnvVar("OPENINFER_DECODE_KERNELS", "all", str, "all, none or attention,gemv[:N]",
                        "the decode step's own kernels (GpuTuning.decode_kernels)")
GEMM = EnvVar("OPENINFER_GEMM", "auto", str, "auto, cute or cublas", "the GEMM behind the linear layers")
PREFILL_ATTENTION = EnvVar("OPENINFER_PREFILL_ATTENTION", "cute", str, "cute, cute:N or paged",
                           "the prefill attention kernel")
PDL = EnvVar("OPENINFER_PDL", True, _off_at_0, "0 or 1", "programmatic dependent launches in the decode graphs")
GEMV_UNROLL = EnvVar("OPENINFER_GEMV_UNROLL", 2, int, "an integer", "gemv.cu k steps per weight batch (wide)")
GEMV_UNROLL_NARROW = EnvVar("OPENINFER_GEMV_UNROLL_NARROW", 4, int, "an integer",
                            "gemv.cu k steps per weight batch (narrow)")
LAYER_RANGES = EnvVar("OPENINFER_LAYER_RANGES", "off", _layer_ranges, "0, 1 or ops",
                      "NVTX ranges: 1 a range per decoder layer of eager steps, ops per op too")
EAGER_GRAPH_TOKENS = EnvVar("OPENINFER_EAGER_GRAPH_TOKENS", 2048, int, "an integer",
                            "eager steps of up to this many tokens as piecewise CUDA graphs (0: off)")
CHUNK_ATTENTION = EnvVar("OPENINFER_CHUNK_ATTENTION", True, _off_at_0, "0 or 1",
                         "short runs of new tokens on paged_chunk.cu's tensor cores")
ASYNC_HOST_TIER = EnvVar("OPENINFER_ASYNC_HOST_TIER", True, _off_at_0, "0 or 1",
                         "host-tier copies on a stream of their own (0: ahead of the step on the compute stream)")
# -- the CPU executor ------------------------------------------------------------------------------------
OPENBLAS_NUM_THREADS = EnvVar("OPENBLAS_NUM_THREADS", None, _positive, "a positive integer",
                              "BLAS threads of the CPU executor's steps above decode size (without --cpu-threads)")
OMP_NUM_THREADS = EnvVar("OMP_NUM_THREADS", None, _positive, "a positive integer",
                         "the same, where OPENBLAS_NUM_THREADS is unset")
# -- files and the server --------------------------------------------------------------------------------
CACHE = EnvVar("OPENINFER_CACHE", "~/.cache/openinfer", str, "a folder",
               "where converted GGUF checkpoints are kept")
API_KEY = EnvVar("OPENINFER_API_KEY", None, str, "a key", "--api-key's default")
ALLOW_RUNTIME_LORA_UPDATING = EnvVar("VLLM_ALLOW_RUNTIME_LORA_UPDATING", False, _vllm_bool, "1 or true",
                                     "--allow-runtime-lora-updating's default (vLLM's variable)")
LORA_RESOLVER_CACHE_DIR = EnvVar("VLLM_LORA_RESOLVER_CACHE_DIR", None, str, "a folder",
                                 "--lora-resolver-dir's default (vLLM's variable)")

VARIABLES = tuple(v for v in globals().values() if isinstance(v, EnvVar))


def cpu_threads_from_env(env: Mapping[str, str] | None = None) -> int | None:
    """The BLAS threads a user asked for with OPENBLAS_NUM_THREADS (else OMP_NUM_THREADS), or None."""
    threads = OPENBLAS_NUM_THREADS.read(env)
    return threads if threads is not None else OMP_NUM_THREADS.read(env)


def cache_root(env: Mapping[str, str] | None = None) -> str:
    return os.path.expanduser(CACHE.read(env))


def visible_gpus_listed(env: Mapping[str, str] | None = None) -> list[str] | None:
    """The GPU ids CUDA_VISIBLE_DEVICES lists (set but empty: none), or None where it is unset (every GPU)."""
    listed = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES")
    return None if listed is None else [e.strip() for e in listed.split(",") if e.strip()]


def set_in_this_process(values: Mapping[str, str]) -> None:
    """Set variables in this process's environment (an engine process's own GPU, before CUDA starts)."""
    os.environ.update(values)


def child_environment(first_on_path: str) -> dict[str, str]:
    """This process's environment for a Python child process, `first_on_path` ahead on its PYTHONPATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (first_on_path, env.get("PYTHONPATH", "")) if p)
    return env


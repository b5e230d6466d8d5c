"""Where each data-parallel replica (engine/process_replicas.py) runs, decided before any of them starts.

- The CPU (`--device cpu`, or `auto` where CuPy sees no GPU): N engine processes, each its own numpy engine.
- N × tensor_parallel_size GPUs visible or more: replica i on GPUs i·TP .. i·TP + TP - 1 (its
  CUDA_VISIBLE_DEVICES, so its tensor-parallel ranks bind within them).
- One GPU visible and no tensor parallelism: every replica on it, each with about 1/N of
  gpu_memory_utilization. The arena takes `utilization · total − memory already in use` (memory/device_arena.py),
  so the replicas start one after another and replica i is given (i + 1)/N of the fraction: what the i
  replicas before it hold is already in use, and it takes the rest of its share.
- Anything else (more replicas than GPUs, or tensor parallelism beyond the GPUs present) is refused.

The GPUs are counted in a short child interpreter: CUDA initialised in the server process would be unusable
in the engine processes it forks.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.env import visible_gpus_listed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_COUNT_CODE = ("try:\n    import cupy\n    print(cupy.cuda.runtime.getDeviceCount())\n"
                  "except Exception:\n    print(0)")


@dataclass(frozen=True)
class ReplicaPlace:
    rank: int
    env: dict[str, str]                # set in its engine process (CUDA_VISIBLE_DEVICES), empty on the CPU
    gpu_memory_utilization: float
    where: str                         # for the start-up log


@dataclass(frozen=True)
class Placement:
    replicas: tuple[ReplicaPlace, ...]
    one_by_one: bool                   # sharing one GPU: each starts once the one before it is up

    def describe(self) -> str:
        order = "one after another" if self.one_by_one else "at once"
        return (f"data parallel: {len(self.replicas)} engine processes, started {order}: "
                + "; ".join(f"replica {r.rank} on {r.where}" for r in self.replicas))


def visible_gpus(device: str) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entries of the GPUs CuPy sees (indices where the variable is unset); none
    for --device cpu."""
    if device == "cpu":
        return []
    probe = subprocess.run([sys.executable, "-c", GPU_COUNT_CODE], capture_output=True, text=True, cwd=REPO,
                           timeout=120)
    try:
        count = int(probe.stdout.split()[-1])
    except (IndexError, ValueError):
        count = 0
    listed = visible_gpus_listed()
    return listed[:count] if listed is not None else [str(i) for i in range(count)]


def place_replicas(config: EngineConfig, gpus: list[str]) -> Placement:
    """The replicas' places for config.data_parallel_size engines given the visible GPUs (ValueError for a
    combination that cannot run)."""
    n, tp = config.data_parallel_size, config.tensor_parallel_size
    util = config.gpu_memory_utilization
    if config.device == "cuda" and not gpus:
        raise ValueError("--device cuda: no GPU is visible to CuPy")
    if config.device == "cpu" or not gpus:
        return Placement(tuple(ReplicaPlace(r, {}, util, "the CPU") for r in range(n)), one_by_one=False)
    if n * tp <= len(gpus):
        places = []
        for r in range(n):
            mine = gpus[r * tp:(r + 1) * tp]
            places.append(ReplicaPlace(r, {"CUDA_VISIBLE_DEVICES": ",".join(mine)}, util,
                                       f"GPU{'s' if tp > 1 else ''} {','.join(mine)}"))
        return Placement(tuple(places), one_by_one=False)
    if tp == 1 and len(gpus) == 1:
        share = f"GPU {gpus[0]}, shared: 1/{n} of --gpu-memory-utilization {util:g}"
        return Placement(tuple(ReplicaPlace(r, {"CUDA_VISIBLE_DEVICES": gpus[0]}, util * (r + 1) / n, share)
                               for r in range(n)), one_by_one=True)
    raise ValueError(f"--data-parallel-size {n} × --tensor-parallel-size {tp} needs {n * tp} GPUs and "
                     f"{len(gpus)} are visible: give one GPU each, or expose a single GPU "
                     f"(CUDA_VISIBLE_DEVICES) for the replicas to share (without tensor parallelism)")


def check_event_endpoints(config: EngineConfig) -> None:
    """With KV events on, each replica publishes on the endpoint's port + its rank (and replays on the replay
    endpoint's + rank, as vLLM does): ValueError where two of those addresses coincide."""
    events = config.kv_events_config
    if events is None or not events.enabled or config.data_parallel_size == 1:
        return
    from engine.kv_event_publisher import offset_endpoint_port

    seen: dict[str, str] = {}
    for rank in range(config.data_parallel_size):
        for what, endpoint in (("endpoint", events.endpoint), ("replay_endpoint", events.replay_endpoint)):
            if endpoint is None:
                continue
            address = offset_endpoint_port(endpoint, rank)
            if address in seen:
                raise ValueError(f"--kv-events-config: replica {rank}'s {what} {address} is also {seen[address]} "
                                 f"(replica r publishes on each endpoint's port + r): space the ports at least "
                                 f"--data-parallel-size apart")
            seen[address] = f"replica {rank}'s {what}"

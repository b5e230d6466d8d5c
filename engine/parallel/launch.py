"""Start the ranks of a tensor-parallel executor: options.tensor_parallel_size shards of one model, rank 0
here (its executor is what the engine drives), the others as threads (CPU) or one process per GPU."""
from __future__ import annotations

import logging

from engine.executor.options import ExecutorOptions
from engine.parallel.comm import LocalGroup
from engine.parallel.executor import TensorParallelExecutor
from engine.parallel.ranks import COLLECTIVE_TIMEOUT_S, ThreadRanks
from engine.parallel.sharding import Shard, check_kept_cuts, check_tensor_parallel, expert_range, shard_model

log = logging.getLogger("openinfer.engine")


def start_cpu_ranks(model, options: ExecutorOptions) -> TensorParallelExecutor:
    """N numpy rank executors in this process, ranks 1..N-1 on threads, over one LocalGroup."""
    from engine.parallel.cpu_ops import CpuRankExecutor

    n = options.tensor_parallel_size
    comms = (group := LocalGroup(n, timeout=COLLECTIVE_TIMEOUT_S)).communicators()
    shards = [Shard(r, n) for r in range(n)]
    executors = [CpuRankExecutor(shard_model(model, s), options, comms[s.rank], expert_range(model.model, s))
                 for s in shards]
    return TensorParallelExecutor(executors[0], ThreadRanks(executors[1:], group))


def create_parallel_executor(model, options: ExecutorOptions, device: str) -> TensorParallelExecutor:
    """The tensor-parallel executor of a resolved device ("cpu" / "cuda")."""
    check_tensor_parallel(model.model, options.tensor_parallel_size)
    check_kept_cuts(model, options.tensor_parallel_size)
    log.info("tensor parallel: %d ranks (%s)", options.tensor_parallel_size,
             "one process per GPU, NCCL" if device == "cuda" else "threads, numpy collectives")
    if device == "cuda":
        from engine.parallel.worker import start_gpu_ranks
        return start_gpu_ranks(model, options)
    return start_cpu_ranks(model, options)

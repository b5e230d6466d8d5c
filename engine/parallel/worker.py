"""One process per GPU. Rank 0 is the engine's own process (or the engine process, engine/process.py);
`start_gpu_ranks` starts ranks 1..N-1 as `python -m engine.parallel.worker ADDRESS RANK` (plain
subprocesses: a daemonic engine process may not have multiprocessing children, and a fresh interpreter
never inherits a CUDA context), reached over a Unix socket in a private folder (the key on stdin).

Start-up: each rank says hello; rank 0 makes the NCCL id and sends it with the model folder and the
options; every rank joins the communicator (ncclCommInitRank returns once all have), binds GPU `rank`,
loads the checkpoint (memory-mapped; quantized at load as rank 0's was, --quantization), builds its shard's
GpuRankExecutor and reports its KV pool; then
it follows rank 0's calls (ranks.follower_loop) until "close". A rank that fails reports and exits.
"""
from __future__ import annotations

import logging
import os
import pickle
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Client, Listener

from engine.env import child_environment
from engine.executor.options import ExecutorOptions
from engine.parallel.executor import TensorParallelExecutor
from engine.parallel.ranks import ProcessRanks, follower_loop
from engine.parallel.sharding import Shard, expert_range, shard_model

log = logging.getLogger("openinfer.engine")
START_TIMEOUT_S = 1800.0      # loading and uploading a large checkpoint per rank
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def gpu_count() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def current_device() -> int:
    import cupy
    return cupy.cuda.Device().id


def use_device(device: int) -> None:
    import cupy
    cupy.cuda.Device(device).use()


def rank_executor(model, options: ExecutorOptions, comm, rank: int):
    """Rank `rank`'s GpuRankExecutor over its shard of a loaded model (the current device)."""
    from engine.parallel.gpu_ops import GpuRankExecutor

    shard = Shard(rank, comm.world_size)
    return GpuRankExecutor(shard_model(model, shard), options, comm, expert_range(model.model, shard))


def _spawn(address: str, rank: int, key: bytes) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "engine.parallel.worker", address, str(rank)],
                            stdin=subprocess.PIPE, env=child_environment(_REPO))
    proc.stdin.write(key.hex().encode() + b"\n")
    proc.stdin.close()
    return proc


def _wait(what: str, ready, procs: list, deadline: float) -> None:
    """Until ready() while every rank lives (RuntimeError: a rank exited, or the deadline passed)."""
    while not ready():
        dead = [(r, p.returncode) for r, p in enumerate(procs, 1) if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"tensor-parallel ranks did not {what}: "
                               + (f"rank {dead[0][0]} exited ({dead[0][1]})" if dead else "timed out"))
        time.sleep(0.05)


def start_gpu_ranks(model, options: ExecutorOptions) -> TensorParallelExecutor:
    """Rank 0 here on the current GPU, ranks 1..N-1 in processes on GPUs 1..N-1."""
    n = options.tensor_parallel_size
    if n > (have := gpu_count()):
        raise ValueError(f"tensor_parallel_size {n} is more than the {have} GPU(s) CuPy sees")
    key, folder = secrets.token_bytes(32), tempfile.mkdtemp(prefix="openinfer-tp-")
    address = os.path.join(folder, "ranks.sock")
    procs: list = []
    try:
        with Listener(address, family="AF_UNIX", authkey=key) as listener:
            procs += [_spawn(address, r, key) for r in range(1, n)]
            return _start(model, options, listener, procs)
    except BaseException:
        for p in procs:
            p.kill()
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _in_thread(what: str, fn, procs: list, deadline: float):
    """fn() on a thread while every rank is watched (it may wait on them: accept, ncclCommInitRank)."""
    box: list = []

    def run() -> None:
        try:
            box.append((True, fn()))
        except BaseException as e:    # noqa: BLE001 -- raised below
            box.append((False, e))

    threading.Thread(target=run, daemon=True, name=f"openinfer-tp-{what}").start()
    _wait(what, lambda: bool(box), procs, deadline)
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _start(model, options: ExecutorOptions, listener, procs: list) -> TensorParallelExecutor:
    from engine.parallel.comm import NcclCommunicator, nccl_unique_id

    n, deadline = options.tensor_parallel_size, time.monotonic() + START_TIMEOUT_S
    accepted = _in_thread("connect", lambda: [listener.accept() for _ in procs], procs, deadline)
    conns = [c for _, c in sorted(((c.recv()[1], c) for c in accepted), key=lambda rc: rc[0])]
    uid = nccl_unique_id()
    for conn in conns:
        # the other ranks' steps are not timed (nobody reads their step trace) and show no upload bar
        follower = options.replace(progress=False, time_steps=False)
        conn.send(("init", {"path": model.path, "quantization": model.quantization, "options": follower, "uid": uid}))
    device = current_device()          # NCCL joins on the calling thread's device: rank 0's, the current one
    comm = _in_thread("join", lambda: (use_device(device), NcclCommunicator(n, uid, 0))[1], procs, deadline)
    local = rank_executor(model, options, comm, 0)
    _wait("start", lambda: all(c.poll() for c in conns), procs, deadline)
    blocks = []
    for r, conn in enumerate(conns, 1):
        kind, value = conn.recv()
        if kind != "ready":
            raise RuntimeError(f"tensor-parallel rank {r} failed to start: {value}")
        blocks.append(value)
    log.info("tensor parallel: %d GPU ranks up, KV blocks per rank %s", n, [local.num_kv_blocks] + blocks)
    return TensorParallelExecutor(local, ProcessRanks(conns, procs, blocks))


def main(argv: list[str]) -> int:
    """A rank > 0: join rank 0 at the socket argv[0] as rank argv[1], then follow it."""
    address, rank = argv[0], int(argv[1])
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s rank {rank} %(levelname)s %(name)s: %(message)s")
    conn = Client(address, family="AF_UNIX", authkey=bytes.fromhex(sys.stdin.readline().strip()))
    conn.send(("hello", rank))
    _, init = conn.recv()
    try:
        from engine.loader import load_model
        from engine.parallel.comm import NcclCommunicator

        use_device(rank)
        options: ExecutorOptions = init["options"]
        comm = NcclCommunicator(options.tensor_parallel_size, init["uid"], rank)
        executor = rank_executor(load_model(init["path"], quantization=init["quantization"]), options, comm, rank)
    except Exception as e:            # noqa: BLE001 -- rank 0 raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return 1
    conn.send(("ready", executor.num_kv_blocks))

    def reply(error) -> None:
        if error is not None:
            log.error("rank %d failed: %s: %s", rank, type(error).__name__, error)
            conn.send(("error", f"{type(error).__name__}: {error}"))
            raise SystemExit(1)

    try:
        follower_loop(executor, lambda: pickle.loads(conn.recv_bytes()), reply)
    except EOFError:                  # rank 0 is gone
        return 1
    executor.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

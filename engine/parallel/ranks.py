"""The ranks other than 0 ("followers"): each runs `follower_loop` over its own rank executor, taking
rank 0's calls in order. Two carriers:
  * ThreadRanks: threads of this process over a numpy LocalGroup (the CPU executor). Each call is
    answered, so rank 0 knows when every rank has left a step; a step that fails on any rank aborts
    the group's collectives (no rank waits for the failed one) and resets it after.
  * ProcessRanks: one process per GPU (worker.py), over NCCL. Calls are not answered (rank 0 goes on
    while the GPUs work); a rank that fails reports its error and ends, and rank 0 refuses every call
    after that (its collectives no longer have partners).
"""
from __future__ import annotations

import collections
import logging
import pickle
import queue
import threading

from engine.parallel.comm import LocalGroup

log = logging.getLogger("openinfer.engine")
COLLECTIVE_TIMEOUT_S = 300.0     # a numpy rank waits this long for the others inside one collective


def follower_loop(executor, receive, reply) -> None:
    """Run rank 0's calls on `executor` until ("close", ()); reply(None or the exception) after each.
    Steps are read back in rank 0's order: a step before the next is submitted, except a fed step,
    which is queued before the step it follows is read (async scheduling)."""
    pending: collections.deque = collections.deque()
    while True:
        name, args = receive()
        if name == "close":
            break
        error = None
        try:
            fed = name == "follow" and args[1]
            while len(pending) > (1 if fed else 0):
                pending.popleft().result()
            if name == "follow":
                pending.append(executor.follow(*args))
            else:
                getattr(executor, name)(*args)          # rank 0's call, sent by method name
        except Exception as e:        # noqa: BLE001 -- handed to rank 0
            pending.clear()
            error = e
        reply(error)
    for step in pending:
        step.result()


class ThreadRanks:
    """Follower ranks 1..N-1 as threads over `group` (executors: theirs, in rank order)."""

    def __init__(self, executors: list, group: LocalGroup):
        self.group, self.executors = group, executors
        self.num_kv_blocks = [e.num_kv_blocks for e in executors]
        self.inboxes = [queue.SimpleQueue() for _ in executors]
        self.replies = [queue.SimpleQueue() for _ in executors]
        self.threads = [threading.Thread(target=follower_loop, args=(e, inbox.get, self._reply(out)), daemon=True,
                                         name=f"openinfer-rank-{r}")
                        for r, (e, inbox, out) in enumerate(zip(executors, self.inboxes, self.replies), 1)]
        for t in self.threads:
            t.start()

    def _reply(self, out: queue.SimpleQueue):
        def reply(error) -> None:
            if error is not None:         # the other ranks may wait for this one inside a collective
                self.group.abort()
            out.put(error)
        return reply

    def send(self, msg) -> None:
        for inbox in self.inboxes:
            inbox.put(msg)

    def settle(self, failed: BaseException | None) -> None:
        """Wait for every rank's answer; after a failure anywhere, reset the group and raise the failure
        (rank 0's `failed`, unless it only saw the group broken by another rank's)."""
        if failed is not None:
            self.group.abort()
        errors = [(r, e) for r, q in enumerate(self.replies, 1) if (e := q.get()) is not None]
        if failed is None and not errors:
            return
        self.group.reset()
        first = next(((r, e) for r, e in errors if not isinstance(e, threading.BrokenBarrierError)), None)
        if first is not None and (failed is None or isinstance(failed, threading.BrokenBarrierError)):
            r, e = first
            raise RuntimeError(f"tensor-parallel rank {r} failed: {type(e).__name__}: {e}") from e

    def close(self) -> None:
        self.send(("close", ()))
        for t in self.threads:
            t.join(30)
        for e in self.executors:
            e.close()


class ProcessRanks:
    """Follower ranks 1..N-1 as processes (worker.py), each reached by a multiprocessing connection."""

    def __init__(self, conns: list, procs: list, num_kv_blocks: list[int]):
        self.conns, self.procs, self.num_kv_blocks = conns, procs, num_kv_blocks
        self.broken: str | None = None

    def send(self, msg) -> None:
        if self.broken:
            raise RuntimeError(f"tensor-parallel ranks unusable: {self.broken}")
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for conn in self.conns:
            conn.send_bytes(data)

    def settle(self, failed: BaseException | None) -> None:
        """A rank's reported failure or exit, without waiting; rank 0 failing (`failed`) after the step
        went out leaves the ranks' collectives unmatched: the group is unusable from then on."""
        for r, (conn, proc) in enumerate(zip(self.conns, self.procs), 1):
            if conn.poll():
                _, error = conn.recv()
                self.broken = f"rank {r} failed: {error}"
            elif proc.poll() is not None:
                self.broken = f"rank {r} exited with code {proc.returncode}"
        if failed is not None and not self.broken:
            self.broken = f"rank 0 failed inside a step the other ranks ran: {failed!r}"
        if self.broken and failed is None:
            raise RuntimeError(f"tensor-parallel {self.broken}")

    def close(self) -> None:
        try:
            if not self.broken:
                self.send(("close", ()))
        except OSError:
            pass
        for proc in self.procs:
            try:
                proc.wait(60)
            except Exception:         # noqa: BLE001 -- a rank that does not stop is killed
                proc.kill()
        for conn in self.conns:
            conn.close()

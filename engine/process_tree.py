"""How the engine process (engine/process.py) is tied to the server process that started it.

- It dies with its parent: PR_SET_PDEATHSIG (Linux: SIGKILL when the parent's thread that started it
  ends — set only when that is the main thread, which ends with the process), and EOF on its input pipe,
  whose write end only the parent holds (the child closes its inherited copies of the parent's ends).
- It holds none of its parent's sockets: a listener the parent closes stops listening (the kernel
  accepts no connection that nobody will answer), a connection the parent closes ends, and the port is
  free once the parent is gone.
- SIGTERM stops it gracefully: it tells the parent (which stops sending requests: the server drains) and
  exits once its requests have ended; a second SIGTERM exits at once. SIGINT (Ctrl-C reaches the whole
  process group) is the parent's to act on: it stops the engine after its drain.
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import stat
import sys
import threading
from dataclasses import dataclass

log = logging.getLogger("openinfer.engine")
PR_SET_PDEATHSIG = 1


@dataclass
class ParentLink:
    """What the child needs to know of its parent, made in the parent before the child starts."""
    pid: int
    ends: tuple = ()                 # the parent's ends of the pipes (a forked child inherits them)
    die_with_parent: bool = False    # started by the parent's main thread: PR_SET_PDEATHSIG is safe

    @classmethod
    def here(cls, ends: tuple, forked: bool) -> "ParentLink":
        return cls(os.getpid(), ends if forked else (), threading.current_thread() is threading.main_thread())


def detach_from_parent(link: ParentLink, keep: tuple) -> None:
    """In the child, first thing: close the parent's pipe ends, drop the inherited sockets but those in
    keep (its own pipe ends), and arrange to die with the parent (exiting now if it is already gone)."""
    for end in link.ends:
        end.close()
    drop_inherited_sockets({conn.fileno() for conn in keep})
    if link.die_with_parent and sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): the engine process ends on its input "
                        "pipe's EOF only", ctypes.get_errno())
    if os.getppid() != link.pid:             # the parent died before the death signal was armed
        os._exit(1)


def drop_inherited_sockets(keep: set[int]) -> list[int]:
    """Point every socket descriptor above stderr (and not in keep) at /dev/null; returns their numbers.
    The number stays taken, so a socket object inherited here that is closed later closes /dev/null,
    never a descriptor opened since."""
    fd_dir = "/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"
    dropped = []
    null = os.open(os.devnull, os.O_RDWR)
    try:
        for name in os.listdir(fd_dir):
            fd = int(name)
            if fd <= 2 or fd == null or fd in keep:
                continue
            try:
                if stat.S_ISSOCK(os.fstat(fd).st_mode):
                    os.dup2(null, fd)
                    dropped.append(fd)
            except OSError:                   # the listing's own descriptor, already closed
                pass
    finally:
        os.close(null)
    return dropped


class StopOnSigterm:
    """SIGTERM handling of the engine process once it serves: the first one calls notify() (from the
    main thread, between two of its bytecodes) and sets `requested`; a second one exits at once."""

    def __init__(self, notify):
        self.requested = False
        self._notify = notify
        signal.signal(signal.SIGTERM, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            os._exit(128 + signum)
        self.requested = True
        self._notify()

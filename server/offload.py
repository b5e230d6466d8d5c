"""Blocking request work (JSON parsing, chat templates, tokenization) runs in the event loop's thread
pool, so that one large request never holds up the others: the event loop keeps answering /health and
streaming tokens meanwhile (the tokenizer lets other threads run while it works)."""
from __future__ import annotations

import asyncio
import functools


async def in_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a worker thread; its exceptions (e.g. an APIError) propagate."""
    return await asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args, **kwargs))

"""The real engine on the CPU with a tiny random-weight model (harness/models.py), for the server tests."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.handle import EngineHandle
from harness.models import tiny_model_path

MODEL = "qwen3_tied"


def tiny_handle(max_model_len: int = 256, num_kv_blocks: int = 128, **config) -> EngineHandle:
    """An EngineHandle over MODEL; shut it down when done."""
    return EngineHandle(EngineConfig(model=tiny_model_path(MODEL), device="cpu", max_model_len=max_model_len,
                                     num_kv_blocks=num_kv_blocks, **config))

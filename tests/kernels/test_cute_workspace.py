"""The CuTe GEMM's split-K workspace (no GPU): sized before graph capture for every split plan of
the model's weight shapes, and never freed while a captured graph may point into it."""
import sys
import types

import pytest

from openinfer_kernels.cute.configs import plan_gemm
from openinfer_kernels.cute.gemm import GemmRunner, split_workspace_bytes


@pytest.mark.parametrize("shapes", [
    [(6144, 2560), (2560, 4096), (19456, 2560), (2560, 9728)],   # Qwen3-4B
    [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],    # a small model: narrow N splits most
    [(576 * 3, 576), (576, 576), (1536 * 2, 576), (576, 1536)],  # SmolLM2-135M
])
@pytest.mark.parametrize("max_m", [1, 64, 200, 512])
def test_split_workspace_covers_every_split_plan_and_nothing_more(shapes, max_m):
    """The workspace reserved before graph capture holds the partials of every planned split-K
    GEMM of each weight shape up to max_m rows (a narrower N may split where the widest does not),
    and is no larger than the largest of them (unsplit plans need none)."""
    need = [plan_gemm(m, n, k).splits * m * n * 4 for n, k in shapes for m in range(1, max_m + 1)
            if plan_gemm(m, n, k).splits > 1]
    assert split_workspace_bytes(max_m, shapes) == max(need, default=0)
    assert split_workspace_bytes(max_m, shapes) >= split_workspace_bytes(max_m, shapes[:1])


class _FakeBuffer:
    next_ptr = 1 << 32

    def __init__(self, n, dtype):
        self.nbytes = 4 * n
        self.data = types.SimpleNamespace(ptr=_FakeBuffer.next_ptr)
        _FakeBuffer.next_ptr += self.nbytes


def test_a_captured_workspace_outlives_its_replacement(monkeypatch):
    """Growing the workspace after a graph captured a split-K launch keeps the captured buffer
    referenced (the graph replays into its address); growing during capture is an error."""
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(empty=_FakeBuffer, float32="f4"))
    runner = GemmRunner(library=types.SimpleNamespace())
    small = runner._ensure_workspace(1 << 20, capturing=False)
    assert runner._ensure_workspace(1 << 10, capturing=True) == small   # a capture uses it
    with pytest.raises(RuntimeError, match="reserve_workspace"):
        runner._ensure_workspace(1 << 22, capturing=True)
    big = runner._ensure_workspace(1 << 22, capturing=False)             # an eager launch grows it
    assert big != small and [b.data.ptr for b in runner._captured] == [small]
    runner._ensure_workspace(1 << 22, capturing=True)
    runner._ensure_workspace(1 << 22, capturing=True)
    assert [b.data.ptr for b in runner._captured] == [small, big]

"""CuTe GEMM on the GPU: every variant on odd shapes against float32, graph capture, pointer checks."""
import pytest

from kernels.cute.configs import GEMM_VARIANTS, GemmPlan, plan_gemm, split_count

pytestmark = pytest.mark.gpu

ODD_SHAPES = [(1, 200, 328), (3, 136, 1032), (17, 2056, 1032), (255, 392, 2568), (130, 264, 4096)]


@pytest.fixture(scope="module")
def runner():
    from kernels import cute
    from kernels.cute.gemm import GemmRunner

    avail = cute.available()
    if not avail:
        pytest.skip(avail.reason)
    r = GemmRunner()
    r.init()
    return r


@pytest.mark.parametrize("variant", [v for v in GEMM_VARIANTS if not v.grouped], ids=lambda v: v.name)
@pytest.mark.parametrize("m,n,k", ODD_SHAPES)
def test_variant_matches_float32(runner, variant, m, n, k):
    from kernels.cute.testing import gemm_error

    splits = [1] if variant.out == "bf16" else sorted({1, split_count(k, 3), split_count(k, 4)})
    for s in splits:
        err, unwritten = gemm_error(runner, GemmPlan(variant, s), m, n, k)
        assert unwritten == 0, f"{variant.name} S={s}: {unwritten} outputs not written"
        assert err <= 1e-2, f"{variant.name} S={s}: relative error {err:.3e}"


@pytest.mark.parametrize("m", [1, 17, 64, 255, 1000])
@pytest.mark.parametrize("n,k", [(6144, 2560), (2560, 9728)])
def test_planned_gemm_on_qwen_shapes(runner, m, n, k):
    from kernels.cute.testing import gemm_error

    err, unwritten = gemm_error(runner, plan_gemm(m, n, k), m, n, k)
    assert unwritten == 0 and err <= 1e-2, (err, unwritten)


@pytest.mark.parametrize("tile_m,tokens,top_k,experts,n,k", [
    (64, 37, 8, 16, 264, 520), (64, 1, 8, 64, 768, 2048), (128, 300, 2, 8, 1536, 2048)])
def test_grouped_gemm_matches_float32(runner, tile_m, tokens, top_k, experts, n, k):
    from kernels.cute.testing import grouped_error

    err, unwritten = grouped_error(runner, tile_m, tokens, top_k, experts, n, k)
    assert unwritten == 0 and err <= 1e-2, (err, unwritten)


@pytest.mark.parametrize("hq,hkv", [(8, 8), (8, 2), (8, 1)])
def test_varlen_causal_attention_matches_float32(runner, hq, hkv):
    from kernels.cute.testing import attention_error

    lengths = [1, 17, 64, 130, 1000, 4096, 0, 63]
    err, unwritten = attention_error(runner, lengths, lengths, hq, hkv)
    assert unwritten == 0 and err <= 1e-2, (err, unwritten)


def test_attention_with_cached_prefix(runner):
    from kernels.cute.testing import attention_error

    err, unwritten = attention_error(runner, [5, 200, 1], [300, 200, 129], 4, 1)
    assert unwritten == 0 and err <= 1e-2, (err, unwritten)


@pytest.mark.parametrize("m", [8, 300])
def test_graph_replay_equals_eager(runner, m):
    import cupy as cp

    from kernels.cute.testing import rand_bf16, sync_or_die

    n, k = 2560, 4096
    a, b = rand_bf16((m, k)), rand_bf16((n, k))
    eager, graphed = cp.empty((m, n), cp.uint16), cp.full((m, n), 0x7FC0, cp.uint16)
    runner.reserve_workspace(m, n, (k,))
    runner(a, b, eager)
    sync_or_die(f"eager GEMM M={m}")
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        runner(a, b, graphed, stream=stream)
        graph = stream.end_capture()
        graph.launch(stream)
        sync_or_die(f"graph-replayed GEMM M={m}", stream)
    assert cp.array_equal(eager, graphed)


def test_misaligned_pointer_is_rejected(runner):
    import cupy as cp

    a = cp.zeros((4, 72), cp.uint16)[:, 4:68]  # 8-byte offset
    b, out = cp.zeros((64, 64), cp.uint16), cp.zeros((4, 64), cp.uint16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        runner(a, b, out)

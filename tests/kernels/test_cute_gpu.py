"""CuTe kernels on the GPU: every case of the verification catalogue (openinfer_kernels.cute.verification.checks.CASES)
against float32, plus the launcher's pointer checks. ``python3 -m openinfer_kernels.cute.verification.run`` runs the
same cases with a hang watchdog per case; a hang here stops this process (status 3)."""
import pytest

from openinfer_kernels.cute.verification.checks import CASES

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def runner():
    from openinfer_kernels import cute
    from openinfer_kernels.cute.gemm import GemmRunner

    avail = cute.available()
    if not avail:
        pytest.skip(avail.reason)
    r = GemmRunner()
    r.init()
    return r


@pytest.mark.parametrize("case", CASES, ids=[f"{c.group}-{c.label}" for c in CASES])
def test_case_matches_float32(runner, case):
    from openinfer_kernels.cute.verification.checks import run_case

    check = run_case(runner, case)
    assert check.unwritten == 0, f"{check.unwritten} outputs not written; {check.detail}"
    assert check.ok, f"relative error {check.err:.3e}; {check.detail}"


def test_misaligned_pointer_is_rejected(runner):
    import cupy as cp

    a = cp.zeros((4, 72), cp.uint16)[:, 4:68]  # 8-byte offset
    b, out = cp.zeros((64, 64), cp.uint16), cp.zeros((4, 64), cp.uint16)
    with pytest.raises(ValueError, match="16-byte aligned"):
        runner(a, b, out)

"""The block-scaled FP8 GEMM's code, compiled for sm_90a without a GPU: each variant keeps a wgmma batch in
flight while it promotes the one before (``wgmma.wait_group 1`` in its PTX, not a drain at every k-tile), and
ptxas fits its total and two partial accumulators in registers (setmaxnreg on the 128x128 tile) without a spill."""
import os
import re
import subprocess
import sys

import pytest

from openinfer_kernels.cute.configs import FP8_GEMM_VARIANTS

COMPILE = """
import sys
from openinfer_kernels.cute.build import _fake_args  # sets CUTE_DSL_ARCH before the DSL loads
import cutlass.cute as cute
from openinfer_kernels.cute.configs import FP8_VARIANTS_BY_NAME
from openinfer_kernels.cute.gemm_sm90 import GemmSm90
compiled = cute.compile(GemmSm90(FP8_VARIANTS_BY_NAME[sys.argv[1]]).fp8_gemm, *_fake_args("fp8"), options="remarks{ptx}")
"""


@pytest.mark.parametrize("variant", [v.name for v in FP8_GEMM_VARIANTS])
def test_fp8_mainloop_overlaps_promotion_without_spills(variant, tmp_path):
    pytest.importorskip("cutlass", reason="CuTe DSL not installed")
    env = {**os.environ, "CUTE_DSL_KEEP": "ptx", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    run = subprocess.run([sys.executable, "-c", COMPILE, variant], capture_output=True, text=True, env=env,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    log = run.stdout + run.stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), (variant, spills)
    (ptx,) = tmp_path.glob("*.ptx")
    waits = set(re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+);", ptx.read_text()))
    assert waits == {"0", "1"}, (variant, waits)   # 1 in the loop; 0 only for the last k-tile

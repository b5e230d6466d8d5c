"""Run a bench script with some of the decode layer's fusions switched off, for A/B timing against
the default, e.g.

    python3 bench/unfused.py --without norm,swiglu bench/decode.py --models qwen3-4b --batches 8,32 --kernels all

- ``norm``: the RMSNorm is left out of the residual add (the path before rms_norm.cu's
  splitk_rms_norm_residual): the split-K reduction adds the residual, a separate rms_norm follows.
- ``swiglu``: the gate_up product runs the plain CuTe GEMM and silu_mul.cu after it, where its SiLU·up
  twin would have done both.
- ``a_box``: the 64-row tiles at M <= 16 load all 64 rows of A's tile, not its first 16
  (``configs.A_BOX_ROWS``).
"""
import argparse
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.executor.gpu_gemm import Gemm  # noqa: E402
from openinfer_kernels.cute import configs  # noqa: E402
from engine.executor.gpu_ops import GpuOps  # noqa: E402
from engine.models.ops import ComposedOps  # noqa: E402

FUSIONS = {"norm": lambda: setattr(GpuOps, "add_linear_norm", ComposedOps.add_linear_norm),
           "swiglu": lambda: setattr(Gemm, "cute_fuses_swiglu", lambda self, rows, w: False),
           "a_box": lambda: (setattr(configs, "A_BOX_ROWS", 0), configs.plan_gemm.cache_clear())}

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--without", required=True, help=f"comma-separated fusions to switch off: {', '.join(FUSIONS)}")
parser.add_argument("script")
args, rest = parser.parse_known_args()
for name in args.without.split(","):
    if name not in FUSIONS:
        parser.error(f"unknown fusion {name!r}: want one of {', '.join(FUSIONS)}")
    FUSIONS[name]()
sys.argv = [args.script] + rest
runpy.run_path(args.script, run_name="__main__")

"""Run a bench script with the decode layer's RMSNorm left out of the residual add (the path before
rms_norm.cu's splitk_rms_norm_residual): the split-K reduction adds the residual, a separate
rms_norm launch follows. For A/B timing against the default, e.g.

    python3 bench/unfused_norm.py bench/decode.py --models qwen3-4b --batches 8,32 --kernels all
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from engine.executor.gpu_ops import GpuOps  # noqa: E402
from engine.models.ops import ComposedOps  # noqa: E402

GpuOps.add_linear_norm = ComposedOps.add_linear_norm
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")

import os
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(TESTS))
sys.path.insert(1, TESTS)
# tests live in folders by area (engine, server, models, gpu, kernels, ...) and import each other's helpers by
# module name across them
for _area in sorted(os.listdir(TESTS)):
    if os.path.isdir(os.path.join(TESTS, _area)) and not _area.startswith(("_", ".")):
        sys.path.insert(2, os.path.join(TESTS, _area))


def _has_gpu() -> bool:
    try:
        import cupy  # noqa: F401
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def pytest_collection_modifyitems(config, items):
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

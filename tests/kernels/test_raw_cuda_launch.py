"""openinfer_kernels/raw_cuda/launch.py's argument packing and driver structures, and the module sources' header
digest (no GPU needed)."""
from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import numpy as np
import pytest

from openinfer_kernels.raw_cuda.launch import LaunchAttribute, LaunchConfig, pack_argument


def test_packs_device_arrays_as_pointers_and_numpy_scalars_as_their_c_types():
    fake = SimpleNamespace(data=SimpleNamespace(ptr=0x7F00_1234_5670))
    assert pack_argument(fake).value == 0x7F00_1234_5670
    for value, ctype in ((np.int32(-3), ctypes.c_int32), (np.int64(1 << 40), ctypes.c_int64),
                         (np.uint64(0), ctypes.c_uint64), (np.float32(0.5), ctypes.c_float)):
        packed = pack_argument(value)
        assert isinstance(packed, ctype) and packed.value == value.item()


@pytest.mark.parametrize("bad", [3, 0.5, np.float64(1.0), "x", None])
def test_rejects_arguments_without_an_unambiguous_c_type(bad):
    with pytest.raises(TypeError, match="kernel argument"):
        pack_argument(bad)


def test_driver_structures_match_cuda_h_layout():
    # CUlaunchAttribute: id (4) + pad (4) + 64-byte value union; CUlaunchConfig: 7 uint32, then
    # (8-aligned) stream, attrs pointer, numAttrs.
    assert ctypes.sizeof(LaunchAttribute) == 72 and LaunchAttribute.value.offset == 8
    attr = LaunchAttribute(id=6, value=1)
    raw = bytes(attr)
    assert raw[:4] == (6).to_bytes(4, "little") and raw[8:12] == (1).to_bytes(4, "little")
    assert raw.count(0) == 72 - 2
    assert LaunchConfig.stream.offset == 32 and LaunchConfig.attrs.offset == 40
    assert LaunchConfig.num_attrs.offset == 48 and ctypes.sizeof(LaunchConfig) == 56


def test_a_header_change_changes_every_module_source(tmp_path):
    """CuPy's kernel cache keys a module by its source text, not by the headers it includes: each module's
    source carries the headers' digest, so editing a .cuh changes every module's key (a .cu alone only its own)."""
    import shutil

    from openinfer_kernels.raw_cuda import KERNEL_DIR, headers_digest, module_source

    for f in os.listdir(KERNEL_DIR):
        if f.endswith((".cu", ".cuh")):
            shutil.copy(os.path.join(KERNEL_DIR, f), tmp_path / f)
    d = str(tmp_path)
    before = {n: module_source(n, d) for n in ("rms_norm", "paged_decode")}
    assert before["rms_norm"].startswith(f"// openinfer kernel headers {headers_digest(d)}\n")
    with open(tmp_path / "common.cuh", "a", encoding="utf-8") as f:
        f.write("\n// edited\n")
    headers_digest.cache_clear()
    after = {n: module_source(n, d) for n in ("rms_norm", "paged_decode")}
    headers_digest.cache_clear()
    assert all(after[n] != before[n] for n in before)
    assert after["rms_norm"].split("\n", 1)[1] == before["rms_norm"].split("\n", 1)[1]

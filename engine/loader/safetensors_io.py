"""Read safetensors checkpoints (single file or sharded with an index) as memory-mapped numpy
arrays in their stored dtype (bf16 as ml_dtypes.bfloat16), and write them back."""
from __future__ import annotations

import json
import math
import os
import struct
import threading

import ml_dtypes
import numpy as np

from engine.model_files import ModelLoadError, read_json_object

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def read_header(path: str) -> tuple[dict, int]:
    """(tensor entries, byte offset of the data section); ModelLoadError (a ValueError) naming the file and
    what is wrong with a header that is not safetensors' (`check_entry`), or a file shorter than its header
    says (a truncated download or copy)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        raw = f.read(8)
        if len(raw) != 8:
            raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes; truncated?)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(100 * 2**20, size - 8):
            raise ModelLoadError(f"{path}: not a safetensors file (header of {n} bytes in a file of {size})")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError) as e:
            raise ModelLoadError(f"{path}: the safetensors header is not valid JSON: {e}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: the safetensors header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        problem = check_entry(entry, size - 8 - n)
        if problem:
            raise ModelLoadError(f"{path}: tensor {name!r}: {problem}")
    return header, 8 + n


def check_entry(entry, data_bytes: int) -> str | None:
    """What is wrong with a header's tensor entry (None: nothing): it must be an object with a string
    'dtype', a 'shape' of non-negative integers and 'data_offsets' [begin, end] within the data section
    (`data_bytes` long), as many bytes as the shape holds in a dtype this reader knows."""
    if not isinstance(entry, dict):
        return f"its entry is a JSON {type(entry).__name__}, not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        return f"'dtype' {dtype!r} is not a string"
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        return f"'shape' {shape!r} is not a list of non-negative integers"
    pair = isinstance(offsets, list) and len(offsets) == 2 and all(_count(o) for o in offsets)
    if not (pair and offsets[0] <= offsets[1] <= data_bytes):
        truncated = pair and offsets[0] <= offsets[1]          # a whole header over a cut-off file
        return (f"'data_offsets' {offsets!r} is not [begin, end] within the file's {data_bytes} data bytes"
                + (": the file is truncated (an interrupted download or copy? fetch it again)" if truncated else ""))
    want = math.prod(shape) * DTYPES[dtype].itemsize if dtype in DTYPES else None
    if want is not None and offsets[1] - offsets[0] != want:
        return f"'data_offsets' {offsets!r} span {offsets[1] - offsets[0]} bytes; shape {shape} of {dtype} is {want}"
    return None


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


class SafetensorsCheckpoint:
    """name -> tensor over every safetensors file of a model folder; nothing is read until asked."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelLoadError(f"{index}: no 'weight_map' object of tensor name -> file name")
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(single):
            files = ["model.safetensors"]
        else:
            files = sorted(p for p in os.listdir(folder) if p.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(f"no model.safetensors (or model.safetensors.index.json) in {folder}")
        self._entries: dict[str, tuple[str, dict, int]] = {}
        self._maps: dict[str, np.memmap] = {}
        self._lock = threading.Lock()          # the loader reads experts from several threads
        for name in files:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise FileNotFoundError(f"checkpoint shard missing: {path}")
            header, start = read_header(path)
            for tensor, entry in header.items():
                self._entries[tensor] = (path, entry, start)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def keys(self) -> list[str]:
        return list(self._entries)

    def get(self, name: str) -> np.ndarray:
        path, entry, start = self._entries[name]
        if entry["dtype"] not in DTYPES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {entry['dtype']}")
        with self._lock:
            if path not in self._maps:
                self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        buf = self._maps[path][start + begin:start + end]
        return buf.view(DTYPES[entry["dtype"]]).reshape(entry["shape"])


def save_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write tensors (any dtype in DTYPES) to one safetensors file."""
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: unsupported dtype {a.dtype}")
        header[name] = {"dtype": DTYPE_NAMES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.reshape(-1).view(np.uint8).data)
    os.replace(tmp, path)

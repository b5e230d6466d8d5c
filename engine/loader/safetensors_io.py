"""Read safetensors checkpoints (single file or sharded with an index) as memory-mapped numpy
arrays in their stored dtype (bf16 as ml_dtypes.bfloat16), and write them back."""
from __future__ import annotations

import json
import os
import threading
import struct

import ml_dtypes
import numpy as np

DTYPES = {
    "BF16": np.dtype(ml_dtypes.bfloat16), "F16": np.dtype(np.float16), "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def read_header(path: str) -> tuple[dict, int]:
    """(tensor entries, byte offset of the data section)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise ValueError(f"{path}: not a safetensors file (header of {n} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


class SafetensorsCheckpoint:
    """name -> tensor over every safetensors file of a model folder; nothing is read until asked."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
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

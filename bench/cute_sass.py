"""Disassemble AOT-built CuTe kernels to SASS, on any machine (no GPU): the instruction view of a kernel.

    pip install nvidia-cuda-nvdisasm       # provides nvidia/cu13/bin/nvdisasm
    python3 bench/cute_sass.py gemm_bf16_128x80_c1x2_ws [more variants] [--out DIR] [--build DIR]

Each exported object (``openinfer_kernels/cute/build/obj/<name>.<hash>.o``) is a host object that carries its
kernel's cubin as data; this cuts the embedded ELF out (its length from the section and program
header tables), runs ``nvdisasm -c`` on it and writes ``<name>.sass``. It prints a summary per kernel:
instructions, wgmmas (HGMMA), TMA loads (UTMALDG), mbarrier waits (TRYWAIT) and named-barrier syncs.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
SHT_NOBITS = 8
COUNTED = ("HGMMA", "UTMALDG", "TRYWAIT", "BAR.SYNC", "NANOSLEEP")


def embedded_cubin(obj: bytes) -> bytes:
    """The device ELF inside a host object: the second ELF header in the file, cut at the end of
    its furthest section or header table."""
    start = obj.find(ELF_MAGIC, 1)
    if start < 0:
        raise ValueError("no embedded device ELF in this object")
    phoff, shoff = struct.unpack_from("<QQ", obj, start + 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", obj, start + 0x36)
    end = max(shoff + shentsize * shnum, phoff + phentsize * phnum)
    for i in range(shnum):
        header = start + shoff + i * shentsize
        kind = struct.unpack_from("<I", obj, header + 4)[0]
        offset, size = struct.unpack_from("<QQ", obj, header + 0x18)
        if kind != SHT_NOBITS:
            end = max(end, offset + size)
    return obj[start:start + end]


def nvdisasm() -> str:
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in sys.path:  # the pip wheel's binary
        candidate = Path(root) / "nvidia" / "cu13" / "bin" / "nvdisasm"
        if candidate.exists():
            return str(candidate)
    raise SystemExit("nvdisasm not found: pip install nvidia-cuda-nvdisasm (or put it on PATH)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--build", type=Path, default=Path(__file__).resolve().parents[1] / "openinfer_kernels/cute/build")
    parser.add_argument("--out", type=Path, default=Path("bench/out/sass"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tool = nvdisasm()
    for name in args.variants:
        objects = glob.glob(os.path.join(args.build, "obj", f"{name}.*.o"))
        if len(objects) != 1:
            raise SystemExit(f"{name}: expected one object in {args.build}/obj, found {len(objects)}")
        cubin = args.out / f"{name}.cubin"
        cubin.write_bytes(embedded_cubin(Path(objects[0]).read_bytes()))
        sass = subprocess.run([tool, "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
        (args.out / f"{name}.sass").write_text(sass)
        instructions = sum(1 for line in sass.splitlines() if line.strip().startswith("/*"))
        counts = ", ".join(f"{op} {sass.count(op)}" for op in COUNTED)
        print(f"{name}: {instructions} instructions; {counts} -> {args.out / (name + '.sass')}")


if __name__ == "__main__":
    main()

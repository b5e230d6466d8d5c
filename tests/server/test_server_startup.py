"""What `openinfer serve` says at start and at shutdown: the executor, its device and why, the library
of the linear layers; a GPU that CuPy cannot drive; what the shutdown did."""
from __future__ import annotations

import signal
import subprocess
from types import SimpleNamespace

from engine.executor.base import ExecutorBase
from server import startup
from harness.models import tiny_model_path
from test_server_cli import OPENINFER, ROOT, free_port, wait_healthy


def test_a_gpu_without_cupy_is_named_with_the_install_command(monkeypatch):
    monkeypatch.setattr(startup, "nvidia_gpu_present", lambda: "/dev/nvidia0")
    monkeypatch.setattr(startup, "cupy_status", lambda: "CuPy is not installed (ModuleNotFoundError: cupy)")
    warning = startup.gpu_warning("auto")
    assert "/dev/nvidia0" in warning and "CuPy is not installed" in warning and "'.[cuda,cute]'" in warning
    assert "openinfer_kernels.cute.build" in warning and "serving on the CPU" in warning
    assert startup.gpu_warning("cpu") is None                     # asked for the CPU: nothing to say
    monkeypatch.setattr(startup, "cupy_status", lambda: None)      # CuPy sees the GPU
    assert startup.gpu_warning("auto") is None
    monkeypatch.setattr(startup, "nvidia_gpu_present", lambda: None)
    monkeypatch.setattr(startup, "cupy_status", lambda: "CuPy is not installed")
    assert startup.gpu_warning("auto") is None                     # no GPU here at all


def test_the_executor_line_names_device_reason_and_library(monkeypatch):
    gpu = SimpleNamespace(executor=type("GpuExecutor", (ExecutorBase,), {"gemm": SimpleNamespace(
        describe=lambda: "linear layers: CuTe GEMM for at most 128 rows, cuBLAS otherwise")})())
    line = startup.describe_executor(gpu, "auto")
    assert line.startswith("executor: GpuExecutor on the GPU") and "CuTe GEMM for at most 128 rows" in line
    monkeypatch.setattr(startup, "cupy_status", lambda: "CuPy sees no GPU")
    cpu = SimpleNamespace(executor=type("CpuExecutor", (ExecutorBase,), {})())
    line = startup.describe_executor(cpu, "auto")
    assert "CpuExecutor (numpy) on the CPU (--device auto and CuPy sees no GPU)" in line and "BLAS" in line


def test_serve_logs_its_executor_at_start_and_what_it_did_at_shutdown():
    port = free_port()
    proc = subprocess.Popen(OPENINFER + ["serve", "--model", tiny_model_path("qwen3_tied"), "--device", "auto",
                                         "--port", str(port), "--max-model-len", "128", "--num-kv-blocks", "16"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc)
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    log = proc.stderr.read()
    assert proc.returncode == 0, log
    assert "executor: CPU (numpy)" in log               # the engine's own line (its process) reaches the log
    assert "executor: CpuExecutor (numpy) on the CPU (--device auto and " in log
    assert "[the engine process]" in log                # serve's default: the engine in a process of its own
    assert "shutdown: SIGINT received" in log and "0 of 0 running requests finished in the drain" in log
    assert "shutdown: engine stopped" in log

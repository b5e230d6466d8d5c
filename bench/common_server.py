"""Start `openinfer serve` for a benchmark and wait until it answers /health."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx


def start_server(serve_args: list[str], port: int, log: str, timeout_s: float = 600.0) -> tuple[subprocess.Popen, str]:
    """`python -m server.cli serve --port PORT *serve_args` from the repository, its stderr to `log`;
    returns (the process, its base URL) once healthy (SystemExit if it exits or never answers)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL,
                            stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}); see {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not start")

"""Start and stop one uvicorn process on a free 127.0.0.1 port, for a bounded time.

The process is ours: started with the server's production flags, probed for
readiness with a bounded retry (60 s at most: a start-up probe, not a test),
stopped with SIGTERM so the lifespan drains, and killed if it does not exit.
Its stderr goes to a file so a failed start can be explained.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0  # the server drains for drain_timeout_s (5 s in our configs) first


def model_path(repository: Path, name: str) -> Path:
    """Where the demo repository keeps version 1 of ``name`` (built by `make models`)."""
    return repository / name / "1" / "model.onnx"


class ServerError(RuntimeError):
    """The server did not become ready, or exited while we waited."""


@dataclass(frozen=True)
class ModelConfig:
    name: str
    path: Path
    max_batch_size: int = 64
    max_delay_ms: float = 1.0
    max_queue: int = 4096
    intra_op_threads: int = 1
    intra_op_spinning: bool = False
    servable: str | None = None
    slots: int = 0
    preprocess_workers: int = 0


def config_toml(models: list[ModelConfig], drain_timeout_s: float = 5.0) -> str:
    lines = ["[server]", f"drain_timeout_s = {drain_timeout_s}"]
    for m in models:
        lines += [
            "",
            f"[models.{m.name}]",
            f"path = {json.dumps(str(m.path.resolve()))}",  # a JSON string is a TOML string
            f"max_batch_size = {m.max_batch_size}",
            f"max_delay_ms = {m.max_delay_ms}",
            f"max_queue = {m.max_queue}",
            f"intra_op_threads = {m.intra_op_threads}",
            f"intra_op_spinning = {'true' if m.intra_op_spinning else 'false'}",
            f"slots = {m.slots}",
            f"preprocess_workers = {m.preprocess_workers}",
        ]
        if m.servable is not None:
            lines.append(f"servable = {json.dumps(m.servable)}")
    return "\n".join(lines) + "\n"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", "/ready")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _wait_ready(proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    backoff_s = 0.05
    while not _ready(port):
        if proc.poll() is not None:
            raise ServerError(f"the server exited with {proc.returncode}:\n{_tail(log)}")
        if time.monotonic() >= deadline:
            raise ServerError(
                f"the server was not ready within {READY_TIMEOUT_S:.0f} s:\n{_tail(log)}"
            )
        time.sleep(backoff_s)  # a start-up probe with a bounded backoff; never used in tests
        backoff_s = min(backoff_s * 2, 1.0)


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


@contextmanager
def serve(app: str, config: str | None = None) -> Iterator[str]:
    """Run ``uvicorn app`` (with ``config`` as its LOOPSERVE_CONFIG); yield its base URL."""
    with serve_process(app, config) as (url, _):
        yield url


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory so far (VmHWM), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise ServerError(f"no VmHWM for process {pid}")


@contextmanager
def serve_process(
    app: str, config: str | None = None
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """As ``serve``, also yielding the server process (to read its memory)."""
    with tempfile.TemporaryDirectory(prefix="loopserve-bench-") as tmp:
        env = dict(os.environ)
        if config is not None:
            path = Path(tmp) / "bench.toml"
            path.write_text(config)
            env["LOOPSERVE_CONFIG"] = str(path)
        log = Path(tmp) / "server.log"
        port = free_port()
        command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1"]
        command += ["--port", str(port), "--no-access-log", "--log-level", "warning"]
        with log.open("wb") as sink:
            proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=sink, stderr=sink)
        try:
            _wait_ready(proc, port, log)
            yield f"http://127.0.0.1:{port}", proc
        finally:
            _stop(proc)

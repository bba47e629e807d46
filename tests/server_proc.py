"""A real ``uvicorn`` in a subprocess on 127.0.0.1, its port read from its own log."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


@dataclass
class RunningServer:
    process: subprocess.Popen[str]
    url: str
    log: list[str] = field(default_factory=list)


@contextmanager
def uvicorn(app: str, *extra: str, env: dict[str, str] | None = None) -> Iterator[RunningServer]:
    command = [sys.executable, "-m", "uvicorn", app, "--host", "127.0.0.1", "--port", "0"]
    command += ["--log-level", "info", "--no-access-log", *extra]
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    log: list[str] = []
    assert process.stderr is not None
    port = None
    for line in process.stderr:  # blocks on the server's own output; ends if it exits
        log.append(line)
        if match := LISTENING.search(line):
            port = match.group(1)
            break
    if port is None:
        process.wait(timeout=10)
        process.stderr.close()
        raise RuntimeError("uvicorn did not start:\n" + "".join(log))
    # Keep draining stderr, or a full pipe would block the server's logging.
    drain = threading.Thread(target=lambda: log.extend(process.stderr or ()), daemon=True)
    drain.start()
    server = RunningServer(process, f"http://127.0.0.1:{port}", log)
    try:
        yield server
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
        drain.join(timeout=10)
        process.stderr.close()

"""Run wrk against one URL for a bounded time and parse its result.

A Lua script posts the JSON body and, in ``done()``, prints one marked JSON
line with the counts and latency percentiles, so parsing never depends on
wrk's human-readable summary. Non-2xx/3xx answers (503 overload, 504 timeout)
arrive as ``summary.errors.status``; a ``response()`` hook would slow wrk down.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "LOOPSERVE-BENCH "

# Latencies from wrk are in microseconds; done() runs once, on wrk's main thread.
_LUA = """\
wrk.method = "POST"
{headers}wrk.body = "{body}"

function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '{marker}{{"requests": %d, "duration_us": %d, "connect": %d, "read": %d, "write": %d, '
      .. '"status": %d, "timeout": %d, "p50_us": %d, "p99_us": %d}}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(99)))
end
"""


class WrkError(RuntimeError):
    """wrk is missing, failed, or printed no result line."""


@dataclass(frozen=True)
class WrkResult:
    requests: int
    duration_s: float
    errors: int  # non-2xx/3xx answers plus socket errors and wrk's own timeouts
    p50_ms: float
    p99_ms: float

    @property
    def ok_per_s(self) -> float:
        """Successful answers per second: error answers are not throughput."""
        if self.duration_s <= 0:
            return 0.0
        return max(self.requests - self.errors, 0) / self.duration_s


def require_wrk() -> str:
    path = shutil.which("wrk")
    if path is None:
        raise WrkError(
            "wrk is not on PATH; install it with `apt-get install -y wrk` (Debian/Ubuntu) "
            "or `make bench`, which does so"
        )
    return path


def lua_script(body: bytes, headers: dict[str, str] | None = None) -> str:
    """The POST script; any body bytes survive (binary V2 bodies too)."""
    sent = {"Content-Type": "application/json"} if headers is None else headers
    lines = "".join(
        f"wrk.headers[{_lua(k.encode())}] = {_lua(v.encode())}\n" for k, v in sent.items()
    )
    return _LUA.format(headers=lines, body=_lua(body)[1:-1], marker=MARKER)


def _lua(data: bytes) -> str:
    """A Lua string literal: printable ASCII as is, every other byte as a 3-digit escape."""
    safe = (chr(b) if 32 <= b < 127 and b not in b'"\\' else f"\\{b:03d}" for b in data)
    return '"' + "".join(safe) + '"'


def parse_output(stdout: str) -> WrkResult:
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            raw = json.loads(line[len(MARKER) :])
            return WrkResult(
                requests=raw["requests"],
                duration_s=raw["duration_us"] / 1e6,
                errors=sum(raw[k] for k in ("connect", "read", "write", "status", "timeout")),
                p50_ms=raw["p50_us"] / 1e3,
                p99_ms=raw["p99_us"] / 1e3,
            )
    raise WrkError(f"wrk printed no result line; its output was:\n{stdout[-2000:]}")


def run_wrk(
    url: str,
    body: bytes,
    clients: int,
    duration_s: int,
    headers: dict[str, str] | None = None,
) -> WrkResult:
    """One load point: ``clients`` connections on one wrk thread for ``duration_s`` seconds."""
    if not url.startswith("http://127.0.0.1:"):
        raise ValueError(f"the benchmark only loads 127.0.0.1, not {url}")
    wrk = require_wrk()
    with tempfile.TemporaryDirectory(prefix="loopserve-wrk-") as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(lua_script(body, headers))
        # One thread: the machine has two cores and the server needs the other one.
        # A 10 s request timeout so slow unbatched points count latency, not errors.
        command = [wrk, "-t1", f"-c{clients}", f"-d{duration_s}s", "--timeout", "10s"]
        command += ["-s", str(script), url]
        try:
            done = subprocess.run(
                command, capture_output=True, text=True, timeout=duration_s + 30, check=False
            )
        except subprocess.TimeoutExpired as exc:
            raise WrkError(f"wrk did not finish within {duration_s + 30} s: {command}") from exc
    if done.returncode != 0:
        raise WrkError(f"wrk exited with {done.returncode}: {done.stderr.strip() or done.stdout}")
    return parse_output(done.stdout)

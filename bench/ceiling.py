"""The model ceiling: raw ONNX Runtime throughput, in process, no HTTP, no queue.

Sessions use the server's options (one intra-op and one inter-op thread, no
spinning; see pipeline/runtime.py), so batched server throughput can be read
as a fraction of what the model itself can do at that batch size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from bench.payload import INPUT_WIDTH
from bench.servers import model_path


@dataclass(frozen=True)
class CeilingPoint:
    model: str
    batch: int
    items_per_s: float
    runs: int


def session(path: Path, intra_op_threads: int = 1, spinning: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = intra_op_threads
    options.inter_op_num_threads = 1
    spin = "1" if spinning else "0"
    options.add_session_config_entry("session.intra_op.allow_spinning", spin)
    options.add_session_config_entry("session.inter_op.allow_spinning", spin)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def measure(sess: ort.InferenceSession, model: str, batch: int, seconds: float) -> CeilingPoint:
    x = np.random.default_rng(0).standard_normal((batch, INPUT_WIDTH[model])).astype(np.float32)
    sess.run(None, {"x": x})  # first run allocates; keep it out of the timing
    runs = 0
    start = now = time.perf_counter()
    while now - start < seconds:
        sess.run(None, {"x": x})
        runs += 1
        now = time.perf_counter()
    return CeilingPoint(
        model=model, batch=batch, items_per_s=runs * batch / (now - start), runs=runs
    )


def run_ceiling(
    model_dir: Path, batches: dict[str, tuple[int, ...]], seconds: float
) -> list[CeilingPoint]:
    points: list[CeilingPoint] = []
    for model, sizes in batches.items():
        sess = session(model_path(model_dir, model))
        for batch in sizes:
            point = measure(sess, model, batch, seconds)
            print(f"  ceiling {model} batch {batch}: {point.items_per_s:,.0f} items/s", flush=True)
            points.append(point)
    return points

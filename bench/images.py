"""The classifier end to end from photo-sized JPEG bytes: preprocessing workers, and
memory under overload with and without data slots.

A 1920x1080 JPEG is generated (seeded: a gradient with noise, like a photo) and
posted as raw bytes. Workers 0, 1 and 2 show how far parallel preprocessing moves
the GIL-bound ceiling; the overlap points compare one batch's worth of slots (no
preprocessing while a batch runs) with two; the memory points read the server's
peak RSS (VmHWM) under 10x more clients than slots, with the default slots and
with slots that never run out (the same server without the bound).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from bench.servers import ModelConfig, config_toml, model_path, peak_rss_mb, serve_process
from bench.wrk import run_wrk

CLIENTS = 32
MAX_BATCH = 16
SLOTS = 2 * MAX_BATCH
UNBOUNDED_SLOTS = 4096


@dataclass(frozen=True)
class ImagePoint:
    setup: str  # workers=N | slots=N
    clients: int
    req_per_s: float
    p99_ms: float
    errors: int
    peak_rss_mb: float


def photo_jpeg(width: int = 1920, height: int = 1080) -> bytes:
    rng = np.random.default_rng(1080)
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :, None]
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None, None]
    pixels = np.clip(0.5 * x + 0.5 * y + rng.normal(0, 25, (height, width, 3)), 0, 255)
    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format="JPEG", quality=90)
    return buffer.getvalue()


def _point(
    app: str, model: ModelConfig, setup: str, clients: int, duration_s: int, body: bytes
) -> ImagePoint:
    headers = {"Content-Type": "image/jpeg"}
    with serve_process(app, config_toml([model])) as (url, proc):
        target = f"{url}/predict/classifier"
        run_wrk(target, body, 4, 1, headers)  # warm-up
        result = run_wrk(target, body, clients, duration_s, headers)
        rss = peak_rss_mb(proc.pid)
    point = ImagePoint(setup, clients, result.ok_per_s, result.p99_ms, result.errors, rss)
    print(
        f"  classifier {setup} @{clients}: {point.req_per_s:,.1f} req/s, p99 "
        f"{point.p99_ms:.0f} ms, errors {point.errors}, peak RSS {point.peak_rss_mb:,.0f} MiB",
        flush=True,
    )
    return point


def run_images(app: str, model_dir: Path, duration_s: int) -> list[ImagePoint]:
    body = photo_jpeg()
    path = model_path(model_dir, "classifier")
    points: list[ImagePoint] = []
    for workers in (0, 1, 2):
        model = ModelConfig(
            "classifier", path, max_batch_size=MAX_BATCH, servable="classifier",
            preprocess_workers=workers,
        )  # fmt: skip
        points.append(_point(app, model, f"workers={workers}", CLIENTS, duration_s, body))
    # Overlap: with one batch's worth of slots the next batch cannot be preprocessed while
    # one runs; with two (the default) it can.
    for slots in (MAX_BATCH, SLOTS):
        model = ModelConfig(
            "classifier", path, max_batch_size=MAX_BATCH, servable="classifier", slots=slots
        )
        points.append(_point(app, model, f"overlap slots={slots}", CLIENTS, duration_s, body))
    for slots in (SLOTS, UNBOUNDED_SLOTS):
        model = ModelConfig(
            "classifier", path, max_batch_size=MAX_BATCH, servable="classifier", slots=slots,
            max_queue=4096,
        )  # fmt: skip
        points.append(_point(app, model, f"slots={slots}", 10 * SLOTS, duration_s, body))
    return points

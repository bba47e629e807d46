"""Decomposed inference: tiles per second on a 10000x10000 scene, and peak memory.

Three rates for the same tiles: the server batching them (max batch 8), the server
taking them one at a time (max batch 1: one tile in flight, as a client-side loop
such as SAHI's would), and raw ONNX Runtime at batch 8 on ready tensors (the
ceiling). Peak RSS (VmHWM) of the server after a 10000x10000 and a 20000x20000
scene: the decoded image is held once (uint8); tiles never outnumber the slots.
"""

from __future__ import annotations

import io
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
from PIL import Image

from bench.servers import ModelConfig, config_toml, model_path, peak_rss_mb, serve_process
from models.detector.scenes import generate

BATCH = 8


@dataclass(frozen=True)
class TilePoint:
    setup: str
    side: int  # the scene's side in pixels
    tiles: int
    seconds: float
    peak_rss_mb: float

    @property
    def tiles_per_s(self) -> float:
        return self.tiles / self.seconds if self.seconds else 0.0


def _scene_tiff(side: int, seed: int) -> bytes:
    scene = generate(side, side, seed)
    buffer = io.BytesIO()
    Image.fromarray(scene.image).save(buffer, format="TIFF")  # uncompressed: quick both ways
    return buffer.getvalue()


def _detector(model_dir: Path, max_batch_size: int) -> str:
    config = ModelConfig("detector", model_path(model_dir, "detector"), servable="detector",
                         max_batch_size=max_batch_size)  # fmt: skip
    text = config_toml([config])
    # One request is a whole scene: its deadline covers every tile.
    return text + "max_image_pixels = 400000000\nmax_body_bytes = 1610612736\ntimeout_s = 900\n"


def _through_server(app: str, config: str, body: bytes, setup: str, side: int) -> TilePoint:
    with serve_process(app, config) as (url, proc):
        with httpx.Client(base_url=url, timeout=900) as client:
            started = time.perf_counter()
            response = client.post(
                "/predict/detector", content=body, headers={"content-type": "image/tiff"}
            )
            seconds = time.perf_counter() - started
        if response.status_code != 200:
            raise RuntimeError(f"tiles bench: {response.status_code} {response.text[:300]}")
        point = TilePoint(setup, side, response.json()["tiles"], seconds, peak_rss_mb(proc.pid))
    print(
        f"  tiles {setup} {side}x{side}: {point.tiles} tiles in {point.seconds:.1f} s = "
        f"{point.tiles_per_s:,.1f} tiles/s, peak RSS {point.peak_rss_mb:,.0f} MiB",
        flush=True,
    )
    return point


def _ceiling(model_dir: Path, seconds: float = 3.0) -> TilePoint:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(
        str(model_path(model_dir, "detector")), options, providers=["CPUExecutionProvider"]
    )
    batch = np.random.default_rng(0).random((BATCH, 3, 640, 640), dtype=np.float32)
    session.run(None, {"image": batch})
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        session.run(None, {"image": batch})
        runs += 1
    point = TilePoint(
        f"raw ORT batch {BATCH}", 640, runs * BATCH, time.perf_counter() - started, 0.0
    )
    print(f"  tiles {point.setup}: {point.tiles_per_s:,.1f} tiles/s", flush=True)
    return point


def run_tiles(app: str, model_dir: Path, big: bool = True) -> list[TilePoint]:
    body = _scene_tiff(10_000, 21)
    points = [
        _through_server(app, _detector(model_dir, BATCH), body, f"batched (max {BATCH})", 10_000),
        _through_server(app, _detector(model_dir, 1), body, "one at a time (max 1)", 10_000),
        _ceiling(model_dir),
    ]
    del body
    if big:
        huge = _scene_tiff(20_000, 22)
        points.append(
            _through_server(
                app, _detector(model_dir, BATCH), huge, f"batched (max {BATCH})", 20_000
            )
        )
    return points

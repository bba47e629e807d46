"""Decomposed inference: detect objects in an image far larger than the model's input.

The image is decoded once (uint8); a plan of overlapping tiles is made
(``pipeline.tiling``); tiles are cut lazily, each the moment it gets a data slot,
by at most ``in_flight`` workers per request, so a 20000x20000 image never holds
more tiles than it has slots. Each tile is a sub-request through the model's own
batcher: tiles of one image and of other clients batch together, and since a tile
takes its slot in FIFO order after the ones already waiting, other clients are
interleaved rather than starved. Detections are shifted to image coordinates and
merged. A failing tile, a passed deadline or a client that leaves cancels the
rest: nothing is left running.
"""

from __future__ import annotations

import asyncio
import io
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

from pipeline.errors import BadRequest, LoopserveError, ModelError
from pipeline.model import ServedModel
from pipeline.runtime import Arrays
from pipeline.servable import TiledServable
from pipeline.tiling import (
    Detection,
    Tile,
    full_image_scale,
    merge,
    plan_tiles,
    shift,
)

log = logging.getLogger(__name__)

RENDER_MAX_PX = 2048  # a rendered answer is scaled down to at most this side


@dataclass(frozen=True)
class TileOptions:
    tile: int | None = None  # tile side in image pixels; None = the model's input side
    overlap: float = 0.2
    strategy: str = "greedynmm"
    metric: str = "ios"
    match_threshold: float = 0.5
    score_threshold: float = 0.5
    class_agnostic: bool = False
    full_image: bool = False  # one more pass on the whole image, downscaled to one tile
    render: bool = False  # answer a PNG with the boxes drawn instead of JSON

    @classmethod
    def from_query(cls, query: Mapping[str, str]) -> TileOptions:
        known = {
            "tile", "overlap", "strategy", "metric", "match_threshold", "score_threshold",
            "class_agnostic", "full_image", "render", "timeout_s",
        }  # fmt: skip
        for key in query:
            if key not in known:
                raise BadRequest(f"unknown option {key!r}; the options are {sorted(known)}")
        options = cls(
            tile=_int(query, "tile", None, 64, 20_000),
            overlap=_float(query, "overlap", 0.2, 0.0, 0.9),
            strategy=query.get("strategy", "greedynmm").lower(),
            metric=query.get("metric", "ios").lower(),
            match_threshold=_float(query, "match_threshold", 0.5, 0.0, 1.0),
            score_threshold=_float(query, "score_threshold", 0.5, 0.0, 1.0),
            class_agnostic=_bool(query, "class_agnostic"),
            full_image=_bool(query, "full_image"),
            render=query.get("render", "").lower() == "png",
        )
        if options.strategy not in ("greedynmm", "nms"):
            raise BadRequest("strategy must be greedynmm or nms")
        if options.metric not in ("ios", "iou"):
            raise BadRequest("metric must be ios or iou")
        if "render" in query and not options.render:
            raise BadRequest("render takes one value: png")
        return options


def _float(query: Mapping[str, str], key: str, default: float, low: float, high: float) -> float:
    raw = query.get(key)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"{key} must be a number, got {raw!r}") from None
    if not low <= value <= high or math.isnan(value):
        raise BadRequest(f"{key} must be in [{low}, {high}], got {value}")
    return value


def _int(
    query: Mapping[str, str], key: str, default: int | None, low: int, high: int
) -> int | None:
    raw = query.get(key)
    if raw is None:
        return default
    if not raw.isdigit() or not low <= int(raw) <= high:
        raise BadRequest(f"{key} must be a whole number in [{low}, {high}], got {raw!r}")
    return int(raw)


def _bool(query: Mapping[str, str], key: str) -> bool:
    raw = query.get(key, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise BadRequest(f"{key} must be true or false, got {raw!r}")
    return raw in ("true", "1")


@dataclass(frozen=True)
class TiledResult:
    detections: list[Detection]
    tiles: int
    width: int
    height: int
    image: np.ndarray | None  # kept only to render

    def as_json(self) -> dict[str, object]:
        return {
            "detections": [
                {"box": [d.x1, d.y1, d.x2, d.y2], "score": d.score, "label": d.label}
                for d in self.detections
            ],
            "tiles": self.tiles,
            "image": {"width": self.width, "height": self.height},
        }


async def detect(
    model: ServedModel,
    held: list[bytes],
    options: TileOptions,
    deadline: float,
    priority: int = 0,
) -> TiledResult:
    """Detect over the whole image, tile by tile, through the model's batcher. ``held``
    holds the encoded image and is emptied: the body is freed once it is decoded."""
    servable: TiledServable = model.servable  # type: ignore[assignment]
    image = await asyncio.to_thread(servable.decode, held.pop())
    height, width = int(image.shape[0]), int(image.shape[1])
    side = model.signature.inputs[0].shape[-1] or 640
    tile = options.tile or side
    if tile > side:
        raise BadRequest(f"tile must be at most the model's input side, {side} pixels")
    plan = plan_tiles(width, height, tile, options.overlap)
    # Tiles smaller than the model's input are padded, never stretched: a detector sees
    # objects at their own size.
    jobs: list[tuple[Tile | None, float]] = [(t, 1.0) for t in plan]
    if options.full_image:
        jobs.append((None, 1.0 / full_image_scale(width, height, side)))
    in_flight = max(1, min(model.settings.max_batch_size, model.slots.count // 2))
    found: list[Detection] = []
    pending: Iterator[tuple[Tile | None, float]] = iter(jobs)

    async def worker() -> None:
        for job, scale in pending:  # a shared iterator: each tile is cut once, when its turn comes

            def make(job: Tile | None = job) -> Arrays:
                return servable.tile_input(_cut(image, job, side))

            outputs = await model.sub_request(make, deadline, priority)
            # Peak finding is ~20 ms of numpy per tile: off the loop.
            boxes = await asyncio.to_thread(servable.detections, outputs, options.score_threshold)
            dx, dy = (0.0, 0.0) if job is None else (float(job.x), float(job.y))
            found.extend(shift([Detection(*b) for b in boxes], dx, dy, scale))

    try:
        async with asyncio.TaskGroup() as group:  # one failure cancels the rest
            for _ in range(min(in_flight, len(jobs))):
                group.create_task(worker())
    except BaseExceptionGroup as failed:
        raise _first_cause(failed, model.name) from None
    merged = await asyncio.to_thread(
        merge,
        found,
        strategy=options.strategy,
        metric=options.metric,
        threshold=options.match_threshold,
        class_agnostic=options.class_agnostic,
    )
    return TiledResult(merged, len(jobs), width, height, image if options.render else None)


def _first_cause(failed: BaseExceptionGroup[BaseException], model: str) -> BaseException:
    """What to answer when tiles failed: the client's own error (a deadline, a departure)
    as it is; anything else is the model's failure, logged, answered without internals."""
    causes = list(_leaves(failed))
    for cause in causes:
        if isinstance(cause, LoopserveError):
            return cause
    log.error("model %s: a tile failed", model, exc_info=causes[0])
    return ModelError(f"model {model} failed on a tile of this image; the request was stopped")


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            yield from _leaves(error)
        else:
            yield error


def _cut(image: np.ndarray, tile: Tile | None, side: int) -> np.ndarray:
    """The pixels of one tile (the servable pads it to the model's side); ``None`` is the
    whole image, downscaled to fit one tile (the full-image pass)."""
    if tile is None:
        height, width = image.shape[:2]
        scale = full_image_scale(width, height, side)
        small = Image.fromarray(image).resize(
            (max(1, round(width * scale)), max(1, round(height * scale))),
            Image.Resampling.BILINEAR,
        )
        return np.asarray(small)
    return np.ascontiguousarray(image[tile.y : tile.y + tile.height, tile.x : tile.x + tile.width])


def render_png(result: TiledResult) -> bytes:
    """The image with its boxes drawn, scaled down to at most RENDER_MAX_PX a side."""
    if result.image is None:
        raise ValueError("render_png needs the image; detect with render=True")
    picture = Image.fromarray(result.image)
    scale = min(1.0, RENDER_MAX_PX / max(result.width, result.height))
    if scale < 1.0:
        picture = picture.resize(
            (max(1, round(result.width * scale)), max(1, round(result.height * scale))),
            Image.Resampling.BILINEAR,
        )
    draw = ImageDraw.Draw(picture)
    for d in result.detections:
        box = [d.x1 * scale, d.y1 * scale, d.x2 * scale, d.y2 * scale]
        draw.rectangle(box, outline=(255, 0, 255), width=max(1, round(3 * scale) or 1))
        draw.text((box[0], max(0.0, box[1] - 12)), f"{d.label} {d.score:.2f}", fill=(255, 0, 255))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()

"""Turn one run's points into markdown tables, target ratios, and a JSON file.

Ratios are computed only from this run's numbers. A ratio whose inputs were
not measured (``--only``) is shown as n/a; a MISS is reported, never fatal.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import onnxruntime as ort

from bench.ceiling import CeilingPoint
from bench.images import ImagePoint
from bench.suite import Point
from bench.tiles import TilePoint


@dataclass(frozen=True)
class Ratio:
    name: str
    value: float | None  # None: an input was not measured in this run
    target: float | None  # None: reported for reading, no target

    @property
    def verdict(self) -> str:
        if self.target is None or self.value is None:
            return ""
        return "PASS" if self.value >= self.target else "MISS"


def _rps(
    points: Sequence[Point], section: str, setup: str, model: str, clients: int
) -> float | None:
    for p in points:
        if (p.section, p.setup, p.model, p.clients) == (section, setup, model, clients):
            return p.req_per_s
    return None


def _items(ceiling: Sequence[CeilingPoint], model: str, batch: int) -> float | None:
    return next((c.items_per_s for c in ceiling if (c.model, c.batch) == (model, batch)), None)


def _divide(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def ratios(points: Sequence[Point], ceiling: Sequence[CeilingPoint]) -> list[Ratio]:
    def server(setup: str, model: str, clients: int) -> float | None:
        return _rps(points, "server", setup, model, clients)

    def v2(setup: str, model: str) -> float | None:
        return _rps(points, "v2", setup, model, 64)

    return [
        Ratio(
            "tiny@64 batched / bare@64",
            _divide(server("batched", "tiny", 64), _rps(points, "bare", "bare", "tiny", 64)),
            0.90,
        ),
        Ratio(
            "mlp@64 batched / mlp@64 unbatched",
            _divide(server("batched", "mlp", 64), server("unbatched", "mlp", 64)),
            2.0,
        ),
        Ratio(
            "mlp@1 batched / mlp@1 unbatched",
            _divide(server("batched", "mlp", 1), server("unbatched", "mlp", 1)),
            0.90,
        ),
        Ratio(
            "mlp@64 batched req/s / raw ORT mlp batch-64 items/s",
            _divide(server("batched", "mlp", 64), _items(ceiling, "mlp", 64)),
            None,
        ),
        Ratio(
            "mlp@64 V2 binary / V2 JSON",
            _divide(v2("v2-binary", "mlp"), v2("v2-json", "mlp")),
            1.0,
        ),
        Ratio(
            "mlp@64 V2 binary / /predict JSON",
            _divide(v2("v2-binary", "mlp"), v2("predict-json", "mlp")),
            None,
        ),
        Ratio(
            "tiny@64 V2 binary / /predict JSON",
            _divide(v2("v2-binary", "tiny"), v2("predict-json", "tiny")),
            None,
        ),
    ]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def render(points: Sequence[Point], ceiling: Sequence[CeilingPoint], found: Sequence[Ratio]) -> str:
    parts: list[str] = []
    if points:
        rows = [
            [
                p.section,
                p.setup,
                p.model,
                str(p.clients),
                f"{p.req_per_s:,.0f}",
                f"{p.p50_ms:.2f}",
                f"{p.p99_ms:.2f}",
                str(p.errors),
            ]
            for p in points
        ]
        header = ["section", "setup", "model", "clients", "req/s", "p50 ms", "p99 ms", "errors"]
        parts.append(_table(header, rows))
    if ceiling:
        rows = [[c.model, str(c.batch), f"{c.items_per_s:,.0f}"] for c in ceiling]
        parts.append(_table(["raw ORT model", "batch", "items/s"], rows))
    rows = [
        [
            r.name,
            "n/a" if r.value is None else f"{r.value:.2f}",
            "" if r.target is None else f">= {r.target:.2f}",
            r.verdict,
        ]
        for r in found
    ]
    parts.append(_table(["ratio", "value", "target", "verdict"], rows))
    return "\n\n".join(parts)


def write_json(
    path: Path,
    settings: dict[str, object],
    points: Sequence[Point],
    ceiling: Sequence[CeilingPoint],
    found: Sequence[Ratio],
) -> None:
    document = {
        "host": {
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "python": platform.python_version(),
            "onnxruntime": ort.__version__,
        },
        "settings": settings,
        "points": [asdict(p) for p in points],
        "ceiling": [asdict(c) for c in ceiling],
        "ratios": [{**asdict(r), "verdict": r.verdict or None} for r in found],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2) + "\n")


def render_images(points: Sequence[ImagePoint]) -> str:
    rows = [
        [p.setup, str(p.clients), f"{p.req_per_s:,.1f}", f"{p.p99_ms:.0f}", str(p.errors),
         f"{p.peak_rss_mb:,.0f}"]
        for p in points
    ]  # fmt: skip
    table = _table(["classifier", "clients", "req/s", "p99 ms", "errors", "peak RSS MiB"], rows)
    by = {p.setup: p for p in points}
    lines = [table, ""]
    w0, w2 = by.get("workers=0"), by.get("workers=2")
    if w0 and w2 and w0.req_per_s:
        lines.append(f"preprocess_workers 2 / 0: {w2.req_per_s / w0.req_per_s:.2f}x req/s")
    overlap = [p for p in points if p.setup.startswith("overlap ")]
    if len(overlap) == 2 and overlap[0].req_per_s:
        one, two = overlap
        lines.append(
            f"2 x max batch slots / 1 x (preprocessing overlapping the running batch): "
            f"{two.req_per_s / one.req_per_s:.2f}x req/s"
        )
    slot_points = [p for p in points if p.setup.startswith("slots=")]
    if len(slot_points) == 2:
        low, high = slot_points
        lines.append(
            f"peak RSS under 10x overload: {low.setup} {low.peak_rss_mb:,.0f} MiB, "
            f"{high.setup} {high.peak_rss_mb:,.0f} MiB ({high.peak_rss_mb / low.peak_rss_mb:.2f}x)"
        )
    return "\n".join(lines)


def render_tiles(points: Sequence[TilePoint]) -> str:
    rows = [
        [p.setup, f"{p.side}x{p.side}", str(p.tiles), f"{p.seconds:.1f}", f"{p.tiles_per_s:,.1f}",
         f"{p.peak_rss_mb:,.0f}" if p.peak_rss_mb else "-"]
        for p in points
    ]  # fmt: skip
    table = _table(["detector", "scene", "tiles", "seconds", "tiles/s", "peak RSS MiB"], rows)
    batched = next((p for p in points if p.setup.startswith("batched") and p.side == 10_000), None)
    single = next((p for p in points if p.setup.startswith("one at a time")), None)
    raw = next((p for p in points if p.setup.startswith("raw ORT")), None)
    lines = [table, ""]
    if batched and single and single.tiles_per_s:
        lines.append(f"batched / one at a time: {batched.tiles_per_s / single.tiles_per_s:.2f}x")
    if batched and raw and raw.tiles_per_s:
        lines.append(f"batched / raw ORT at batch 8: {batched.tiles_per_s / raw.tiles_per_s:.2f}")
    return "\n".join(lines)

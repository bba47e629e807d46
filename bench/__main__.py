"""``python -m bench``: parse the flags, check the prerequisites, run the sections, report.

Sections run one after another in a fixed order (overhead, bare, ceiling, server,
v2, spin, images, tiles); each bounds its own time. Missing prerequisites stop the
run with a message that says what to do; missed targets do not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bench import report
from bench.ceiling import CeilingPoint, run_ceiling
from bench.images import ImagePoint, run_images
from bench.overhead import Overhead, run_overhead
from bench.servers import REPO, ServerError, model_path
from bench.suite import Point, run_bare, run_server, run_spin, run_v2
from bench.tiles import TilePoint, run_tiles
from bench.wrk import WrkError, require_wrk

SECTIONS = ("overhead", "bare", "ceiling", "server", "v2", "spin", "images", "tiles")
CLIENTS = (1, 16, 64, 256)
QUICK_CLIENTS = (1, 64)
CEILING_BATCHES: dict[str, tuple[int, ...]] = {"mlp": (1, 8, 32, 64), "tiny": (1, 64)}


def _sections(text: str) -> list[str]:
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SECTIONS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {unknown or text!r}; choose from {','.join(SECTIONS)}"
        )
    return chosen


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of seconds >= 1, got {text}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument(
        "--duration", type=_positive_int, default=4, help="seconds per load point (default 4)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: 1 s points, clients 1 and 64 only"
    )
    parser.add_argument(
        "--only", type=_sections, default=list(SECTIONS), help="comma list of " + ",".join(SECTIONS)
    )
    parser.add_argument(
        "--models",
        type=Path,
        default=REPO / "repository",
        help="model repository holding mlp/1/model.onnx and tiny/1/model.onnx",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=REPO / "build" / "bench" / "results.json",
        help="where the JSON results go",
    )
    parser.add_argument("--app", default="server:app", help="the ASGI app under test")
    return parser.parse_args(argv)


def _check(args: argparse.Namespace) -> None:
    """Fail before any load starts, with a message that says what to do."""
    if {"bare", "server", "v2", "spin", "images"} & set(args.only):
        require_wrk()
    if {"ceiling", "server", "v2", "spin", "overhead", "images"} & set(args.only):
        missing = [m for m in ("mlp", "tiny") if not model_path(args.models, m).is_file()]
        if missing:
            raise FileNotFoundError(
                f"no {', '.join(missing)} model in {args.models}; build them with `make models`"
            )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    duration_s: int = 1 if args.quick else args.duration
    clients = QUICK_CLIENTS if args.quick else CLIENTS
    try:
        _check(args)
    except (WrkError, FileNotFoundError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    points: list[Point] = []
    ceiling: list[CeilingPoint] = []
    overhead: Overhead | None = None
    images: list[ImagePoint] = []
    tiles: list[TilePoint] = []
    try:
        if "overhead" in args.only:
            print("per-request CPU at the ASGI level (no HTTP), tiny, 64 callers", flush=True)
            overhead = run_overhead(args.models, 5_000 if args.quick else 20_000)
        if "bare" in args.only:
            print("HTTP ceiling (bare Starlette app)", flush=True)
            points += run_bare(clients, duration_s)
        if "ceiling" in args.only:
            print("model ceiling (raw ONNX Runtime, 1 intra-op thread)", flush=True)
            ceiling += run_ceiling(args.models, CEILING_BATCHES, 0.5 if args.quick else 1.5)
        if "server" in args.only:
            print(f"server {args.app}: batched and unbatched", flush=True)
            points += run_server(args.app, args.models, clients, duration_s)
        if "v2" in args.only:
            print(f"server {args.app}: /predict JSON vs Open Inference Protocol", flush=True)
            points += run_v2(args.app, args.models, duration_s)
        if "spin" in args.only:
            print(f"server {args.app}: intra-op spinning and threads", flush=True)
            points += run_spin(args.app, args.models, duration_s)
        if "images" in args.only:
            print(f"server {args.app}: classifier from 1920x1080 JPEGs", flush=True)
            images = run_images(args.app, args.models, duration_s)
        if "tiles" in args.only:
            print(f"server {args.app}: detector on 10000x10000 and 20000x20000 scenes", flush=True)
            tiles = run_tiles(args.app, args.models, big=not args.quick)
    except (WrkError, ServerError) as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 1
    found = report.ratios(points, ceiling)
    print()
    print(report.render(points, ceiling, found))
    settings: dict[str, object] = {
        "duration_s": duration_s,
        "clients": list(clients),
        "sections": list(args.only),
        "app": args.app,
        "wall_s": round(time.monotonic() - started, 1),
    }
    if overhead is not None:
        print(
            f"\nASGI-level CPU per request: bare {overhead.bare_us:.1f} us, loopserve "
            f"{overhead.server_us:.1f} us (+{overhead.extra_us:.1f} us, mean batch "
            f"{overhead.mean_batch:.1f})"
        )
        settings["overhead_us"] = {"bare": overhead.bare_us, "server": overhead.server_us}
    if images:
        print()
        print(report.render_images(images))
        settings["images"] = [vars(p) for p in images]
    if tiles:
        print()
        print(report.render_tiles(tiles))
        settings["tiles"] = [vars(p) | {"tiles_per_s": p.tiles_per_s} for p in tiles]
    report.write_json(args.out, settings, points, ceiling, found)
    print(f"\nresults: {args.out} ({settings['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

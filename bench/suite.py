"""The load sections: which server runs with which settings, and which points hit it.

Each server process gets a 1 s warm-up per model (first sessions, allocator,
connection set-up) before its measured points. Points run one after another,
never overlapping, so the load generator and the server share two cores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.payload import request_body, v2_body
from bench.servers import ModelConfig, config_toml, model_path, serve
from bench.wrk import WrkResult, run_wrk

WARMUP_S = 1
WARMUP_CLIENTS = 16


@dataclass(frozen=True)
class Point:
    section: str  # bare | server | spin
    setup: str  # e.g. batched, unbatched, "spin=on threads=2"
    model: str
    clients: int
    req_per_s: float
    p50_ms: float
    p99_ms: float
    errors: int
    requests: int

    @classmethod
    def of(cls, result: WrkResult, section: str, setup: str, model: str, clients: int) -> Point:
        return cls(
            section=section,
            setup=setup,
            model=model,
            clients=clients,
            req_per_s=result.ok_per_s,
            p50_ms=result.p50_ms,
            p99_ms=result.p99_ms,
            errors=result.errors,
            requests=result.requests,
        )


def _load(
    base_url: str,
    section: str,
    setup: str,
    models: Sequence[str],
    clients: Sequence[int],
    duration_s: int,
) -> list[Point]:
    for model in models:
        run_wrk(f"{base_url}/predict/{model}", request_body(model), WARMUP_CLIENTS, WARMUP_S)
    points: list[Point] = []
    for model in models:
        body = request_body(model)
        for n in clients:
            result = run_wrk(f"{base_url}/predict/{model}", body, n, duration_s)
            point = Point.of(result, section, setup, model, n)
            print(
                f"  {section} {setup} {model} @{n}: {point.req_per_s:,.0f} req/s, "
                f"p50 {point.p50_ms:.2f} ms, p99 {point.p99_ms:.2f} ms, errors {point.errors}",
                flush=True,
            )
            points.append(point)
    return points


def run_bare(clients: Sequence[int], duration_s: int) -> list[Point]:
    """The HTTP ceiling, with the ``tiny`` body: the cheapest request the server sees."""
    with serve("bench.bare:app") as url:
        return _load(url, "bare", "bare", ["tiny"], clients, duration_s)


def run_server(app: str, model_dir: Path, clients: Sequence[int], duration_s: int) -> list[Point]:
    """``tiny`` and ``mlp`` batched (max_batch_size 64) and unbatched (1): one process each."""
    points: list[Point] = []
    for setup, max_batch_size in (("batched", 64), ("unbatched", 1)):
        models = [
            ModelConfig(name, model_path(model_dir, name), max_batch_size=max_batch_size)
            for name in ("tiny", "mlp")
        ]
        with serve(app, config_toml(models)) as url:
            points += _load(url, "server", setup, ["tiny", "mlp"], clients, duration_s)
    return points


SPIN_CLIENTS = 64
# (model, intra_op_threads): threads 2 only matters where one batch has work to split.
SPIN_CASES = (("tiny", 1), ("mlp", 1), ("mlp", 2))


def run_spin(app: str, model_dir: Path, duration_s: int) -> list[Point]:
    """Batched, 64 clients, spinning on and off: one process per point, nothing else loaded."""
    points: list[Point] = []
    for model, threads in SPIN_CASES:
        for spinning in (False, True):
            config = ModelConfig(
                model,
                model_path(model_dir, model),
                intra_op_threads=threads,
                intra_op_spinning=spinning,
            )
            setup = f"spin={'on' if spinning else 'off'} threads={threads}"
            with serve(app, config_toml([config])) as url:
                points += _load(url, "spin", setup, [model], [SPIN_CLIENTS], duration_s)
    return points


V2_CLIENTS = (1, 64)
V2_ROUNDS = 3  # the setups alternate, round after round; each point is the median


def run_v2(app: str, model_dir: Path, duration_s: int) -> list[Point]:
    """The same rows through ``/predict`` (JSON), V2 JSON and V2 binary, one batched server.

    The differences are a few percent of a request's cost, less than the drift of one
    server over a minute: so the three setups take turns, and each point is a median.
    """
    models = [ModelConfig(name, model_path(model_dir, name)) for name in ("tiny", "mlp")]
    points: list[Point] = []
    with serve(app, config_toml(models)) as url:
        for model in ("tiny", "mlp"):
            run_wrk(f"{url}/predict/{model}", request_body(model), WARMUP_CLIENTS, WARMUP_S)
            routes = {
                "predict-json": (f"{url}/predict/{model}", request_body(model), None),
                "v2-json": (f"{url}/v2/models/{model}/infer", *v2_body(model, binary=False)),
                "v2-binary": (f"{url}/v2/models/{model}/infer", *v2_body(model, binary=True)),
            }
            for n in V2_CLIENTS:
                runs: dict[str, list[Point]] = {setup: [] for setup in routes}
                for _ in range(V2_ROUNDS):
                    for setup, (target, body, headers) in routes.items():
                        result = run_wrk(target, body, n, duration_s, headers)
                        runs[setup].append(Point.of(result, "v2", setup, model, n))
                for setup, tries in runs.items():
                    point = sorted(tries, key=lambda p: p.req_per_s)[len(tries) // 2]
                    shown = ", ".join(f"{p.req_per_s:,.0f}" for p in tries)
                    print(
                        f"  v2 {setup} {model} @{n}: median {point.req_per_s:,.0f} req/s "
                        f"(rounds: {shown}), errors {sum(p.errors for p in tries)}",
                        flush=True,
                    )
                    points.append(point)
    return points

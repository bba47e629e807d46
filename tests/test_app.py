"""The HTTP app with a fake model: routes, error mapping, metrics, mounting, shutdown."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.routing import Mount

from pipeline.app import create_app, lifespan_of
from pipeline.settings import ModelSettings, ServerSettings
from tests.fakes import POISON, FakeClock, FakeRunner, fake_factory, post_scope

pytestmark = pytest.mark.anyio

Factory = Callable[[ModelSettings, int], FakeRunner]


def settings(**model: object) -> ServerSettings:
    options: dict[str, object] = {"name": "fake", "path": Path("unused.onnx")} | model
    return ServerSettings(models=(ModelSettings(**options),), drain_timeout_s=5)  # type: ignore[arg-type]


@asynccontextmanager
async def serve(app: Starlette, prefix: str = "") -> AsyncIterator[httpx.AsyncClient]:
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url=f"http://t{prefix}") as client:
            yield client


@asynccontextmanager
async def fake_app(
    gate: threading.Event | None = None, clock: FakeClock | None = None, **model: object
) -> AsyncIterator[tuple[httpx.AsyncClient, list[FakeRunner]]]:
    factory, made = fake_factory(gate, loop=asyncio.get_running_loop())
    app = create_app(settings(**model), runner_factory=factory, clock=clock)
    async with serve(app) as client:
        yield client, made


def body(*values: float) -> dict[str, object]:
    return {"inputs": {"x": list(values)}}


async def test_predict_returns_the_model_output_as_json() -> None:
    async with fake_app() as (client, _):
        response = await client.post("/predict/fake", json=body(1, 2, 3, 4))
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == {"outputs": {"y": [2.0, 4.0, 6.0, 8.0]}}


@pytest.mark.parametrize(
    ("content", "headers", "status", "message"),
    [
        (b"{not json", {"content-type": "application/json"}, 400, "not valid JSON"),
        (b'{"x": [1,2,3,4]}', {"content-type": "application/json"}, 422, '{"inputs"'),
        (b'{"inputs": {"x": [1,2,3]}}', {"content-type": "application/json"}, 422, "shape [4]"),
        (b'{"inputs": {"x": [[1,2,3,4]]}}', {"content-type": "application/json"}, 422, "shape"),
        (b'{"inputs": {"z": [1,2,3,4]}}', {"content-type": "application/json"}, 422, "unknown"),
        (b'{"inputs": {}}', {"content-type": "application/json"}, 422, "missing input"),
        (b'{"inputs": {"x": ["a","b","c","d"]}}', {}, 422, "float32"),
        (b'{"inputs": {"x": [1,[2],3,4]}}', {}, 422, "one shape"),
        (b'{"inputs": {"x": [1,2,3,4]}}', {"content-type": "text/plain"}, 415, "not accepted"),
    ],
)
async def test_bad_input_gets_a_clear_4xx_json_error(
    content: bytes, headers: dict[str, str], status: int, message: str
) -> None:
    async with fake_app() as (client, made):
        response = await client.post("/predict/fake", content=content, headers=headers)
        assert response.status_code == status
        assert message in response.json()["error"]
        ok = await client.post("/predict/fake", json=body(1, 1, 1, 1))
        assert ok.status_code == 200  # and the server keeps serving
    assert made[0].sizes == [1]  # bad input never reached the model


async def test_curl_default_form_content_type_is_read_as_json() -> None:
    async with fake_app() as (client, _):
        response = await client.post(
            "/predict/fake",
            content=b'{"inputs": {"x": [1,2,3,4]}}',
            headers={"content-type": "application/x-www-form-urlencoded"},
        )
    assert response.status_code == 200


async def test_unknown_model_and_unknown_route_are_404_json() -> None:
    async with fake_app() as (client, _):
        missing = await client.post("/predict/nope", json=body(1, 2, 3, 4))
        route = await client.get("/nope")
        method = await client.get("/predict/fake")
    assert missing.status_code == 404
    assert "GET /models" in missing.json()["error"]
    assert route.status_code == 404
    assert route.json() == {"error": "Not Found"}
    assert method.status_code == 405


async def test_a_body_over_the_limit_is_413_before_it_is_read() -> None:
    async with fake_app(max_body_bytes=64) as (client, _):
        response = await client.post("/predict/fake", json={"inputs": {"x": [1.0] * 100}})

        async def chunked() -> AsyncIterator[bytes]:
            for _ in range(10):
                yield b" " * 16  # no Content-Length: counted as it streams

        streamed = await client.post("/predict/fake", content=chunked())
    assert response.status_code == 413
    assert streamed.status_code == 413
    assert "64 bytes" in streamed.json()["error"]


async def test_a_failing_input_is_500_without_internals_and_spares_its_batch_mates() -> None:
    gate = threading.Event()
    async with fake_app(gate) as (client, made):
        blocker = asyncio.ensure_future(client.post("/predict/fake", json=body(0, 0, 0, 0)))
        await asyncio.wait_for(made[0].started.get(), 5)
        poisoned = asyncio.ensure_future(client.post("/predict/fake", json=body(POISON, 1, 1, 1)))
        healthy = asyncio.ensure_future(client.post("/predict/fake", json=body(3, 3, 3, 3)))
        for _ in range(50):  # let both reach the queue behind the running batch
            await asyncio.sleep(0)
        gate.set()
        results = await asyncio.gather(blocker, poisoned, healthy)
    assert made[0].sizes == [1, 2, 1, 1]  # tried together, then each half alone
    assert results[0].status_code == 200
    assert results[1].status_code == 500
    assert results[1].json() == {"error": "model fake failed on this input"}
    assert results[2].json() == {"outputs": {"y": [6.0, 6.0, 6.0, 6.0]}}


async def test_overload_is_503_with_retry_after_and_a_queued_deadline_is_504() -> None:
    gate = threading.Event()
    clock = FakeClock()
    async with fake_app(gate, clock, max_queue=2) as (client, made):
        running = asyncio.ensure_future(client.post("/predict/fake", json=body(1, 1, 1, 1)))
        await asyncio.wait_for(made[0].started.get(), 5)
        queued = [
            asyncio.ensure_future(client.post("/predict/fake?timeout_s=5", json=body(2, 2, 2, 2)))
            for _ in range(2)
        ]
        for _ in range(50):  # let both reach the queue
            await asyncio.sleep(0)
        refused = await client.post("/predict/fake", json=body(3, 3, 3, 3))
        assert refused.status_code == 503
        assert int(refused.headers["retry-after"]) >= 1
        clock.advance(5.0)  # the queued requests' deadline passes while the batch runs
        expired = await asyncio.gather(*queued)
        assert [r.status_code for r in expired] == [504, 504]
        assert "deadline" in expired[0].json()["error"]
        gate.set()
        assert (await running).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert 'loopserve_rejections_total{model="fake",reason="overload"} 1.0' in metrics
    assert 'loopserve_rejections_total{model="fake",reason="timeout"} 2.0' in metrics
    assert made[0].seen() == {1.0}  # expired items never cost compute


async def test_a_client_may_only_shorten_the_deadline() -> None:
    async with fake_app() as (client, _):
        bad = await client.post("/predict/fake?timeout_s=abc", json=body(1, 1, 1, 1))
        negative = await client.post("/predict/fake?timeout_s=-1", json=body(1, 1, 1, 1))
        longer = await client.post("/predict/fake?timeout_s=9999", json=body(1, 1, 1, 1))
    assert bad.status_code == 400
    assert negative.status_code == 400
    assert longer.status_code == 200


async def test_health_ready_models_and_metrics_describe_the_server() -> None:
    async with fake_app(max_batch_size=8) as (client, _):
        await client.post("/predict/fake", json=body(1, 2, 3, 4))
        await client.post(
            "/predict/fake", content=b"{", headers={"content-type": "application/json"}
        )
        health = await client.get("/health")
        ready = await client.get("/ready")
        models = (await client.get("/models")).json()["models"]
        metrics = await client.get("/metrics")
    assert health.json() == {"status": "ok"}
    assert ready.status_code == 200
    assert ready.json()["models"] == {
        "fake": {"providers": ["FakeProvider"], "instances": 1, "versions": [1]}
    }
    assert models[0]["name"] == "fake"
    assert models[0]["max_batch_size"] == 8
    assert models[0]["signature"]["inputs"] == [
        {"name": "x", "dtype": "float32", "shape": [None, 4]}
    ]
    text = metrics.text
    assert metrics.headers["content-type"].startswith("text/plain")
    for name in (
        'loopserve_batch_size_count{model="fake"} 1.0',
        'loopserve_queue_wait_seconds_count{model="fake"} 1.0',
        'loopserve_compute_seconds_count{model="fake"} 1.0',
        'loopserve_request_duration_seconds_count{model="fake"} 1.0',
        'loopserve_rejections_total{model="fake",reason="bad_input"} 1.0',
        'loopserve_queue_depth{model="fake"} 0.0',
        'loopserve_in_flight{model="fake"} 0.0',
    ):
        assert name in text


async def test_mounted_under_a_prefix_in_a_starlette_parent() -> None:
    factory, _ = fake_factory()
    inner = create_app(settings(), runner_factory=factory)
    parent = Starlette(routes=[Mount("/ml", app=inner)], lifespan=lifespan_of(inner))
    async with lifespan_of(parent)(None):
        transport = httpx.ASGITransport(app=parent)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            response = await client.post("/ml/predict/fake", json=body(1, 1, 1, 1))
            ready = await client.get("/ml/ready")
    assert response.json() == {"outputs": {"y": [2.0, 2.0, 2.0, 2.0]}}
    assert ready.status_code == 200


async def test_mounted_in_a_fastapi_app_with_its_own_lifespan() -> None:
    factory, made = fake_factory()
    inner = create_app(settings(), runner_factory=factory)
    events: list[str] = []

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        events.append("parent up")
        async with lifespan_of(inner)(app):  # loopserve's lifespan inside the parent's
            yield
        events.append("parent down")

    parent = FastAPI(lifespan=lifespan)

    @parent.get("/hello")
    async def hello() -> dict[str, str]:
        return {"hello": "world"}

    parent.mount("/ml", inner)
    async with parent.router.lifespan_context(parent):
        transport = httpx.ASGITransport(app=parent)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            assert (await client.get("/hello")).json() == {"hello": "world"}
            response = await client.post("/ml/predict/fake", json=body(2, 2, 2, 2))
    assert response.json() == {"outputs": {"y": [4.0, 4.0, 4.0, 4.0]}}
    assert events == ["parent up", "parent down"]
    assert made[0].batches  # the model really ran, and its runner was closed on the way out
    assert made[0].closed


async def test_shutdown_answers_every_admitted_request() -> None:
    gate = threading.Event()
    factory, made = fake_factory(gate, loop=asyncio.get_running_loop())
    app = create_app(
        ServerSettings(models=settings().models, drain_timeout_s=0), runner_factory=factory
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        async with lifespan_of(app)(None):
            pending = [
                asyncio.ensure_future(client.post("/predict/fake", json=body(v, v, v, v)))
                for v in (1, 2, 3)
            ]
            await asyncio.wait_for(made[0].started.get(), 5)
        answers = await asyncio.gather(*pending)
    assert [a.status_code for a in answers] == [503, 503, 503]
    assert "shut down" in answers[0].json()["error"]


async def test_a_model_with_a_fixed_batch_of_one_refuses_batching_at_start() -> None:
    class Fixed(FakeRunner):
        def __init__(self) -> None:
            super().__init__()
            x, y = self.signature.inputs[0], self.signature.outputs[0]
            fixed = type(x)(x.name, x.dtype, (1, 4))
            self.signature = type(self.signature)(inputs=(fixed,), outputs=(y,))

    app = create_app(settings(max_batch_size=4), runner_factory=lambda _s, _i: Fixed())
    with pytest.raises(ValueError, match="max_batch_size"):
        async with lifespan_of(app)(None):
            pass  # pragma: no cover


async def test_a_client_that_leaves_while_queued_never_costs_compute() -> None:
    gate = threading.Event()
    clock = FakeClock()
    async with fake_app(gate, clock) as (client, made):
        running = asyncio.ensure_future(client.post("/predict/fake", json=body(1, 1, 1, 1)))
        await asyncio.wait_for(made[0].started.get(), 5)
        app = client._transport.app  # type: ignore[attr-defined]
        left = asyncio.Event()
        request = b'{"inputs": {"x": [2, 2, 2, 2]}}'
        received: list[str] = []

        async def receive() -> dict[str, object]:
            if not received:
                received.append("body")
                return {"type": "http.request", "body": request, "more_body": False}
            await left.wait()
            return {"type": "http.disconnect"}

        sent: list[dict[str, object]] = []

        async def send(message: dict[str, object]) -> None:
            sent.append(message)

        scope = post_scope("/predict/fake", "application/json")
        call = asyncio.ensure_future(app(scope, receive, send))
        for _ in range(50):
            await asyncio.sleep(0)
        clock.advance(0.05)  # still waiting: its disconnect watch starts
        for _ in range(50):
            await asyncio.sleep(0)
        left.set()  # and the client goes away
        await asyncio.wait_for(call, 5)
        gate.set()
        assert (await running).status_code == 200
        metrics = (await client.get("/metrics")).text
    assert sent[0]["status"] == 499
    assert made[0].seen() == {1.0}  # the one that left was skipped
    assert 'loopserve_rejections_total{model="fake",reason="client_gone"} 1.0' in metrics

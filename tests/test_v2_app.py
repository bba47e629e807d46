"""The Open Inference Protocol routes against a fake model: admission, deadlines,
priorities and unloading, deterministically (fake clock, gated model)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest

from pipeline.app import create_app, lifespan_of
from pipeline.settings import ModelSettings, ServerSettings
from tests.fakes import FakeClock, FakeRunner, fake_factory

pytestmark = pytest.mark.anyio

INFER = "/v2/models/fake/infer"


def request(rows: list[list[float]], **parameters: object) -> dict[str, object]:
    body: dict[str, object] = {
        "inputs": [{"name": "x", "shape": [len(rows), 4], "datatype": "FP32", "data": rows}]
    }
    if parameters:
        body["parameters"] = parameters
    return body


@asynccontextmanager
async def served(
    gate: threading.Event | None = None, clock: FakeClock | None = None, **model: object
) -> AsyncIterator[tuple[httpx.AsyncClient, list[FakeRunner]]]:
    factory, made = fake_factory(gate, loop=asyncio.get_running_loop())
    options: dict[str, object] = {"name": "fake", "path": Path("unused.onnx")} | model
    settings = ServerSettings(models=(ModelSettings(**options),), drain_timeout_s=5)  # type: ignore[arg-type]
    app = create_app(settings, runner_factory=factory, clock=clock)
    async with lifespan_of(app)(None):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client, made
            if gate is not None:
                gate.set()


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


async def test_a_batch_is_split_into_items_and_joined_back_in_order() -> None:
    async with served(max_batch_size=2) as (client, made):
        rows = [[float(i)] * 4 for i in range(5)]
        response = await client.post(INFER, json=request(rows, custom="kept"), headers={})
    assert response.status_code == 200
    body = response.json()
    assert body["model_name"] == "fake"
    assert body["model_version"] == "1"
    assert body["outputs"][0]["shape"] == [5, 4]
    assert body["outputs"][0]["data"] == [2.0 * i for i in range(5) for _ in range(4)]
    assert max(made[0].sizes) <= 2  # the cap holds: five items ran in batches of two


async def test_a_batch_counts_that_many_items_against_the_backlog() -> None:
    gate = threading.Event()
    async with served(gate, max_queue=4) as (client, made):
        running = asyncio.ensure_future(client.post(INFER, json=request([[1.0] * 4])))
        await asyncio.wait_for(made[0].started.get(), 5)
        too_many = await client.post(INFER, json=request([[2.0] * 4] * 5))
        assert too_many.status_code == 503
        assert int(too_many.headers["retry-after"]) >= 1
        fits = asyncio.ensure_future(client.post(INFER, json=request([[3.0] * 4] * 4)))
        await settle()
        gate.set()
        assert (await running).status_code == 200
        assert (await fits).status_code == 200


async def test_the_timeout_parameter_in_microseconds_gives_504_while_queued() -> None:
    gate = threading.Event()
    clock = FakeClock()
    async with served(gate, clock) as (client, made):
        running = asyncio.ensure_future(client.post(INFER, json=request([[1.0] * 4])))
        await asyncio.wait_for(made[0].started.get(), 5)
        queued = asyncio.ensure_future(
            client.post(INFER, json=request([[2.0] * 4], timeout=2_000_000))
        )
        await settle()
        clock.advance(2.0)
        expired = await queued
        gate.set()
        await running
    assert expired.status_code == 504
    assert made[0].seen() == {1.0}


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("timeout", -1), ("timeout", 0.0), ("timeout", "soon"), ("timeout", True),
        ("priority", -1), ("priority", 1.5), ("priority", "1"), ("priority", True),
        ("priority", 3),
    ],
)  # fmt: skip
async def test_bad_timeout_and_priority_parameters_are_400(name: str, bad: object) -> None:
    async with served() as (client, _):
        response = await client.post(INFER, json=request([[1.0] * 4], **{name: bad}))
    assert response.status_code == 400
    assert name in response.json()["error"]


async def test_refused_requests_leave_no_arrival_behind() -> None:
    """A request counted as on its way must stop counting when it is refused, or the
    batcher would keep waiting for company that is not coming."""
    async with served() as (client, _):
        wrong = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP64", "data": [1] * 4}]}
        for body in (wrong, {"inputs": []}, request([[1.0] * 3 + [1.0]], priority=9)):
            assert (await client.post(INFER, json=body)).status_code == 400
        service = client._transport.app.state.service  # type: ignore[attr-defined]
        assert service.get("fake").batcher._arriving == 0


async def test_priority_1_enters_batches_before_the_default_level() -> None:
    gate = threading.Event()
    # Slots for all three: priority orders what waits in the queue (slots bound what may).
    async with served(gate, max_batch_size=1, slots=4) as (client, made):
        first = asyncio.ensure_future(client.post(INFER, json=request([[0.5] * 4])))
        await asyncio.wait_for(made[0].started.get(), 5)
        normal = asyncio.ensure_future(client.post(INFER, json=request([[1.0] * 4])))
        await settle()
        urgent = asyncio.ensure_future(client.post(INFER, json=request([[2.0] * 4], priority=1)))
        await settle()
        gate.set()
        await asyncio.gather(first, normal, urgent)
    assert [float(b[0][0]) for b in made[0].batches] == [0.5, 2.0, 1.0]


async def test_unloading_drains_a_request_in_flight_then_refuses() -> None:
    gate = threading.Event()
    async with served(gate) as (client, made):
        in_flight = asyncio.ensure_future(client.post(INFER, json=request([[1.0] * 4])))
        await asyncio.wait_for(made[0].started.get(), 5)
        unloading = asyncio.ensure_future(client.post("/v2/repository/models/fake/unload"))
        await settle()
        after = await client.post(INFER, json=request([[2.0] * 4]))
        gate.set()
        answered = await in_flight
        assert (await unloading).status_code == 200
        ready = await client.get("/v2/models/fake/ready")
    assert answered.status_code == 200  # admitted before the unload: answered, not dropped
    assert after.status_code == 404
    assert ready.status_code == 404


async def test_a_server_without_a_repository_says_so() -> None:
    async with served() as (client, _):
        index = await client.post("/v2/repository/index")
        load = await client.post("/v2/repository/models/fake/load")
    assert index.status_code == 400
    assert "repository" in index.json()["error"]
    assert load.status_code == 400

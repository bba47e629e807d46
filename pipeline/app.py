"""The HTTP face of loopserve: the only module that imports Starlette.

Endpoints are thin: read and bound the body, hand it to the model, serialise
the answer with orjson. One handler maps every ``LoopserveError`` to
``{"error": message}`` with its status; anything else is a bug, answered 500
without internals. ``create_app`` returns a plain Starlette app whose lifespan
owns every resource; ``lifespan_of`` lets a parent app that mounts it run it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import partial
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pipeline import v2
from pipeline.asgi import (
    Watches,
    body_headers,
    first_file,
    json_response,
    read_body,
    send_body,
    send_json,
    timeout_param,
)
from pipeline.batcher import Arrival
from pipeline.clock import Clock
from pipeline.errors import ClientGone, LoopserveError
from pipeline.model import RunnerFactory, ServedModel
from pipeline.runtime import OnnxRunner
from pipeline.service import Service
from pipeline.settings import ServerSettings, load_settings
from pipeline.tiled import TileOptions, detect, render_png

log = logging.getLogger(__name__)


def create_app(
    settings: ServerSettings | None = None,
    *,
    runner_factory: RunnerFactory = OnnxRunner,
    clock: Clock | None = None,
) -> Starlette:
    """The loopserve ASGI app; models load in its lifespan, once."""
    service = Service(settings or load_settings(), clock, runner_factory)
    endpoints = _Endpoints(service)
    watches = Watches(lambda: service.clock)

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        await service.start()
        try:
            yield
        finally:
            await service.stop()
            watches.close()

    app = Starlette(
        routes=[
            Route("/predict/{model}", _Predict(service, watches), methods=["POST"]),
            Route("/health", endpoints.health, methods=["GET"]),
            Route("/ready", endpoints.ready, methods=["GET"]),
            Route("/models", endpoints.models, methods=["GET"]),
            Route("/metrics", endpoints.metrics, methods=["GET"]),
            *v2.routes(service, watches),
        ],
        lifespan=lifespan,
        exception_handlers={
            LoopserveError: _loopserve_error,
            HTTPException: _http_error,
            Exception: _internal_error,
        },
    )
    app.state.service = service
    return app


def lifespan_of(app: Starlette) -> Callable[[Any], AbstractAsyncContextManager[None]]:
    """A lifespan for a parent app that mounts ``app``: Starlette does not run a
    mounted app's lifespan, so the parent runs it as (or inside) its own."""

    @asynccontextmanager
    async def lifespan(_parent: Any) -> AsyncIterator[None]:
        async with app.router.lifespan_context(app):
            yield

    return lifespan


class _Endpoints:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def health(self, _request: Request) -> Response:
        return json_response({"status": "ok"})

    async def ready(self, _request: Request) -> Response:
        service = self.service
        models = {
            name: {
                "providers": list(service.get(name).providers),
                "instances": service.get(name).settings.instances,
                "versions": sorted(versions),
            }
            for name, versions in service.served.items()
        }
        return json_response(
            {"ready": service.ready, "state": service.state, "models": models},
            status=200 if service.ready else 503,
        )

    async def models(self, _request: Request) -> Response:
        return json_response({"models": [m.describe() for m in self.service.all_models()]})

    async def metrics(self, _request: Request) -> Response:
        return Response(self.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _Predict:
    """``POST /predict/{model}``: a raw ASGI endpoint, the hot path. It skips Starlette's
    Request and Response objects (a measurable share of a near-free model's cost);
    errors it raises still reach the app's one error handler."""

    def __init__(self, service: Service, watches: Watches) -> None:
        self.service = service
        self.watches = watches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = self.service.get(scope["path_params"]["model"])
        arrival = model.arrival()
        with model.intake(arrival):
            length, content_type = body_headers(scope)
            deadline = model.deadline(timeout_param(scope))
            body = await read_body(receive, length, model.settings.max_body_bytes)
            if content_type == "multipart/form-data":
                content_type, body = await first_file(scope, body, model.settings.max_body_bytes)
        if model.tiled:
            # Hand the body over: a whole scene (1.2 GB at 20000x20000) must not stay
            # referenced here beside its decoded image while the tiles run.
            held = [body]
            del body
            await self._tiled(model, scope, receive, send, held, content_type, deadline, arrival)
            return
        watch = self.watches.watch(receive)
        try:
            await model.predict(
                body, content_type, deadline, arrival, watch, respond=partial(send_json, send)
            )
        finally:
            watch.close()

    async def _tiled(
        self,
        model: ServedModel,
        scope: Scope,
        receive: Receive,
        send: Send,
        held: list[bytes],
        content_type: str,
        deadline: float,
        arrival: Arrival,
    ) -> None:
        """A detector on an image of any size: tiles through the batcher, merged.
        ``held`` is the body, handed over: it is dropped once decoded."""
        try:
            try:
                options = TileOptions.from_query(QueryParams(scope["query_string"]))
                model.check_content_type(content_type)
                model.servable.parse(held[0], content_type)  # header checks before any decode
            finally:
                arrival.done()  # its tiles are sub-requests of their own
            watch = self.watches.watch(receive)
            work = asyncio.ensure_future(detect(model, held, options, deadline))
            watch.on_gone = work.cancel
            try:
                result = await work
            except asyncio.CancelledError:
                if watch.closed or not work.cancelled():
                    raise
                raise ClientGone(
                    "the client disconnected; its remaining tiles were cancelled"
                ) from None
            finally:
                watch.close()
                work.cancel()
        except LoopserveError as exc:
            model.metrics.reject(exc.reason)
            raise
        if options.render:
            await send_body(send, await asyncio.to_thread(render_png, result), b"image/png")
        else:
            await send_json(send, result.as_json())


async def _loopserve_error(_request: Request, exc: Exception) -> Response:
    if not isinstance(exc, LoopserveError):  # pragma: no cover - Starlette routes by type
        return await _internal_error(_request, exc)
    return json_response({"error": exc.message}, status=exc.status, headers=exc.headers())


async def _http_error(_request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    return json_response({"error": detail}, status=status)


async def _internal_error(_request: Request, exc: Exception) -> Response:
    log.error("unhandled error: %r; this is a bug", exc, exc_info=exc)
    return json_response({"error": "internal server error"}, status=500)

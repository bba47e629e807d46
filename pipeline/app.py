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
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.datastructures import Headers, QueryParams, UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from pipeline.clock import Clock, Timer
from pipeline.errors import BadRequest, ClientGone, LoopserveError, PayloadTooLarge
from pipeline.model import RunnerFactory
from pipeline.runtime import OnnxRunner
from pipeline.service import Service
from pipeline.settings import ServerSettings, load_settings

log = logging.getLogger(__name__)

JSON = "application/json"


def create_app(
    settings: ServerSettings | None = None,
    *,
    runner_factory: RunnerFactory = OnnxRunner,
    clock: Clock | None = None,
) -> Starlette:
    """The loopserve ASGI app; models load in its lifespan, once."""
    service = Service(settings or load_settings(), clock, runner_factory)
    endpoints = _Endpoints(service)
    watches = _Watches(service)

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


def _json(content: object, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, headers=headers, media_type=JSON)


class _Endpoints:
    def __init__(self, service: Service) -> None:
        self.service = service

    async def health(self, _request: Request) -> Response:
        return _json({"status": "ok"})

    async def ready(self, _request: Request) -> Response:
        service = self.service
        models = {
            name: {"providers": list(m.providers), "instances": m.settings.instances}
            for name, m in service.models.items()
        }
        return _json(
            {"ready": service.ready, "state": service.state, "models": models},
            status=200 if service.ready else 503,
        )

    async def models(self, _request: Request) -> Response:
        return _json({"models": [m.describe() for m in self.service.models.values()]})

    async def metrics(self, _request: Request) -> Response:
        return Response(self.service.metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _Predict:
    """``POST /predict/{model}``: a raw ASGI endpoint, the hot path. It skips Starlette's
    Request and Response objects (a measurable share of a near-free model's cost);
    errors it raises still reach the app's one error handler."""

    def __init__(self, service: Service, watches: _Watches) -> None:
        self.service = service
        self.watches = watches

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        model = self.service.get(scope["path_params"]["model"])
        arrival = model.arrival()
        try:
            length, content_type = _headers(scope)
            deadline = model.deadline(_timeout_param(scope))
            body = await _read_body(receive, length, model.settings.max_body_bytes)
            if content_type == "multipart/form-data":
                content_type, body = await _first_file(scope, body, model.settings.max_body_bytes)
        except LoopserveError as exc:
            arrival.done()
            model.metrics.reject(exc.reason)
            raise
        except BaseException:
            arrival.done()
            raise
        watch = self.watches.watch(receive)
        try:
            result = await model.predict(body, content_type, deadline, arrival, watch)
        finally:
            watch.close()
        payload = orjson.dumps(result, option=orjson.OPT_SERIALIZE_NUMPY)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})


def _headers(scope: Scope) -> tuple[str | None, str]:
    """Content-Length and the bare Content-Type (lower case, no parameters)."""
    length: str | None = None
    content_type = ""
    for key, value in scope["headers"]:
        if key == b"content-type":
            content_type = value.decode("latin-1").split(";", 1)[0].strip().lower()
        elif key == b"content-length":
            length = value.decode("latin-1")
    return length, content_type


def _timeout_param(scope: Scope) -> float | None:
    if not scope["query_string"]:
        return None  # the common case: no query string to parse
    raw = QueryParams(scope["query_string"]).get("timeout_s")
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(f"timeout_s must be a number of seconds, got {raw!r}") from None


def _content_type(header: str) -> str:
    return header.split(";", 1)[0].strip().lower()


async def _read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed ``limit``."""
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest(f"bad Content-Length header {declared!r}")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the body is {declared} bytes; this model takes at most {limit}")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected while sending the body")
        chunk: bytes = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body exceeds {limit} bytes, the most this model takes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _first_file(scope: Scope, body: bytes, limit: int) -> tuple[str, bytes]:
    """The first file of a multipart upload (``curl -F file=@photo.jpg``)."""

    async def stream() -> AsyncGenerator[bytes, None]:
        yield body

    headers = Headers(scope=scope)
    parser = MultiPartParser(headers, stream(), max_files=1, max_fields=16, max_part_size=limit)
    try:
        form = await parser.parse()
    except MultiPartException as exc:
        raise BadRequest(f"malformed multipart upload: {exc.message}") from None
    try:
        for value in form.values():
            if isinstance(value, UploadFile):
                data = await value.read()
                return _content_type(value.content_type or "application/octet-stream"), data
    finally:
        await form.close()
    raise BadRequest("the multipart upload has no file part; send the image as a file field")


class _Watch:
    """One request's disconnect watch: ``on_gone`` is called if its client leaves."""

    __slots__ = ("_receive", "_task", "closed", "on_gone", "start_at")

    def __init__(self, receive: Receive, start_at: float) -> None:
        self._receive = receive
        self.start_at = start_at
        self.closed = False
        self.on_gone: Callable[[], object] | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        if not self.closed and self.on_gone is not None:
            self.on_gone()

    def close(self) -> None:
        self.closed = True
        if self._task is not None:
            self._task.cancel()


class _Watches:
    """Starts a watcher task only for requests still waiting ``WATCH_AFTER_S`` after they
    were read: a task for every request cost 15% of a near-free model's req/s (`make
    bench`), and a request answered sooner has no compute left to save. The delay is
    constant, so watches start in arrival order: one deque and ONE timer serve them all."""

    WATCH_AFTER_S = 0.05

    def __init__(self, service: Service) -> None:
        self._service = service  # its clock exists once the lifespan has started
        self._pending: deque[_Watch] = deque()
        self._timer: Timer | None = None

    def watch(self, receive: Receive) -> _Watch:
        clock = self._service.clock
        watch = _Watch(receive, clock.now() + self.WATCH_AFTER_S)
        self._pending.append(watch)
        if self._timer is None:
            self._timer = clock.call_at(watch.start_at, self._start_due)
        return watch

    def _start_due(self) -> None:
        self._timer = None
        clock = self._service.clock
        now = clock.now()
        pending = self._pending
        while pending and pending[0].start_at <= now:
            watch = pending.popleft()
            if not watch.closed:
                watch.start()
        if pending:
            self._timer = clock.call_at(pending[0].start_at, self._start_due)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._pending.clear()


async def _loopserve_error(_request: Request, exc: Exception) -> Response:
    if not isinstance(exc, LoopserveError):  # pragma: no cover - Starlette routes by type
        return await _internal_error(_request, exc)
    return _json({"error": exc.message}, status=exc.status, headers=exc.headers())


async def _http_error(_request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "internal error"
    return _json({"error": detail}, status=status)


async def _internal_error(_request: Request, exc: Exception) -> Response:
    log.error("unhandled error: %r; this is a bug", exc, exc_info=exc)
    return _json({"error": "internal server error"}, status=500)

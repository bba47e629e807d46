"""Plain-ASGI plumbing shared by the HTTP endpoints: bounded body reads, header
scans, JSON replies and disconnect watches. Hot paths use these instead of
Starlette's Request and Response objects; errors raised here are ``LoopserveError``s
that reach the app's one error handler.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable

import orjson
from starlette.datastructures import Headers, QueryParams, UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pipeline.clock import Clock, Timer
from pipeline.errors import BadRequest, ClientGone, PayloadTooLarge


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def body_headers(scope: Scope) -> tuple[str | None, str]:
    """Content-Length and the bare Content-Type (lower case, no parameters)."""
    length: str | None = None
    content_type = ""
    for key, value in scope["headers"]:
        if key == b"content-type":
            content_type = content_type_of(value.decode("latin-1"))
        elif key == b"content-length":
            length = value.decode("latin-1")
    return length, content_type


def timeout_param(scope: Scope) -> float | None:
    if not scope["query_string"]:
        return None  # the common case: no query string to parse
    raw = QueryParams(scope["query_string"]).get("timeout_s")
    if raw is None:
        return None
    try:
        return float(raw)
    except ValueError:
        raise BadRequest(f"timeout_s must be a number of seconds, got {raw!r}") from None


def content_type_of(header: str) -> str:
    """The bare media type: lower case, without parameters such as charset."""
    return header.split(";", 1)[0].strip().lower()


async def read_body(receive: Receive, declared: str | None, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it is known to exceed ``limit``."""
    if declared is not None:
        if not declared.isdigit():
            raise BadRequest(f"bad Content-Length header {declared!r}")
        if int(declared) > limit:
            raise PayloadTooLarge(f"the body is {declared} bytes; this model takes at most {limit}")
    first: bytes | None = None
    rest = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone("the client disconnected while sending the body")
        chunk: bytes = message.get("body", b"")
        if first is None:
            first = chunk  # most bodies arrive whole: no copy at all
        else:
            if not rest:
                rest += first
            rest += chunk  # grows as chunks come: no joining pass over a huge body later
        if len(rest or first) > limit:
            raise PayloadTooLarge(f"the body exceeds {limit} bytes, the most this model takes")
        if not message.get("more_body", False):
            # A bytearray reads like bytes everywhere the servables look (orjson, BytesIO,
            # Pillow); copying a big one into bytes would hold the loop for a while.
            return rest if rest else first  # type: ignore[return-value]


async def send_body(
    send: Send, body: bytes, content_type: bytes, extra: Iterable[tuple[bytes, bytes]] = ()
) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", content_type),
                (b"content-length", str(len(body)).encode()),
                *extra,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def json_response(
    content: object, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    return Response(body, status_code=status, headers=headers, media_type="application/json")


async def send_json(send: Send, content: object) -> None:
    body = orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)
    await send_body(send, body, b"application/json")


async def first_file(scope: Scope, body: bytes, limit: int) -> tuple[str, bytes]:
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
                return content_type_of(value.content_type or "application/octet-stream"), data
    finally:
        await form.close()
    raise BadRequest("the multipart upload has no file part; send the image as a file field")


class Watch:
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


class Watches:
    """Starts a watcher task only for requests still waiting ``WATCH_AFTER_S`` after they
    were read: a task for every request cost 15% of a near-free model's req/s (`make
    bench`), and a request answered sooner has no compute left to save. The delay is
    constant, so watches start in arrival order: one deque and ONE timer serve them all."""

    WATCH_AFTER_S = 0.05

    def __init__(self, clock_of: Callable[[], Clock]) -> None:
        self._clock_of = clock_of  # the clock exists once the app's lifespan has started
        self._pending: deque[Watch] = deque()
        self._timer: Timer | None = None

    def watch(self, receive: Receive) -> Watch:
        clock = self._clock_of()
        watch = Watch(receive, clock.now() + self.WATCH_AFTER_S)
        self._pending.append(watch)
        if self._timer is None:
            self._timer = clock.call_at(watch.start_at, self._start_due)
        return watch

    def _start_due(self) -> None:
        self._timer = None
        clock = self._clock_of()
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

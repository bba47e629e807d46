"""Worker processes for GIL-bound preprocessing that write straight into shared-memory slots.

Each worker is a spawned process with its own servable and the model's arenas attached by
name. It takes one request at a time over its pipe, writes the item into the request's row
of each arena and answers in a few bytes: model inputs are never pickled. The loop hears
replies and exits through ``add_reader`` (pipe, process sentinel), never by polling; a
worker that dies fails only its own request and is replaced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import pickle
import signal
import traceback
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from typing import Any, Literal

import numpy as np

from pipeline import errors
from pipeline.errors import LoopserveError, ShuttingDown
from pipeline.servable import Servable, create_servable
from pipeline.settings import ModelSettings
from pipeline.signature import Signature
from pipeline.slots import ArenaLayout

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10.0  # close(): time for a worker to finish its request and exit
CANCEL_GRACE_S = 5.0  # a cancelled request's worker still busy after this is hung: kill it
_MAX_TEXT = 1000  # characters of a message or traceback in a reply, so replies stay small

Reply = tuple[str, ...]  # ("ready",) | ("ok",) | ("error", class, message) | ("failed", what, tb)


class WorkerDied(LoopserveError):
    """The worker process exited (killed, or a crash in native decoding code) mid-request."""

    status = 500
    reason = "model_error"


class _Worker:
    __slots__ = ("conn", "exited", "job", "pid", "process", "requests", "state")

    def __init__(
        self, process: SpawnProcess, conn: Connection[Any, Reply], requests: Connection[Any, Any]
    ) -> None:
        self.process = process
        self.conn = conn  # replies, read when the loop says it is readable
        # Requests go down a pipe of their own: the loop (uvloop) makes a file descriptor it
        # watches non-blocking, and a big body sent on one would fail half-way with EAGAIN.
        self.requests = requests
        self.pid = process.pid or 0
        self.state: Literal["starting", "idle", "busy", "dead"] = "starting"
        self.job: asyncio.Future[None] | None = None  # readiness, then the request in hand
        self.exited: asyncio.Future[None] = asyncio.get_running_loop().create_future()


class PreprocessPool:
    def __init__(
        self,
        settings: ModelSettings,
        signature: Signature,
        layout: Sequence[ArenaLayout],
        workers: int,
        cancel_grace_s: float = CANCEL_GRACE_S,
    ) -> None:
        if workers < 1:
            raise ValueError(f"preprocess_workers must be >= 1, got {workers}")
        private = [a.name for a in layout if a.shm_name is None]
        if private or not layout:
            raise ValueError(
                f"model {settings.name}: preprocess workers need every input arena in shared "
                f"memory (SlotPool(shared=True), fixed shapes); not shared: {private or 'all'}"
            )
        self.settings = settings
        self.signature = signature
        self.layout = tuple(layout)
        self.count = workers
        self.cancel_grace_s = cancel_grace_s
        self.restarts = 0
        self._slots = min(a.shape[0] for a in self.layout)
        self._context = multiprocessing.get_context("spawn")  # safe with threads and ORT
        # Sending a request can block while the worker reads a multi-MB body: one thread
        # per worker does it, so the loop never waits on a pipe.
        self._threads = ThreadPoolExecutor(
            workers, thread_name_prefix=f"preprocess-{settings.name}"
        )
        self._workers: set[_Worker] = set()  # every process not yet reaped
        self._idle: deque[_Worker] = deque()
        self._waiters: deque[asyncio.Future[_Worker]] = deque()
        self._tasks: set[asyncio.Task[None]] = set()  # replacements being started
        self._sending: set[asyncio.Future[None]] = set()
        self._broken: str | None = None  # why no worker can serve any more
        self._started = False
        self._closing: asyncio.Task[None] | None = None

    @property
    def workers_alive(self) -> int:
        return sum(1 for w in self._workers if w.state in ("idle", "busy"))

    def busy_pids(self) -> list[int]:
        return sorted(w.pid for w in self._workers if w.state == "busy")

    async def start(self) -> None:
        if self._started:
            raise RuntimeError(f"model {self.settings.name}: the preprocess pool was started")
        self._started = True
        spawned = await asyncio.gather(
            *(self._spawn() for _ in range(self.count)), return_exceptions=True
        )
        for worker in spawned:
            if isinstance(worker, _Worker):
                self._give(worker)
        failure = next((r for r in spawned if isinstance(r, BaseException)), None)
        if failure is not None:
            await self.close()
            raise failure

    async def preprocess(self, parsed: object, slot: int) -> None:
        """Run the servable's preprocess in a worker, which writes the item into ``slot``.

        Cancelled, it returns only once the worker has let go of the slot (answered, or
        killed after ``cancel_grace_s``), so the slot can be reused at once.
        """
        if not 0 <= slot < self._slots:
            raise LoopserveError(f"slot {slot} is not in [0, {self._slots}); this is a bug")
        worker = await self._take()
        loop = asyncio.get_running_loop()
        job: asyncio.Future[None] = loop.create_future()
        worker.state, worker.job = "busy", job
        sending = loop.run_in_executor(self._threads, _send, worker.requests, (parsed, slot))
        self._sending.add(sending)
        sending.add_done_callback(lambda f: self._sent(worker, job, f))
        try:
            await asyncio.shield(job)
        except asyncio.CancelledError:
            # The worker may be writing into the slot now, and our caller releases the slot
            # as soon as we return: wait until it is done, so no other request gets the row
            # while it is written.
            await self._settle(worker, job)
            raise

    async def close(self) -> None:
        """Stop the workers: each finishes the request in hand, then exits; idempotent."""
        if self._closing is None:
            self._closing = asyncio.create_task(self._close(), name=f"close-{self.settings.name}")
        await asyncio.shield(self._closing)

    async def wait_restarts(self) -> None:
        """Wait until the replacements of dead workers are ready (or failed to start)."""
        if self._tasks:
            await asyncio.wait(self._tasks)

    # -- the idle queue: FIFO, woken by a worker coming back, never by polling

    async def _take(self) -> _Worker:
        while True:
            if self._closing is not None:
                raise ShuttingDown(f"model {self.settings.name} is shutting down")
            if self._broken is not None:
                raise LoopserveError(self._broken)
            if not self._started:
                raise LoopserveError("the preprocess pool was not started; this is a bug")
            waiters = self._waiters
            while waiters and waiters[0].done():  # cancelled waiters at the front
                waiters.popleft()
            if self._idle and not waiters:
                worker = self._idle.popleft()
            else:
                waiter: asyncio.Future[_Worker] = asyncio.get_running_loop().create_future()
                waiters.append(waiter)
                try:
                    worker = await waiter
                except BaseException:
                    if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                        self._give(waiter.result())  # handed a worker as we were cancelled
                    raise
            if self._closing is not None:
                raise ShuttingDown(f"model {self.settings.name} is shutting down")
            if worker.state == "idle":
                return worker
            # It died after it was handed over: take the next one.

    def _give(self, worker: _Worker) -> None:
        if worker.state == "dead":
            return
        worker.state, worker.job = "idle", None
        if self._closing is not None:
            _stop(worker)
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(worker)
                return
        self._idle.append(worker)

    def _fail_waiters(self, make: type[LoopserveError], message: str) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(make(message))

    # -- one request

    def _sent(
        self, worker: _Worker, job: asyncio.Future[None], sending: asyncio.Future[None]
    ) -> None:
        self._sending.discard(sending)
        exc = sending.exception()
        if exc is None or worker.job is not job:
            return
        if isinstance(exc, _Unsendable):  # nothing reached the worker: it is still idle
            log.error("model %s: %s", self.settings.name, exc)
            _resolve(job, LoopserveError(f"{exc}; this is a bug"))
            self._give(worker)
        elif worker.state != "dead":
            # The pipe broke, so the worker is exiting; make sure, and its exit fails the job.
            worker.process.kill()

    async def _settle(self, worker: _Worker, job: asyncio.Future[None]) -> None:
        loop = asyncio.get_running_loop()
        hung = loop.call_later(self.cancel_grace_s, self._kill_hung, worker, job)
        try:
            while not job.done():
                # Bounded by the grace timer above, so outlasting another cancel is safe.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait((job,))
        finally:
            hung.cancel()
        if not job.cancelled():
            job.exception()  # the caller left: nobody reads the outcome

    def _kill_hung(self, worker: _Worker, job: asyncio.Future[None]) -> None:
        if worker.job is job and worker.state == "busy":
            log.warning(
                "model %s: preprocessing worker %d still busy %.1f s after its request was "
                "cancelled; killing it",
                self.settings.name,
                worker.pid,
                self.cancel_grace_s,
            )
            worker.process.kill()

    # -- processes

    async def _spawn(self) -> _Worker:
        parent, child = self._context.Pipe(duplex=False)  # replies: child -> parent
        child_requests, requests = self._context.Pipe(duplex=False)  # requests: parent -> child
        process = self._context.Process(
            target=_worker_main,
            args=(child_requests, child, self.settings, self.signature, self.layout),
            name=f"loopserve-preprocess-{self.settings.name}",
            daemon=True,  # terminated at interpreter exit should close() never run
        )
        try:
            # On the loop: about 1 ms (vfork + exec, a few KB written to a fresh pipe); the
            # slow part, the imports, happens in the child while we wait below.
            process.start()
        except BaseException:
            parent.close()
            requests.close()
            raise
        finally:
            child.close()  # the child holds its own copies; ours would hide its exit (no EOF)
            child_requests.close()
        worker = _Worker(process, parent, requests)
        ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        worker.job = ready
        self._workers.add(worker)
        loop = asyncio.get_running_loop()
        loop.add_reader(parent.fileno(), self._on_readable, worker)
        loop.add_reader(process.sentinel, self._on_exit, worker)
        try:
            await ready
        except BaseException:
            if worker.state != "dead":
                worker.process.kill()  # its exit is handled by _on_exit
            raise
        if worker.state == "dead":
            raise RuntimeError(
                f"model {self.settings.name}: a preprocessing worker exited as it became ready"
            )
        if self._closing is not None:
            self._give(worker)  # which stops it
            raise ShuttingDown(f"model {self.settings.name} is shutting down")
        return worker

    async def _replace(self) -> None:
        try:
            worker = await self._spawn()
        except ShuttingDown:
            return
        except Exception as exc:
            log.error(
                "model %s: a replacement preprocessing worker failed: %s", self.settings.name, exc
            )
            if not self.workers_alive and len(self._tasks) == 1:
                self._broken = (
                    f"model {self.settings.name} has no preprocessing worker left: "
                    f"a replacement failed to start ({exc})"
                )
                self._fail_waiters(LoopserveError, self._broken)
            return
        self._give(worker)

    def _on_readable(self, worker: _Worker) -> None:
        try:
            reply = worker.conn.recv()
        except (EOFError, OSError):
            # The worker closed its end: it is exiting, and its sentinel tells us next.
            asyncio.get_running_loop().remove_reader(worker.conn.fileno())
            return
        except Exception:
            log.exception(
                "model %s: unreadable reply from worker %d; this is a bug, killing it",
                self.settings.name,
                worker.pid,
            )
            asyncio.get_running_loop().remove_reader(worker.conn.fileno())
            worker.process.kill()
            return
        self._on_reply(worker, reply, worker.state)

    def _on_reply(self, worker: _Worker, reply: Reply, state: str) -> None:
        job, name = worker.job, self.settings.name
        if job is None:
            log.error(
                "model %s: unexpected reply %.100r from worker %d; this is a bug",
                name,
                reply,
                worker.pid,
            )
            return
        outcome: BaseException | None = None
        if reply[0] == "error":
            outcome = _error_class(reply[1])(reply[2])
        elif reply[0] == "failed":
            log.error(
                "model %s: preprocessing worker %d: %s\n%s", name, worker.pid, reply[1], reply[2]
            )
            if state == "starting":
                outcome = RuntimeError(
                    f"model {name}: a preprocessing worker failed to start: {reply[1]}"
                )
            else:
                what = reply[1].split(":", 1)[0]  # the exception's class: no internals
                outcome = LoopserveError(
                    f"model {name}: preprocessing failed in a worker ({what}); see the server log"
                )
        _resolve(job, outcome)
        worker.job = None
        if worker.state == "busy":
            self._give(worker)

    def _on_exit(self, worker: _Worker) -> None:
        loop, name = asyncio.get_running_loop(), self.settings.name
        loop.remove_reader(worker.process.sentinel)
        loop.remove_reader(worker.conn.fileno())
        was, worker.state = worker.state, "dead"
        with contextlib.suppress(EOFError, OSError):
            if worker.job is not None and worker.conn.poll():  # a reply sent just before exit
                self._on_reply(worker, worker.conn.recv(), was)
        worker.process.join()  # at once: the sentinel says it has exited
        code = worker.process.exitcode
        how = f"exit code {code}"
        if code is not None and code < 0:
            how += f", killed by {signal.Signals(-code).name}"
        if worker.job is not None:
            if was == "starting":
                error: BaseException = RuntimeError(
                    f"model {name}: a preprocessing worker exited during its start ({how})"
                )
            elif self._closing is not None:
                error = ShuttingDown(f"model {name} is shutting down")
            else:
                error = WorkerDied(
                    f"the preprocessing worker for model {name} died while handling this request "
                    f"({how}); the request was not processed"
                )
            _resolve(worker.job, error)
            worker.job = None
        worker.conn.close()
        worker.requests.close()
        worker.process.close()
        self._workers.discard(worker)
        with contextlib.suppress(ValueError):
            self._idle.remove(worker)
        _resolve(worker.exited, None)
        if was in ("idle", "busy") and self._closing is None:
            log.warning(
                "model %s: preprocessing worker %d exited (%s); starting another",
                name,
                worker.pid,
                how,
            )
            self.restarts += 1
            task = asyncio.create_task(self._replace(), name=f"replace-worker-{name}")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _close(self) -> None:
        self._fail_waiters(ShuttingDown, f"model {self.settings.name} is shutting down")
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for worker in list(self._workers):
            if worker.state == "idle":
                _stop(worker)
            elif worker.state == "starting":
                worker.process.kill()
            # busy: stopped by _give once it has answered its request
        exits = [w.exited for w in self._workers]
        if exits:
            _, late = await asyncio.wait(exits, timeout=STOP_TIMEOUT_S)
            for worker in list(self._workers):
                log.warning(
                    "model %s: preprocessing worker %d did not stop; killing it",
                    self.settings.name,
                    worker.pid,
                )
                worker.process.kill()
            if late:
                await asyncio.wait(late)  # SIGKILL: the sentinels follow at once
        if self._sending:  # each fails fast now that no worker reads its pipe
            await asyncio.wait(self._sending)
        self._threads.shutdown(wait=False)


def _resolve(future: asyncio.Future[None], outcome: BaseException | None) -> None:
    if future.done():
        return
    if outcome is None:
        future.set_result(None)
    else:
        future.set_exception(outcome)


def _stop(worker: _Worker) -> None:
    # A tiny write into an empty pipe (the worker has read its last request): no block.
    with contextlib.suppress(OSError):  # already gone: its sentinel says so
        worker.requests.send_bytes(pickle.dumps(None))


def _error_class(name: str) -> type[LoopserveError]:
    found = getattr(errors, name, None)
    if isinstance(found, type) and issubclass(found, LoopserveError):
        return found
    return LoopserveError


class _Unsendable(Exception):
    pass


def _send(conn: Connection[Any, Any], message: tuple[object, int]) -> None:
    """In a thread: pickle first, so a value that cannot be pickled leaves the pipe untouched."""
    try:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise _Unsendable(
            f"the parsed input ({type(message[0]).__name__}) cannot be sent to a worker: {exc}"
        ) from exc
    conn.send_bytes(data)


# -- in the worker process


def _worker_main(
    requests: Connection[Any, Any],
    conn: Connection[Reply, Any],
    settings: ModelSettings,
    signature: Signature,
    layout: Sequence[ArenaLayout],
) -> None:
    # The parent owns shutdown; Ctrl-C reaches the whole process group, and a worker that
    # died of it would fail its request instead of finishing it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    memories: list[shared_memory.SharedMemory] = []
    arenas: dict[str, np.ndarray] = {}
    try:
        try:
            servable = create_servable(settings, signature)
            for arena in layout:
                # Attaching registers the name with the resource tracker again, which is
                # harmless: a spawned child shares its parent's tracker, which keeps a set.
                # Unregistering here (the usual advice) would drop the parent's entry too:
                # the parent's unlink then makes the tracker print a KeyError.
                memory = shared_memory.SharedMemory(name=arena.shm_name)
                memories.append(memory)
                arenas[arena.name] = np.ndarray(arena.shape, np.dtype(arena.dtype), memory.buf)
        except Exception as exc:
            conn.send(_failed(exc))
            raise SystemExit(1) from None
        conn.send(("ready",))
        _serve(requests, conn, servable, arenas)
    finally:
        arenas.clear()  # the views go first, or closing the memory raises BufferError
        for memory in memories:
            memory.close()
        conn.close()
        requests.close()


def _serve(
    requests: Connection[Any, Any],
    conn: Connection[Reply, Any],
    servable: Servable[Any],
    arenas: dict[str, np.ndarray],
) -> None:
    while True:
        try:
            data = requests.recv_bytes()
        except EOFError:  # the parent is gone
            return
        reply = _handle(servable, arenas, data)
        del data  # a big body must not outlive its request
        if reply is None:  # asked to stop
            return
        try:
            conn.send(reply)
        except OSError:  # the parent is gone
            return


def _handle(servable: Servable[Any], arenas: dict[str, np.ndarray], data: bytes) -> Reply | None:
    try:
        message = pickle.loads(data)
        if message is None:
            return None
        parsed, slot = message
        _write(arenas, servable.preprocess(parsed), slot)
    except LoopserveError as exc:
        return ("error", _wire_name(exc), _clip(exc.message))
    except Exception as exc:
        return _failed(exc)
    return ("ok",)


def _failed(exc: Exception) -> Reply:
    """What went wrong, for the parent's log: never shown to a client."""
    return (
        "failed",
        _clip(f"{type(exc).__name__}: {exc}"),
        _clip(traceback.format_exc(), tail=True),
    )


def _write(arenas: dict[str, np.ndarray], items: object, slot: int) -> None:
    if not isinstance(items, dict) or set(items) != set(arenas):
        got = sorted(items) if isinstance(items, dict) else type(items).__name__
        raise LoopserveError(
            f"preprocess returned {got}, expected the inputs {sorted(arenas)}; this is a bug"
        )
    for name, value in items.items():
        row = arenas[name][slot]
        if (
            not isinstance(value, np.ndarray)
            or value.shape != row.shape
            or value.dtype != row.dtype
        ):
            what = (
                f"{value.dtype} {value.shape}"
                if isinstance(value, np.ndarray)
                else type(value).__name__
            )
            raise LoopserveError(
                f"preprocess returned {what} for input {name!r}, "
                f"expected {row.dtype} {row.shape}; this is a bug"
            )
    for name, value in items.items():
        arenas[name][slot] = value


def _wire_name(exc: LoopserveError) -> str:
    """The nearest class of ``pipeline.errors``, which the parent can map back by name."""
    for cls in type(exc).__mro__:
        name: str = cls.__name__
        if getattr(errors, name, None) is cls:
            return name
    return LoopserveError.__name__


def _clip(text: str, tail: bool = False) -> str:
    if len(text) <= _MAX_TEXT:
        return text
    return "..." + text[-_MAX_TEXT:] if tail else text[:_MAX_TEXT] + "..."

"""Every Prometheus metric, under the ``loopserve_`` prefix, in one registry per app.

Children are bound per model once, so the hot path does no label lookups.
Queue depth, backlog and in-flight counts are read from the batchers at scrape
time (a collector), so they are never stale and cost nothing per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
REASONS = ("overload", "timeout", "bad_input", "model_error", "shutdown", "client_gone", "error")


class QueueState(Protocol):
    @property
    def queued(self) -> int: ...

    @property
    def backlog(self) -> int: ...

    @property
    def outstanding(self) -> int: ...


class ModelMetrics:
    """The metrics of one model; also the batcher's observer."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self._batch = metrics.batch_size.labels(model)
        self._wait = metrics.queue_wait.labels(model)
        self._compute = metrics.compute.labels(model)
        self._latency = metrics.latency.labels(model)
        self._rejections = {r: metrics.rejections.labels(model, r) for r in REASONS}

    def observe_batch(self, size: int, compute_s: float) -> None:
        self._batch.observe(size)
        self._compute.observe(compute_s)

    def observe_queue_wait(self, wait_s: float) -> None:
        self._wait.observe(wait_s)

    def observe_latency(self, latency_s: float) -> None:
        self._latency.observe(latency_s)

    def reject(self, reason: str) -> None:
        self._rejections.get(reason, self._rejections["error"]).inc()


class Metrics:
    def __init__(self, queues: Callable[[], Iterable[tuple[str, QueueState]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.batch_size = Histogram(
            "loopserve_batch_size", "Items per executed batch", ["model"],
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_wait = Histogram(
            "loopserve_queue_wait_seconds", "Time from queue to batch dispatch", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.compute = Histogram(
            "loopserve_compute_seconds", "Forward pass time per batch", ["model"],
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.latency = Histogram(
            "loopserve_request_duration_seconds", "End-to-end time of answered requests",
            ["model"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "loopserve_rejections", "Requests refused or failed, by reason", ["model", "reason"],
            registry=r,
        )  # fmt: skip
        r.register(_QueueCollector(queues))

    def for_model(self, model: str) -> ModelMetrics:
        return ModelMetrics(self, model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _QueueCollector(Collector):
    def __init__(self, queues: Callable[[], Iterable[tuple[str, QueueState]]]) -> None:
        self._queues = queues

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "loopserve_queue_depth", "Items queued for a batch", labels=["model"]
        )
        backlog = GaugeMetricFamily(
            "loopserve_backlog", "Admitted items not yet in a batch", labels=["model"]
        )
        in_flight = GaugeMetricFamily(
            "loopserve_in_flight", "Admitted items not yet answered", labels=["model"]
        )
        for name, state in self._queues():
            depth.add_metric([name], state.queued)
            backlog.add_metric([name], state.backlog)
            in_flight.add_metric([name], state.outstanding)
        yield depth
        yield backlog
        yield in_flight

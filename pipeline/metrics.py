"""Every Prometheus metric, under the ``loopserve_`` prefix, in one registry per app.

The histograms are observed on the hot path, so they are plain bucket counters
updated on the event loop (a bisect, no lock: only the loop observes them, and
``/metrics`` reads them on the loop too) and exposed by a collector at scrape
time; prometheus-client's own Histogram costs several lock-guarded increments per
observation. Queue depth, backlog and in-flight counts are read from the batchers
at scrape time, so they are never stale and cost nothing per request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
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

    @property
    def slots(self) -> SlotState: ...


class SlotState(Protocol):
    @property
    def in_use(self) -> int: ...

    @property
    def waiting(self) -> int: ...


class LoopHistogram:
    """Bucket counts and a sum, observed only from the event loop."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # le: value <= bound
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        running = 0
        buckets: list[tuple[str, float]] = []
        labels = (*map(str, map(float, self.bounds)), "+Inf")
        for bound, count in zip(labels, self.counts, strict=True):
            running += count
            buckets.append((bound, running))
        return buckets


HISTOGRAMS = (
    ("batch_size", "loopserve_batch_size", "Items per executed batch", BATCH_BUCKETS),
    ("queue_wait", "loopserve_queue_wait_seconds", "Time from queue to batch dispatch",
     LATENCY_BUCKETS),
    ("compute", "loopserve_compute_seconds", "Forward pass time per batch", LATENCY_BUCKETS),
    ("latency", "loopserve_request_duration_seconds", "End-to-end time of answered requests",
     LATENCY_BUCKETS),
)  # fmt: skip


class ModelMetrics:
    """The metrics of one model; also the batcher's observer."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.histograms = {key: LoopHistogram(bounds) for key, _, _, bounds in HISTOGRAMS}
        self._batch = self.histograms["batch_size"].observe
        self._compute = self.histograms["compute"].observe
        self.observe_queue_wait = self.histograms["queue_wait"].observe
        self.observe_latency = self.histograms["latency"].observe
        self._rejections = {r: metrics.rejections.labels(model, r) for r in REASONS}

    def observe_batch(self, size: int, compute_s: float) -> None:
        self._batch(size)
        self._compute(compute_s)

    def reject(self, reason: str) -> None:
        self._rejections.get(reason, self._rejections["error"]).inc()


class Metrics:
    def __init__(self, queues: Callable[[], Iterable[tuple[str, Sequence[QueueState]]]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.rejections = Counter(
            "loopserve_rejections", "Requests refused or failed, by reason", ["model", "reason"],
            registry=self.registry,
        )  # fmt: skip
        self.models: dict[str, ModelMetrics] = {}
        self.registry.register(_QueueCollector(queues))
        self.registry.register(_HistogramCollector(self.models))

    def for_model(self, model: str) -> ModelMetrics:
        """The metrics of a model name, shared by all its versions."""
        metrics = self.models.get(model)
        if metrics is None:
            metrics = self.models[model] = ModelMetrics(self, model)
        return metrics

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HistogramCollector(Collector):
    def __init__(self, models: dict[str, ModelMetrics]) -> None:
        self._models = models

    def collect(self) -> Iterator[Metric]:
        for key, name, documentation, _ in HISTOGRAMS:
            family = HistogramMetricFamily(name, documentation, labels=["model"])
            for model, metrics in self._models.items():
                histogram = metrics.histograms[key]
                family.add_metric([model], histogram.cumulative(), histogram.total)
            yield family


class _QueueCollector(Collector):
    def __init__(self, queues: Callable[[], Iterable[tuple[str, Sequence[QueueState]]]]) -> None:
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
        slots = GaugeMetricFamily(
            "loopserve_slots_in_use", "Data slots held by requests", labels=["model"]
        )
        slot_waits = GaugeMetricFamily(
            "loopserve_slots_waiting", "Requests waiting for a data slot", labels=["model"]
        )
        for name, versions in self._queues():  # summed over a model's loaded versions
            depth.add_metric([name], sum(v.queued for v in versions))
            backlog.add_metric([name], sum(v.backlog for v in versions))
            in_flight.add_metric([name], sum(v.outstanding for v in versions))
            slots.add_metric([name], sum(v.slots.in_use for v in versions))
            slot_waits.add_metric([name], sum(v.slots.waiting for v in versions))
        yield from (depth, backlog, in_flight, slots, slot_waits)

"""The servable contract: how raw request bytes become model inputs and back.

A servable lives in ``models/<name>/__init__.py`` as a module with two functions,
``build(path)`` (write its ONNX file: deterministic, seeded, no download) and
``create(signature, settings)`` (return a ``Servable`` bound to the loaded model).
A module without ``create`` is served as raw tensors (see ``pipeline.tensors``).
Contract: ``parse`` runs on the loop and must be cheap (content type, size and
header checks; 4xx errors from ``pipeline.errors``); ``preprocess`` and
``postprocess`` run in a worker thread when ``offload`` is true. Every array that
``preprocess`` returns is one item, shaped like the model input without its batch
dimension; items whose shapes the model cannot take are refused in ``parse``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Protocol, TypeVar

import numpy as np

from pipeline.runtime import Arrays
from pipeline.settings import ModelSettings
from pipeline.signature import Signature

P = TypeVar("P")


class Servable(Protocol[P]):
    content_types: frozenset[str]  # accepted request content types (lower case, no params)
    offload: bool  # run preprocess/postprocess in a worker thread

    def parse(self, body: bytes, content_type: str) -> P: ...

    def preprocess(self, parsed: P) -> Arrays: ...

    def postprocess(self, outputs: Arrays) -> object: ...

    def describe(self) -> dict[str, object]: ...


class TiledServable(Protocol):
    """A detector for images of any size (see pipeline.tiled): the whole image is decoded
    once, each tile becomes a model input, each tile's outputs become boxes."""

    def decode(self, body: bytes) -> np.ndarray: ...

    def tile_input(self, tile: np.ndarray) -> Arrays: ...

    def detections(
        self, outputs: Mapping[str, np.ndarray], score_threshold: float
    ) -> list[tuple[float, float, float, float, float, str]]: ...


def is_tiled(servable: object) -> bool:
    return all(callable(getattr(servable, m, None)) for m in ("decode", "tile_input", "detections"))


def servable_module(name: str) -> ModuleType:
    """Import ``models.<name>``; a clear error when it is missing or incomplete."""
    try:
        module = importlib.import_module(f"models.{name}")
    except ModuleNotFoundError as exc:
        raise ValueError(f"servable {name!r}: no module models.{name} ({exc})") from None
    if not callable(getattr(module, "build", None)):
        raise ValueError(f"servable {name!r}: models.{name} has no build(path) function")
    return module


def create_servable(settings: ModelSettings, signature: Signature) -> Servable[Any]:
    from pipeline.tensors import RawTensors

    if settings.servable is not None:
        module = servable_module(settings.servable)
        create = getattr(module, "create", None)
        if create is not None:
            servable: Servable[Any] = create(signature, settings)
            return servable
    return RawTensors(signature, settings)

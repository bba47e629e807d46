"""Raw tensor serving: any ONNX file, JSON tensors in and out, no servable code.

Request body: ``{"inputs": {"<input name>": <nested list>}}``, one item per
request, each tensor shaped like the model input without its batch dimension.
Answer: ``{"outputs": {"<output name>": <nested list>}}``. Dtypes are checked,
never silently narrowed: a float where an integer is expected is a 422.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson

from pipeline.errors import BadRequest, Unprocessable
from pipeline.runtime import Arrays
from pipeline.settings import ModelSettings
from pipeline.signature import Signature, TensorSpec

JSON_TYPES = frozenset({"application/json", "application/x-www-form-urlencoded", ""})


class RawTensors:
    """The servable for models served without code: parse and check JSON tensors."""

    content_types = JSON_TYPES  # curl -d sends x-www-form-urlencoded; the body is JSON anyway
    offload = False  # parsing is the work, and it is done in parse()

    def __init__(self, signature: Signature, settings: ModelSettings) -> None:
        self.signature = signature
        self._name = settings.name
        self._names = {spec.name for spec in signature.inputs}

    def parse(self, body: bytes, content_type: str) -> Arrays:
        try:
            document = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise BadRequest(f"the body is not valid JSON: {exc}") from None
        if not isinstance(document, dict) or not isinstance(document.get("inputs"), dict):
            raise Unprocessable('expected a JSON object {"inputs": {"<input name>": [...]}}')
        given: dict[str, Any] = document["inputs"]
        unknown = set(given) - self._names
        if unknown:
            raise Unprocessable(
                f"unknown input {sorted(unknown)[0]!r}; model {self._name} takes "
                f"{sorted(self._names)}"
            )
        arrays: Arrays = {}
        for spec in self.signature.inputs:
            if spec.name not in given:
                raise Unprocessable(f"missing input {spec.name!r}")
            arrays[spec.name] = to_array(spec, given[spec.name])
        return arrays

    def preprocess(self, parsed: Arrays) -> Arrays:
        return parsed

    def postprocess(self, outputs: Arrays) -> object:
        return {"outputs": outputs}

    def describe(self) -> dict[str, object]:
        return {"kind": "raw-tensors", "input": 'JSON {"inputs": {name: nested list}}'}


def to_array(spec: TensorSpec, value: object) -> np.ndarray:
    """One item of ``spec`` from JSON: right kind of numbers, right shape, else 422."""
    kind = spec.dtype.kind
    try:
        loose = np.asarray(value)  # infer first: a cast would turn "1" into 1.0 silently
        got = loose.dtype.kind
        if loose.size and kind == "f" and got not in "fiu":
            raise Unprocessable(f"input {spec.name!r}: expected numbers ({spec.dtype.name})")
        if loose.size and kind in "iu" and got not in "iu":
            raise Unprocessable(
                f"input {spec.name!r}: expected integers ({spec.dtype.name}), "
                f"got {'floats' if got == 'f' else loose.dtype.name}"
            )
        if loose.size and kind == "b" and got != "b":
            raise Unprocessable(f"input {spec.name!r}: expected true/false values")
        if loose.size and kind in "iu":
            info = np.iinfo(spec.dtype.type)  # type: ignore[type-var]
            if loose.min() < info.min or loose.max() > info.max:
                raise Unprocessable(
                    f"input {spec.name!r}: values out of range for {spec.dtype.name}"
                )
        array = loose.astype(spec.dtype, copy=False)
    except (ValueError, TypeError, OverflowError):
        raise Unprocessable(
            f"input {spec.name!r}: expected a nested list of {spec.dtype.name} numbers "
            "with one shape"
        ) from None
    if array.shape != spec.item_shape and not _fits(array.shape, spec.item_shape):
        raise Unprocessable(
            f"input {spec.name!r}: expected shape {_show(spec.item_shape)} (one item, without "
            f"the batch dimension), got {list(array.shape)}"
        )
    return array


def _fits(shape: tuple[int, ...], expected: tuple[int | None, ...]) -> bool:
    return len(shape) == len(expected) and all(
        e is None or s == e for s, e in zip(shape, expected, strict=True)
    )


def _show(shape: tuple[int | None, ...]) -> str:
    return "[" + ", ".join("?" if d is None else str(d) for d in shape) + "]"

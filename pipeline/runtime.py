"""One model instance: an ONNX Runtime session and the single thread that runs it.

``run`` is the pure forward pass; it is only ever called on the instance's own
executor thread (ONNX Runtime drops the GIL inside ``session.run``). Providers
are what the session really got (``session.get_providers()``), never what was
asked for: onnxruntime-gpu lists CUDA as available even when its libraries are
missing, then silently runs on the CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

import numpy as np
import onnxruntime as ort

from pipeline.settings import ModelSettings
from pipeline.signature import Signature, spec_from_ort

log = logging.getLogger(__name__)

Arrays = dict[str, np.ndarray]


class Runner(Protocol):
    """A forward pass: stacked inputs in, stacked outputs out. Called from one thread."""

    signature: Signature
    providers: Sequence[str]

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays: ...

    def close(self) -> None: ...


class OnnxRunner:
    def __init__(self, settings: ModelSettings, index: int = 0) -> None:
        if not settings.path.is_file():
            raise FileNotFoundError(
                f"models.{settings.name}.path: no ONNX file at {settings.path} "
                "(demo models are built by `make models`)"
            )
        options = ort.SessionOptions()
        options.intra_op_num_threads = settings.intra_op_threads
        options.inter_op_num_threads = 1
        spin = "1" if settings.intra_op_spinning else "0"
        options.add_session_config_entry("session.intra_op.allow_spinning", spin)
        options.add_session_config_entry("session.inter_op.allow_spinning", spin)
        requested = resolve_providers(settings.providers)
        auto = "auto" in settings.providers
        if auto:
            # With "auto", a failed CUDA attempt is expected on CPU-only hosts and ONNX
            # Runtime reports it as an error; we log the outcome ourselves instead.
            ort.set_default_logger_severity(4)
        try:
            self._session = ort.InferenceSession(str(settings.path), options, providers=requested)
        finally:
            if auto:
                ort.set_default_logger_severity(2)  # ONNX Runtime's default: warnings
        self.providers: Sequence[str] = tuple(self._session.get_providers())
        self.signature = Signature(
            inputs=tuple(spec_from_ort(a) for a in self._session.get_inputs()),
            outputs=tuple(spec_from_ort(a) for a in self._session.get_outputs()),
        )
        self._output_names = [s.name for s in self.signature.outputs]
        log.info(
            "model %s instance %d: requested %s, running on %s",
            settings.name,
            index,
            list(requested),
            list(self.providers),
        )
        if "CUDAExecutionProvider" in requested and "CUDAExecutionProvider" not in self.providers:
            # Asked for by name, a fallback is worth a warning; under "auto" it is the plan.
            level = logging.INFO if auto else logging.WARNING
            log.log(level, "model %s: CUDA is not usable here; running on the CPU", settings.name)

    def run(self, inputs: Mapping[str, np.ndarray]) -> Arrays:
        values = self._session.run(self._output_names, dict(inputs))
        return dict(zip(self._output_names, values, strict=True))

    def close(self) -> None:
        """Sessions free their memory when dropped; nothing to release by hand."""


def resolve_providers(configured: Sequence[str]) -> list[str]:
    """``auto`` means CUDA when this build offers it (the session says if it got it), else CPU."""
    available = set(ort.get_available_providers())
    chosen: list[str] = []
    for name in configured:
        names = ["CUDAExecutionProvider", "CPUExecutionProvider"] if name == "auto" else [name]
        for provider in names:
            if provider in available and provider not in chosen:
                chosen.append(provider)
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


class Instance:
    """A runner and its dedicated single-thread executor; ``busy`` is owned by the loop."""

    def __init__(self, runner: Runner, name: str) -> None:
        self.runner = runner
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self.busy = False
        # Preallocated (max_batch_size, *item_shape) per input when item shapes are fixed:
        # a batch is assembled here, so the hot path allocates no input memory.
        self.buffers: dict[str, np.ndarray] = {}

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.runner.close()

"""The ONNX Runtime instance: real sessions on the demo models, providers as the session says."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from pipeline.runtime import OnnxRunner, resolve_providers
from pipeline.settings import ModelSettings
from tests.server_proc import ROOT

TINY = ModelSettings(name="tiny", path=ROOT / "repository" / "tiny" / "1" / "model.onnx")


def test_a_session_reports_its_real_providers_and_signature(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="pipeline.runtime"):
        runner = OnnxRunner(TINY)
    assert runner.providers[-1] == "CPUExecutionProvider"
    assert f"running on {list(runner.providers)}" in caplog.text
    x = runner.signature.inputs[0]
    assert (x.name, x.dtype, x.shape) == ("x", np.dtype(np.float32), (None, 64))
    assert runner.signature.batchable
    out = runner.run({"x": np.ones((3, 64), dtype=np.float32)})
    assert out["y"].shape == (3, 64)
    runner.close()


def test_spinning_and_threads_are_settings_and_cpu_only_works() -> None:
    settings = replace(
        TINY, providers=("CPUExecutionProvider",), intra_op_threads=2, intra_op_spinning=True
    )
    runner = OnnxRunner(settings)
    assert list(runner.providers) == ["CPUExecutionProvider"]
    assert runner.run({"x": np.zeros((1, 64), dtype=np.float32)})["y"].shape == (1, 64)


def test_a_missing_model_file_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"models.tiny.path: no ONNX file"):
        OnnxRunner(replace(TINY, path=tmp_path / "absent.onnx"))


def test_auto_puts_cuda_first_only_when_the_build_offers_it() -> None:
    chosen = resolve_providers(("auto",))
    assert chosen[-1] == "CPUExecutionProvider"
    assert resolve_providers(("CPUExecutionProvider",)) == ["CPUExecutionProvider"]


@pytest.mark.gpu
def test_cuda_really_runs_where_there_is_a_gpu() -> None:
    runner = OnnxRunner(replace(TINY, providers=("CUDAExecutionProvider",)))
    if "CUDAExecutionProvider" not in runner.providers:
        pytest.skip("no usable CUDA here: the session fell back to the CPU")
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    cpu = OnnxRunner(replace(TINY, providers=("CPUExecutionProvider",)))
    np.testing.assert_allclose(runner.run({"x": x})["y"], cpu.run({"x": x})["y"], rtol=1e-3)

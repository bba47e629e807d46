"""The demo models build deterministically, load in ONNX Runtime and run at any batch size."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from models import onnxbuild
from models.build import main


@dataclass(frozen=True)
class Expected:
    input_name: str
    input_shape: tuple[int | str, ...]
    output_name: str
    output_shape: tuple[int | str, ...]


EXPECTED = {
    "classifier": Expected("image", ("batch", 3, 224, 224), "logits", ("batch", 1000)),
    "mlp": Expected("x", ("batch", 256), "y", ("batch", 1000)),
    "tiny": Expected("x", ("batch", 64), "y", ("batch", 64)),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("models")
    paths = {}
    for name in EXPECTED:
        paths[name] = out / f"{name}.onnx"
        importlib.import_module(f"models.{name}").build(paths[name])
    return paths


def session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("name", EXPECTED)
def test_signature(built: dict[str, Path], name: str) -> None:
    expected = EXPECTED[name]
    sess = session(built[name])
    [given], [taken] = sess.get_inputs(), sess.get_outputs()
    assert (given.name, tuple(given.shape), given.type) == (
        expected.input_name,
        expected.input_shape,
        "tensor(float)",
    )
    assert (taken.name, tuple(taken.shape), taken.type) == (
        expected.output_name,
        expected.output_shape,
        "tensor(float)",
    )


@pytest.mark.parametrize("name", EXPECTED)
def test_pinned_versions(built: dict[str, Path], name: str) -> None:
    model = onnx.load(str(built[name]))
    assert model.ir_version == onnxbuild.IR_VERSION == 8
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]


@pytest.mark.parametrize("name", EXPECTED)
def test_runs_batched_with_independent_rows(built: dict[str, Path], name: str) -> None:
    expected = EXPECTED[name]
    sess = session(built[name])
    item_shape = tuple(int(d) for d in expected.input_shape[1:])
    batch = np.random.default_rng(7).standard_normal((4, *item_shape)).astype(np.float32)
    [out4] = sess.run(None, {expected.input_name: batch})
    assert out4.shape == (4, *expected.output_shape[1:])
    assert out4.dtype == np.float32
    assert np.isfinite(out4).all()
    assert np.abs(out4).max() < 1e3  # the seeded weights keep activations in range
    for i in range(4):
        [out1] = sess.run(None, {expected.input_name: batch[i : i + 1]})
        assert out1.shape == (1, *expected.output_shape[1:])
        assert np.isfinite(out1).all()
        np.testing.assert_allclose(out4[i], out1[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", EXPECTED)
def test_build_is_deterministic(built: dict[str, Path], name: str, tmp_path: Path) -> None:
    again = tmp_path / "again" / f"{name}.onnx"  # parent folders are created
    importlib.import_module(f"models.{name}").build(again)
    assert again.read_bytes() == built[name].read_bytes()


def test_save_replaces_atomically_without_leftovers(tmp_path: Path) -> None:
    path = tmp_path / "tiny.onnx"
    path.write_bytes(b"old")
    importlib.import_module("models.tiny").build(path)
    onnx.checker.check_model(onnx.load(str(path)))
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.onnx"]


def test_cli_builds_missing_and_skips_existing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--out", str(tmp_path), "tiny"]) == 0
    assert capsys.readouterr().out.startswith("built tiny")
    first = (tmp_path / "tiny.onnx").stat().st_mtime_ns
    assert main(["--out", str(tmp_path), "tiny"]) == 0
    assert capsys.readouterr().out.startswith("skipped tiny")
    assert main(["--out", str(tmp_path), "--force", "tiny"]) == 0
    assert capsys.readouterr().out.startswith("built tiny")
    assert (tmp_path / "tiny.onnx").stat().st_mtime_ns >= first


def test_cli_refuses_unknown_names_before_building(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path), "tiny", "nope"])
    assert exc.value.code == 2
    assert "models.nope" in capsys.readouterr().err
    assert not (tmp_path / "tiny.onnx").exists()

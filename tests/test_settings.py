"""Configuration: typed, validated at start, errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.errors import SettingsError
from pipeline.settings import DEMO_CONFIG, load_settings, settings_from_dict


def test_the_demo_set_serves_the_repository_relative_to_the_file() -> None:
    settings = load_settings(DEMO_CONFIG)
    assert settings.models == ()
    assert settings.repository == DEMO_CONFIG.parent / "repository"


def test_the_environment_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[models.m]\npath = "m.onnx"\nmax_batch_size = 4\ntimeout_s = 2\n')
    monkeypatch.setenv("LOOPSERVE_CONFIG", str(config))
    settings = load_settings()
    assert settings.models[0].path == tmp_path / "m.onnx"
    assert settings.models[0].timeout_s == 2.0  # an int where a float is expected is fine


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ({"models": {"m": {"path": "m.onnx", "max_batch_size": 0}}}, "models.m.max_batch_size"),
        ({"models": {"m": {"path": "m.onnx", "max_batch_sise": 4}}}, "models.m.max_batch_sise"),
        ({"models": {"m": {"path": "m.onnx", "timeout_s": "soon"}}}, "models.m.timeout_s"),
        ({"models": {"m": {"path": "m.onnx", "intra_op_spinning": 1}}}, "intra_op_spinning"),
        ({"models": {"m": {"path": "m.onnx", "instances": True}}}, "models.m.instances"),
        ({"models": {"m": {"path": "m.onnx", "providers": ["TPU"]}}}, "unknown provider 'TPU'"),
        ({"models": {"m": {"path": "m.onnx", "max_delay_ms": -1}}}, "models.m.max_delay_ms"),
        ({"models": {"m": {}}}, "models.m.path"),
        ({"models": {}}, "serves no model"),
        ({"server": {"repository": 3}}, "server.repository"),
        ({"server": {"drain_timeout_s": -1}, "models": {"m": {"path": "x"}}}, "drain_timeout_s"),
        ({"server": {"port": 1}, "models": {"m": {"path": "x"}}}, "server.port"),
        ({"modles": {}}, "modles"),
        ({"models": {"a b": {"path": "x"}}}, "models.a b"),
    ],
)
def test_bad_configuration_stops_the_start_naming_the_field(
    table: dict[str, object], message: str
) -> None:
    with pytest.raises(SettingsError, match=message.replace("[", r"\[")):
        settings_from_dict(table, base=Path("/"))


def test_a_missing_or_broken_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no such configuration file"):
        load_settings(tmp_path / "absent.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[models.m\n")
    with pytest.raises(SettingsError, match="not valid TOML"):
        load_settings(broken)

"""The model repository: layout, version policies, config errors, names that escape."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from pipeline.errors import BadRequest, NotFound, SettingsError
from pipeline.repository import (
    MODEL_FILE,
    model_dir,
    parse_version,
    read_model,
    scan,
    valid_model_name,
)
from pipeline.settings import ModelSettings


def add_model(repo: Path, name: str, config: str = "", versions: tuple[int, ...] = (1,)) -> Path:
    folder = repo / name
    folder.mkdir(parents=True)
    (folder / "config.toml").write_text(config)
    for version in versions:
        (folder / str(version)).mkdir()
        (folder / str(version) / MODEL_FILE).write_bytes(b"")
    return folder


def test_scan_finds_every_model_sorted_with_versions_ascending(tmp_path: Path) -> None:
    add_model(tmp_path, "resnet", versions=(3, 1, 10, 2))
    add_model(tmp_path, "mlp", versions=(1,))
    add_model(tmp_path, "bert-base_v2", versions=())
    (tmp_path / "README.md").write_text("not a model")
    models = scan(tmp_path)
    assert [m.name for m in models] == ["bert-base_v2", "mlp", "resnet"]
    assert [m.versions for m in models] == [(), (1,), (1, 2, 3, 10)]
    # the default policy serves the latest version; a model without versions serves none
    assert [m.selected for m in models] == [(), (1,), (10,)]


@pytest.mark.parametrize(
    ("policy", "selected"),
    [
        ("{ latest = 1 }", (7,)),
        ("{ latest = 2 }", (3, 7)),
        ("{ latest = 10 }", (1, 2, 3, 7)),
        ("{ specific = [3, 1] }", (1, 3)),
        ("{ specific = [2, 2] }", (2,)),
        ("{ all = true }", (1, 2, 3, 7)),
    ],
)
def test_version_policies(tmp_path: Path, policy: str, selected: tuple[int, ...]) -> None:
    add_model(tmp_path, "m", f"version_policy = {policy}\n", versions=(1, 2, 3, 7))
    model = read_model(tmp_path, "m")
    assert model.versions == (1, 2, 3, 7)
    assert model.selected == selected


def test_a_policy_on_a_model_without_versions_selects_nothing(tmp_path: Path) -> None:
    add_model(tmp_path, "m", "version_policy = { all = true }\n", versions=())
    assert read_model(tmp_path, "m").selected == ()


def test_specific_names_a_version_that_is_not_there(tmp_path: Path) -> None:
    add_model(tmp_path, "m", "version_policy = { specific = [1, 4, 5] }\n", versions=(1, 2))
    with pytest.raises(SettingsError, match=r"version_policy.specific: .*\[4, 5\]"):
        read_model(tmp_path, "m")


@pytest.mark.parametrize(
    "policy",
    [
        "{ latest = 0 }",
        "{ latest = true }",
        "{ latest = 1.5 }",
        "{ specific = [] }",
        '{ specific = ["1"] }',
        "{ specific = [0] }",
        "{ specific = 1 }",
        "{ all = false }",
        "{ latest = 1, all = true }",
        "{}",
        "{ newest = 1 }",
        '"latest"',
    ],
)
def test_bad_version_policies_name_the_file_and_field(tmp_path: Path, policy: str) -> None:
    folder = add_model(tmp_path, "m", f"version_policy = {policy}\n")
    with pytest.raises(SettingsError) as caught:
        read_model(tmp_path, "m")
    assert str(caught.value).startswith(f"{folder / 'config.toml'}: version_policy")


def test_an_empty_config_gives_the_defaults(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "m", versions=(1, 2))
    model = read_model(tmp_path, "m")
    assert model.settings(2) == ModelSettings(name="m", path=folder / "2" / MODEL_FILE, version=2)
    assert model.settings(1) == ModelSettings(name="m", path=folder / "1" / MODEL_FILE, version=1)


def test_settings_carry_the_config_and_the_version_path(tmp_path: Path) -> None:
    config = (
        'servable = "classifier"\n'
        "instances = 2\n"
        "max_batch_size = 8\n"
        "max_delay_ms = 2\n"
        "timeout_s = 5\n"
        'providers = ["CPUExecutionProvider"]\n'
        "intra_op_spinning = true\n"
        'labels = "labels.txt"\n'
        "version_policy = { all = true }\n"
    )
    folder = add_model(tmp_path, "cls", config, versions=(4, 9))
    settings = read_model(tmp_path, "cls").settings(9)
    assert settings == ModelSettings(
        name="cls",
        path=folder / "9" / MODEL_FILE,
        version=9,
        servable="classifier",
        instances=2,
        max_batch_size=8,
        max_delay_ms=2.0,
        timeout_s=5.0,
        providers=("CPUExecutionProvider",),
        intra_op_spinning=True,
        labels=folder / "labels.txt",  # relative to the model folder
    )


def test_settings_of_a_version_that_is_not_there(tmp_path: Path) -> None:
    add_model(tmp_path, "m", versions=(1,))
    with pytest.raises(NotFound, match="no version 2"):
        read_model(tmp_path, "m").settings(2)


def test_a_config_error_names_the_file_and_the_field(tmp_path: Path) -> None:
    add_model(tmp_path, "mlp", "max_batch_size = 0\n")
    with pytest.raises(SettingsError) as caught:
        scan(tmp_path)
    assert str(caught.value) == f"{tmp_path}/mlp/config.toml: max_batch_size: must be >= 1, got 0"


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ('max_delay_ms = "soon"\n', "max_delay_ms"),
        ("instances = true\n", "instances"),
        ("intra_op_spinning = 1\n", "intra_op_spinning"),
        ('providers = ["TPU"]\n', "providers"),
        ('providers = "CPUExecutionProvider"\n', "providers"),
        ("timeout_s = 0\n", "timeout_s"),
        ("labels = 3\n", "labels"),
        ("max_batch_sise = 4\n", "max_batch_sise: unknown setting"),
        ('path = "other.onnx"\n', "path: set by the repository layout"),
        ("version = 2\n", "version: set by the repository layout"),
        ('name = "other"\n', "name: set by the repository layout"),
        ("max_batch_size = \n", "not valid TOML"),
    ],
)
def test_bad_config_keys_and_values(tmp_path: Path, config: str, field: str) -> None:
    folder = add_model(tmp_path, "m", config)
    with pytest.raises(SettingsError) as caught:
        read_model(tmp_path, "m")
    assert str(caught.value).startswith(f"{folder / 'config.toml'}: {field}")


def test_a_config_that_is_not_utf8(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "m")
    (folder / "config.toml").write_bytes(b"\xff\xfe")
    with pytest.raises(SettingsError, match="cannot read"):
        read_model(tmp_path, "m")


def test_only_integer_folders_holding_the_model_file_are_versions(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "m", versions=(1, 3))
    (folder / "2").mkdir()  # no model.onnx: ignored
    (folder / "4").mkdir()
    (folder / "4" / "weights.onnx").write_bytes(b"")
    for name in ("0", "01", "-1", "1a", "latest", "5" * 19):
        (folder / name).mkdir()
        (folder / name / MODEL_FILE).write_bytes(b"")
    (folder / "6").write_text("a file, not a folder")
    assert read_model(tmp_path, "m").versions == (1, 3)


@pytest.mark.parametrize("name", ["m", "M2", "0", "a-b_c", "a" * 128])
def test_valid_model_names(name: str) -> None:
    assert valid_model_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "..",
        ".",
        "../x",
        "a/b",
        "a\\b",
        ".hidden",
        "-a",
        "_a",
        "a.b",
        "a b",
        "a\n",
        "é",
        "a" * 129,
    ],
)
def test_names_that_could_escape_are_refused(tmp_path: Path, name: str) -> None:
    assert not valid_model_name(name)
    with pytest.raises(BadRequest):
        model_dir(tmp_path, name)
    with pytest.raises(BadRequest):
        read_model(tmp_path, name)


def test_a_200_character_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BadRequest, match="at most 128"):
        model_dir(tmp_path, "a" * 200)


def test_model_dir_finds_a_model_folder(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "m")
    assert model_dir(tmp_path, "m") == folder


def test_absent_models_are_not_found(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    (tmp_path / "noconfig").mkdir()
    for name in ("absent", "file"):
        with pytest.raises(NotFound):
            model_dir(tmp_path, name)
    for name in ("absent", "file", "noconfig"):
        with pytest.raises(NotFound):
            read_model(tmp_path, name)


def test_a_model_folder_linked_outside_the_repo_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    outside = add_model(tmp_path, "outside")
    os.symlink(outside, repo / "leak")
    with pytest.raises(NotFound):
        model_dir(repo, "leak")
    with pytest.raises(NotFound):
        read_model(repo, "leak")
    assert scan(repo) == []
    assert "resolves outside the repository" in caplog.text


def test_a_model_folder_linked_inside_the_repo_is_served(tmp_path: Path) -> None:
    add_model(tmp_path, "real")
    os.symlink(tmp_path / "real", tmp_path / "alias")
    assert [m.name for m in scan(tmp_path)] == ["alias", "real"]
    assert read_model(tmp_path, "alias").settings(1).path == tmp_path / "alias/1" / MODEL_FILE


def test_a_version_linked_outside_the_repo_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    folder = add_model(repo, "m", versions=())
    outside = tmp_path / "v1"
    outside.mkdir()
    (outside / MODEL_FILE).write_bytes(b"")
    os.symlink(outside, folder / "1")
    with pytest.raises(SettingsError, match="resolves outside the repository"):
        read_model(repo, "m")


def test_a_config_linked_outside_the_repo_is_refused(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    folder = add_model(repo, "m")
    (folder / "config.toml").unlink()
    (tmp_path / "config.toml").write_text("")
    os.symlink(tmp_path / "config.toml", folder / "config.toml")
    with pytest.raises(SettingsError, match="resolves outside the repository"):
        read_model(repo, "m")


def test_scan_skips_folders_that_are_not_models(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    add_model(tmp_path, "m")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "bad.name").mkdir()
    (tmp_path / "noconfig").mkdir()
    with caplog.at_level(logging.WARNING, logger="pipeline.repository"):
        assert [m.name for m in scan(tmp_path)] == ["m"]
    assert ".hidden: not a valid model name" in caplog.text
    assert "bad.name: not a valid model name" in caplog.text
    assert "noconfig: no config.toml" in caplog.text


def test_a_missing_repository_is_a_settings_error(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        scan(tmp_path / "nowhere")
    with pytest.raises(SettingsError, match="does not exist"):
        read_model(tmp_path / "nowhere", "m")


def test_read_model_rereads_the_disk(tmp_path: Path) -> None:
    folder = add_model(tmp_path, "m", versions=(1,))
    assert read_model(tmp_path, "m").selected == (1,)
    (folder / "2").mkdir()
    (folder / "2" / MODEL_FILE).write_bytes(b"")
    (folder / "config.toml").write_text("max_batch_size = 4\n")
    model = read_model(tmp_path, "m")
    assert model.selected == (2,)
    assert model.settings(2).max_batch_size == 4
    (folder / "config.toml").write_text("max_batch_size = -4\n")
    with pytest.raises(SettingsError, match="max_batch_size"):
        read_model(tmp_path, "m")


@pytest.mark.parametrize(
    ("text", "version"), [("1", 1), ("3", 3), ("10", 10), ("9" * 18, 10**18 - 1)]
)
def test_parse_version_accepts_positive_integers(text: str, version: int) -> None:
    assert parse_version(text) == version


@pytest.mark.parametrize(
    "text", ["", "0", "-1", "+1", "01", "1a", "1.0", " 1", "1\n", "../1", "1/2", "\u0661", "9" * 19]
)
def test_parse_version_refuses_anything_else(text: str) -> None:
    with pytest.raises(BadRequest, match="positive integer"):
        parse_version(text)

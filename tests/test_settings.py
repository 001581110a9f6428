"""Settings resolve argument → environment → default; bad env warns, bad explicit raises."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvscope import settings
from kvscope.errors import SettingError

ROOT = Path(__file__).resolve().parent.parent


def test_default_when_nothing_given() -> None:
    assert settings.resolve("decoder_kv_blocks_ttl", environ={}) == 480.0
    assert settings.resolve("kv_recompute_threshold", environ={}) == 64
    assert settings.resolve("router_ttl", environ={}) == 450.0


def test_environment_beats_default_and_explicit_beats_environment() -> None:
    env = {"KVSCOPE_PORT": "5000"}
    assert settings.resolve("port", environ=env) == 5000
    assert settings.resolve("port", 6000, environ=env) == 6000
    assert settings.resolve("port", "7000", environ=env) == 7000


def test_bad_environment_value_warns_and_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kvscope.settings"):
        assert settings.resolve("port", environ={"KVSCOPE_PORT": "eighty"}) == 4318
    assert "KVSCOPE_PORT" in caplog.text and "eighty" in caplog.text


@pytest.mark.parametrize(
    ("name", "value", "fragment"),
    [
        ("port", 70000, "--port"),
        ("port", "x", "--port"),
        ("kv_recompute_threshold", -1, "must be >= 0"),
        ("decoder_kv_blocks_ttl", 0, "must be > 0"),
        ("otlp_endpoint", "localhost:4318", "http://"),
        ("log_level", "LOUD", "must be one of"),
        ("port", True, "expected int"),
    ],
)
def test_bad_explicit_value_raises_naming_the_option(name: str, value: object,
                                                     fragment: str) -> None:
    with pytest.raises(SettingError) as excinfo:
        settings.resolve(name, value, environ={})
    assert fragment in str(excinfo.value)
    assert settings.SETTINGS[name].cli_flag in str(excinfo.value)


def test_unknown_setting_names_are_refused() -> None:
    with pytest.raises(SettingError, match="unknown setting"):
        settings.resolve_all({"ttl": 3})


def test_vllm_names_are_kept() -> None:
    assert settings.SETTINGS["decoder_kv_blocks_ttl"].vllm_name == "decoder_kv_blocks_ttl"
    assert settings.SETTINGS["kv_recompute_threshold"].vllm_name == "kv_recompute_threshold"


def test_docs_table_is_current() -> None:
    doc = (ROOT / "docs" / "settings.md").read_text()
    from kvscope.cli import setting_commands

    assert doc == settings.markdown_table(setting_commands()), (
        "regenerate: kvscope settings --markdown > docs/settings.md"
    )

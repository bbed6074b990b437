"""Tier a: docs/configuration.md's key table is the config model's, so the page cannot drift from the code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from ds_terapipe import config
from ds_terapipe.config_doc import BEGIN, END, PAGE, config_fields, main, render_configuration_page

MODELS = [m for m in vars(config).values()
          if isinstance(m, type) and issubclass(m, DeepSpeedConfigModel) and m.__module__ == config.__name__]


def test_the_page_on_disk_is_the_generated_page() -> None:
    assert PAGE.read_text(encoding="utf-8") == render_configuration_page(), (
        "docs/configuration.md differs from the config model's descriptions: run "
        "python -m ds_terapipe.config_doc --write (and edit a key's meaning in ds_terapipe/config.py, not in the page)")


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_has_a_description(model: type[DeepSpeedConfigModel]) -> None:
    missing = [name for name, field in model.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"{model.__name__}: give {missing} a Field(description=...)"


def test_every_model_and_key_is_in_the_table_once() -> None:
    assert {"TeraPipeConfig", "ProfileConfig", "ReplanConfig", "FreezeConfig", "AutoFreezeConfig"} <= {
        m.__name__ for m in MODELS}
    text = PAGE.read_text(encoding="utf-8")
    table = text.split(BEGIN + "\n", 1)[1].split(END, 1)[0]
    keys = [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", table, re.MULTILINE)]
    expected = [key for key, _ in config_fields()]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    assert not twice, f"keys in more than one row: {twice}"
    assert keys == expected
    assert {"enabled", "profile.slice_lengths", "freeze.auto", "freeze.auto.tolerance"} <= set(keys)


def test_check_fails_on_a_stale_page_and_write_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page = tmp_path / "configuration.md"
    page.write_text(PAGE.read_text(encoding="utf-8").replace("| `enabled` | `false` |", "| `enabled` | `true` |"))
    assert main(["--check"], page=page) == 1
    assert "config_doc --write" in capsys.readouterr().err
    assert main(["--write"], page=page) == 0 and main(["--check"], page=page) == 0
    assert "| `enabled` | `false` |" in page.read_text(encoding="utf-8")

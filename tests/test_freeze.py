"""Progressive freezing (runtime/freeze.py): its config, the schedule without frozen chunks' backward, the frozen
cost model, the automatic rule; then, on 2 gloo ranks (one launch), training with frozen layers against the
unsliced reference with the same layers frozen at the same steps, and the refusals."""

from __future__ import annotations

import pytest

from ds_terapipe.config import parse_terapipe_config


def _parse(freeze: object) -> object:
    return parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "freeze": freeze}}).freeze


# -- config -----------------------------------------------------------------------------------------------------
def test_freeze_config_schedule_and_auto() -> None:
    cfg = _parse({"schedule": [[0, 1], [10, 3], [20, 3]]})
    assert cfg.schedule == [[0, 1], [10, 3], [20, 3]] and cfg.auto is None and cfg.replan
    auto = _parse({"auto": {"check_interval": 5, "aggressiveness": 1.0}}).auto
    assert auto.check_interval == 5 and auto.tolerance == 0.1 and auto.aggressiveness == 1.0
    assert parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64}}).freeze is None


@pytest.mark.parametrize("freeze, match", [
    ({"schedule": [[5, 1], [2, 3]]}, "not monotone: \\[5, 1\\] then \\[2, 3\\]"),
    ({"schedule": [[1, 3], [2, 1]]}, "never unfreezes"),
    ({"schedule": [[1, 3], [1, 4]]}, "not monotone"),
    ({"schedule": [[1, -1]]}, ">= 0"),
    ({"schedule": [[1]]}, "pairs of ints"),
    ({"schedule": []}, "non-empty"),
    ({}, "exactly one policy"),
    ({"schedule": [[1, 2]], "auto": {}}, "not both"),
    ({"auto": {"aggressiveness": 0}}, "aggressiveness=0 must be > 0"),
    ({"auto": {"aggressiveness": 1.5}}, "aggressiveness=1.5 must be <= 1"),
    ({"auto": {"agressiveness": 0.5}}, "freeze.auto: unknown key\\(s\\) \\['agressiveness'\\]; valid keys are"),
    ({"shedule": [[1, 2]]}, "terapipe.freeze: unknown key\\(s\\) \\['shedule'\\]"),
])
def test_freeze_config_refusals(freeze: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _parse(freeze)

"""The "terapipe" config section: defaults, validation messages that name key, value and fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_terapipe.config import TeraPipeConfig, parse_terapipe_config


def parse(**section):
    return parse_terapipe_config({"train_batch_size": 1, "terapipe": section})


def test_absent_section_is_disabled() -> None:
    assert parse_terapipe_config({"train_batch_size": 1}).enabled is False


def test_defaults_and_list_implies_seq_len() -> None:
    cfg = parse(enabled=True, slices=[8, 24, 16])
    assert cfg.seq_len == 48 and cfg.schedule == "gpipe" and cfg.granularity == 8
    assert parse(enabled=True, seq_len=64).slices == "auto"


@pytest.mark.parametrize("seq_len,granularity,n,expected", [
    (64, 8, 3, [24, 24, 16]), (48, 2, 8, [6] * 8), (64, 8, 8, [8] * 8), (40, 8, 2, [24, 16])])
def test_equal_slices(seq_len: int, granularity: int, n: int, expected: list[int]) -> None:
    cfg = parse(enabled=True, seq_len=seq_len, granularity=granularity, slices=n)
    assert cfg.equal_slices() == expected and sum(expected) == seq_len


@pytest.mark.parametrize("section,needle", [
    ({"slicse": 2}, "unknown key(s) ['slicse']; valid keys are"),
    ({"profile": {"repeat": 2}}, "terapipe.profile: unknown key(s) ['repeat']"),
    ({"enabled": True, "seq_len": 8, "slices": "x"}, "terapipe.slices='x'"),
    ({"enabled": True, "seq_len": 8, "slices": 0}, "terapipe.slices=0 must be >= 1"),
    ({"enabled": True, "seq_len": 8, "slices": True}, "terapipe.slices=True"),
    ({"enabled": True}, "terapipe.seq_len is required"),
    ({"enabled": True, "seq_len": 10}, "granularity=8 does not divide terapipe.seq_len=10"),
    ({"slices": [4, 4], "seq_len": 9}, "sum to 8 but terapipe.seq_len=9"),
    ({"slices": [4, 0]}, "every count >= 1"),
    ({"schedule": "zb"}, "terapipe.schedule='zb'"),
    ({"granularity": 0}, "terapipe.granularity=0 must be >= 1"),
    ({"p2p_timeout_s": 0}, "terapipe.p2p_timeout_s=0"),
    ({"p2p_timeout_s": 1e30}, "terapipe.p2p_timeout_s=1e+30 must be <= 1e+09"),   # beyond a timedelta
    ({"plan_cache": ""}, "terapipe.plan_cache='': String should have at least 1 character"),   # not the cwd
    ({"trace_dir": ""}, "terapipe.trace_dir='': String should have at least 1 character"),
    ({"memory_limit_gb": -1}, "terapipe.memory_limit_gb=-1"),
    ({"enabled": True, "seq_len": 64, "slices": 9}, "terapipe.slices=9 is more than seq_len/granularity = 8"),
    ({"profile": {"repeats": 0}}, "terapipe.profile.repeats=0 must be >= 1"),
    ({"seq_len": 64, "plan_per_batch": True}, 'needs packed: true'),
    ({"seq_len": 64, "plan_per_batch": True, "packed": True, "slices": 4}, 'needs slices: "auto"'),
    ({"seq_len": 64, "plan_per_batch": True, "packed": True, "replan": {"enabled": True}}, "needs no replan"),
    ({"seq_len": 64, "plan_per_batch": True, "packed": True, "freeze": {"schedule": [[1, 1]]}}, "needs no freeze"),
    ({"seq_len": 64, "sequence_parallel": 2, "slices": [15, 49]}, "slice lengths must be multiples of 2"),
    ({"p2p_timeout_s": "inf"}, "terapipe.p2p_timeout_s='inf': Input should be a finite number; set a valid value"),
    ({"memory_limit_gb": float("nan")}, "terapipe.memory_limit_gb=nan: Input should be a finite number"),
    ({"replan": {"enabled": True, "min_gain": float("inf")}}, "terapipe.replan.min_gain=inf: Input should be a finite"),
    ({"seq_len": 64, "slices": 4, "max_slices": 2}, 'max_slices=2 bounds the slicing "auto" chooses, but slices=4'),
    ({"slices": [32, 32], "memory_limit_gb": 1}, "memory_limit_gb=1.0 bounds the slicing \"auto\" chooses"),
])
def test_errors_name_key_value_and_fix(section: dict, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        parse(**section)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_section_must_be_an_object() -> None:
    with pytest.raises(ValueError, match="must be an object"):
        parse_terapipe_config({"terapipe": [1]})


def test_a_list_of_slices_is_taken_as_given_whatever_the_granularity() -> None:
    # granularity applies to slices the engine chooses; a list runs exactly as written (README, config.py)
    cfg = parse_terapipe_config({"terapipe": {"enabled": True, "slices": [5, 27, 16], "granularity": 8}})
    assert cfg.slices == [5, 27, 16] and cfg.seq_len == 48


@pytest.mark.parametrize("name,default", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2),
                                          ("dualpipev", 2), ("zbv", 2)])
def test_virtual_stages_default_to_the_schedules_own(name: str, default: int) -> None:
    assert parse(schedule=name).virtual_stages == default


@pytest.mark.parametrize("name,v,rule", [("1f1b", 2, "places one chunk per rank"),
                                         ("gpipe", 3, "places one chunk per rank"),
                                         ("dualpipev", 3, "dualpipev places exactly two chunks per rank"),
                                         ("zbv", 1, "zbv places exactly two chunks per rank"),
                                         ("interleaved-1f1b", 1, "needs virtual_stages >= 2"),
                                         ("looped-bfs", 1, "needs virtual_stages >= 2")])
def test_virtual_stages_a_schedule_cannot_place_are_refused_at_parse_time(name: str, v: int, rule: str) -> None:
    # Refused before any engine is built, on every rank (every rank parses the same config): rule, value, fix.
    with pytest.raises(ValueError) as info:
        parse(schedule=name, virtual_stages=v)
    message = str(info.value)
    assert f"terapipe.virtual_stages={v} with schedule {name!r}" in message and rule in message and "use" in message

def test_slices_are_decoded_once_into_a_policy() -> None:
    """``slices`` ("auto" | int | list) as the SlicingPolicy every consumer reads (the plan, freezing, repacking)."""
    auto = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64}}).slicing
    assert auto.is_auto and auto.fixed_for(64) is None and auto.fixed_for(128) is None
    equal = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "slices": 3, "granularity": 8}}).slicing
    assert not equal.is_auto and equal.fixed_for(64) == (24, 24, 16) and equal.fixed_for(16) == (8, 8)
    with pytest.raises(ValueError, match="not a multiple of terapipe.granularity=8"):
        equal.fixed_for(60)
    fixed = parse_terapipe_config({"terapipe": {"enabled": True, "slices": [5, 27, 16]}}).slicing
    assert fixed.kind == "fixed" and fixed.fixed_for(48) == (5, 27, 16)
    with pytest.raises(ValueError, match=r"fixed list for seq_len 48, but a batch has sequence length 64"):
        fixed.fixed_for(64)


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json")),
                         ids=lambda p: p.name)
def test_every_shipped_config_parses(path: Path) -> None:
    cfg = parse_terapipe_config(json.loads(path.read_text()))
    assert cfg.enabled, path.name


def test_shard_params_refuses_what_would_bypass_its_reduce_scatter() -> None:
    from types import SimpleNamespace

    from ds_terapipe.runtime.features.sharding import sharding_problem

    base = {"enabled": True, "seq_len": 64, "shard_params": True}
    for clash, value in (("vocab_parallel", True), ("sequence_parallel", 2), ("deferred_weight_grads", True),
                         ("freeze", {"schedule": [[1, 1]]})):
        with pytest.raises(ValueError, match=f"shard_params .*not supported with {clash}"):
            TeraPipeConfig(**base, **{clash: value})
    # gpipe defers weight gradients by default; sharded, it does not
    assert TeraPipeConfig(**base, schedule="gpipe").deferred_weight_grads is False
    assert TeraPipeConfig(**base).shard_release == "run"
    with pytest.raises(ValueError, match="shard_release"):
        TeraPipeConfig(**base, shard_release="epoch")

    def ds(stage: int = 0, fp16: bool = False) -> SimpleNamespace:
        return SimpleNamespace(zero_optimization_stage=stage, float16_config=SimpleNamespace(enabled=fp16))

    assert sharding_problem(ds()) is None
    assert "zero_optimization.stage=1" in sharding_problem(ds(stage=1))
    assert "fp16" in sharding_problem(ds(fp16=True))

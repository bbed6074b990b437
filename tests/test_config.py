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
    # profiled lengths off the granularity's grid or over seq_len: refused here, not when profiling starts
    ({"seq_len": 64, "profile": {"slice_lengths": [12, 16]}},
     "terapipe.profile.slice_lengths=[12, 16]: every length must be a positive multiple of terapipe.granularity=8"),
    ({"seq_len": 64, "granularity": 4, "profile": {"slice_lengths": [0, 16]}}, "got [0]; use multiples of 4"),
    ({"seq_len": 64, "profile": {"slice_lengths": [16, 128]}},
     "a slice holds at most terapipe.seq_len=64 tokens, got [128]; use lengths up to 64"),
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


def unhonoured(ds_config: dict, interval: int = 0, num_stages: int = 2, seed_layers: bool = False):
    from types import SimpleNamespace

    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_terapipe.runtime.execution.ds_config_checks import unhonoured_config_problem

    ds_config = {"train_batch_size": 1, **ds_config}
    module = SimpleNamespace(num_stages=num_stages, seed_layers=seed_layers, activation_checkpoint_interval=interval)
    return unhonoured_config_problem(ds_config, DeepSpeedConfig(ds_config), module)


def test_deepspeed_keys_no_pipeline_engine_reads_are_refused_with_the_fix() -> None:
    """The rest of the DeepSpeed config (runtime/execution/ds_config_checks.py): DeepSpeed's defaults pass, a value a
    pipeline engine would not read is refused with the key, the value and the fix."""
    assert unhonoured({}) is None
    assert unhonoured({"sequence_parallel_size": 1, "pipeline": {"stages": "auto", "partition": "best",
                       "seed_layers": False, "activation_checkpoint_interval": 2, "pipe_partitioned": False,
                       "grad_partitioned": False, "use_reentrant": False}}) is None
    message = unhonoured({"sequence_parallel_size": 4})
    assert "sequence_parallel_size=4 is DeepSpeed's Ulysses degree" in message
    assert "set terapipe.sequence_parallel=4" in message and "drop sequence_parallel_size" in message
    # what the module was built with passes: the stages and seeding are the module's
    assert unhonoured({"pipeline": {"stages": 4, "seed_layers": True}}, num_stages=4, seed_layers=True) is None
    for key, value, fix in (("stages", 4, "num_stages=4"), ("partition", "uniform", "partition_method='...'"),
                            ("seed_layers", True, "seed_layers=True")):
        message = unhonoured({"pipeline": {key: value}})
        assert f"pipeline.{key}={value!r} is read by no pipeline engine" in message, message
        assert f"pass {fix}" in message and f"drop pipeline.{key}" in message
    message = unhonoured({"pipeline": {"seed_layer": True, "activation_checkpoint_intervall": 1}})
    assert "pipeline: unknown key(s) ['activation_checkpoint_intervall', 'seed_layer']" in message
    assert "'activation_checkpoint_interval'" in message and "'seed_layers'" in message


def test_deepspeed_checkpoint_options_are_refused_where_the_token_pipeline_checkpoints(monkeypatch) -> None:
    """DeepSpeed's checkpoint options, from the config section or from ``deepspeed.checkpointing.configure``, are
    what DeepSpeed's checkpoint functions apply; the token pipeline's recompute does not: refused with checkpointing
    on, left alone without it (nothing is checkpointed, as in DeepSpeed's pipeline)."""
    from deepspeed.runtime.activation_checkpointing import checkpointing as ds_checkpointing

    section = {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}
    assert unhonoured(section, interval=0) is None
    message = unhonoured(section, interval=2)
    # the config's interval turns checkpointing on as DeepSpeed's pipeline engine does, over the module's 0
    assert unhonoured({**section, "pipeline": {"activation_checkpoint_interval": 2}}) == message
    assert message.startswith("terapipe: activation_checkpointing partition_activations=true, cpu_checkpointing=true "
                              "is not honoured by the token pipeline (activation_checkpoint_interval=2)"), message
    assert "set them to false" in message and "deepspeed.checkpointing.configure" in message
    assert unhonoured({}, interval=1) is None
    monkeypatch.setattr(ds_checkpointing, "CPU_CHECKPOINT", True)   # what configure(checkpoint_in_cpu=True) sets
    assert "cpu_checkpointing=true is not honoured" in unhonoured({}, interval=1)


def test_float16_autocast_is_refused_on_more_than_one_stage() -> None:
    """DeepSpeed's GradScaler for float16 autocast sees the last stage's loss only (its own pipeline fails at the
    first step); one stage, and bfloat16 autocast, train as in DeepSpeed's pipeline."""
    autocast = {"torch_autocast": {"enabled": True, "dtype": "float16"}}
    message = unhonoured(autocast)
    assert message.startswith("terapipe: torch_autocast.dtype=float16 fails at the first step on more than one "
                              "pipeline stage"), message
    assert "set torch_autocast.dtype to bfloat16" in message and "fp16.enabled" in message
    assert unhonoured(autocast, num_stages=1) is None
    assert unhonoured({"torch_autocast": {"enabled": True, "dtype": "bfloat16"}}) is None
    assert unhonoured({"torch_autocast": {"enabled": False, "dtype": "float16"}}) is None

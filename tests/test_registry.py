"""Tier (a): the schedule registry. Adding a schedule is one builder plus one registration, and every consumer
(build_schedule, validate, replay, simulate, the slicing planner, the config, the CLI, the docs table) follows.

    python -m pytest -q tests/test_registry.py
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from ds_terapipe.cli import main
from ds_terapipe.config import parse_terapipe_config
from ds_terapipe.planner import schedule as ir
from ds_terapipe.planner.registry import (
    ScheduleSpec, get_schedule, one_chunk_per_rank, register_schedule, registered_schedule, schedule_names,
    schedule_table, unregister_schedule,
)
from ds_terapipe.planner.schedule import (
    ActionKind, Schedule, _make, build_schedule, check_sizes, defer_weights, replay, validate,
)
from ds_terapipe.planner.simulate import simulate
from ds_terapipe.planner.slicing import MemoryModel, memory_shortfall
from tests.test_simulate import FakeCost, FakeStage

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
SMALL = ["--model", "gpt3-1b", "--device", "a100", "--stages", "4", "--seq-len", "512", "--granularity", "32"]
README = Path(__file__).resolve().parent.parent / "README.md"
BUILTIN = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "dualpipev", "zbv")
VALID = ", ".join(BUILTIN)


def build_sequential(num_stages: int, num_microbatches: int, num_slices: int) -> Schedule:
    """The toy: every stage runs one micro-batch at a time, its forwards then its backwards (later slices first)."""
    check_sizes(num_stages, num_microbatches, num_slices)
    streams = tuple(tuple(_make(s, kind, b, i) for b in range(num_microbatches)
                          for kind, order in ((F, range(num_slices)), (B, reversed(range(num_slices))))
                          for i in order) for s in range(num_stages))
    return Schedule("sequential", num_stages, num_microbatches, num_slices, streams)


TOY = ScheduleSpec(
    name="sequential", builder=build_sequential,
    description="toy: one micro-batch at a time on every stage",
    live_subbatches=lambda stage, num_stages, num_units, num_slices: min(float(num_units), 1.0),
    deferred_weight_grads=True, weights_per_slice=True)


@pytest.fixture
def toy():
    with registered_schedule(TOY) as spec:
        yield spec
    assert "sequential" not in schedule_names()


# ------------------------------------------------------------------------------------------------ the toy


def test_toy_schedule_builds_validates_replays_and_simulates(toy: ScheduleSpec) -> None:
    assert schedule_names() == (*BUILTIN, "sequential") and get_schedule("sequential") is toy
    assert "sequential" in ir.SCHEDULES and ir.WEIGHTS_PER_SLICE["sequential"] is True
    for K, m, n in itertools.product(range(1, 5), range(1, 4), range(1, 4)):
        sched = build_schedule("sequential", K, m, n)
        validate(sched)
        replay(sched)
        deferred = build_schedule("sequential", K, m, n, deferred_weight_grads=True)
        validate(deferred)
        replay(deferred)
        assert deferred.weights_per_slice == (n > 1)   # the spec's default W placement, not gpipe's
    # One micro-batch at a time on every stage: no overlap between micro-batches, so with equal unit costs
    # each micro-batch takes (n + K - 1) * (f + b) and they add up.
    K, m, n = 3, 2, 4
    res = simulate(build_schedule("sequential", K, m, n), FakeCost.uniform(FakeStage(1, 2), K), [8] * n)
    assert res.makespan_ms == m * (n + K - 1) * 3
    assert res.peak_in_flight == (n,) * K


def test_toy_schedule_through_planner_config_and_memory(toy: ScheduleSpec) -> None:
    cfg = parse_terapipe_config({"terapipe": {"schedule": "sequential", "seq_len": 64}})
    assert cfg.schedule == "sequential" and cfg.deferred_weight_grads is True
    assert MemoryModel.live_subbatches("sequential", 0, 4, 8, 3) == 1.0
    mem = MemoryModel(1, 64)
    args = dict(num_stages=4, num_microbatches=8, micro_batch_size=1, seq_len=512, granularity=32)
    gpipe_peak = mem.peak_bytes(schedule="gpipe", num_stages=4, num_microbatches=8, micro_batch_size=1,
                                num_splits=1, seq_len=512, num_slices=16)
    short = memory_shortfall(mem, gpipe_peak / 2, schedule="gpipe", **args)
    assert short is not None and short.lower_schedule == "sequential"   # the toy holds the fewest units
    assert "| `sequential` | chunk r on rank r | - | - | on, per slice | toy: one micro-batch at a time" in \
        schedule_table()


def test_toy_schedule_through_the_cli(toy: ScheduleSpec, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *SMALL, "--microbatches", "2", "--schedule", "sequential", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["schedule"] == "sequential" and sum(plan["slices"]) == 512
    assert main(["simulate", *SMALL, "--microbatches", "2", "--schedule", "sequential", "--json"]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["schedule"] == "sequential" and sim["slices"] == plan["slices"]
    assert sim["makespan_ms"] == pytest.approx(plan["predicted_ms"], rel=1e-12)  # the planner simulated it
    assert main(["schedules"]) == 0
    assert "`sequential`" in capsys.readouterr().out


def test_unregistered_schedule_is_refused_everywhere(capsys: pytest.CaptureFixture[str]) -> None:
    with registered_schedule(TOY):
        pass
    assert schedule_names() == BUILTIN
    with pytest.raises(ValueError, match=f"schedule = 'sequential' is unknown; valid: {VALID}$"):
        build_schedule("sequential", 2, 1, 1)
    with pytest.raises(ValueError, match=f"terapipe.schedule='sequential' is unknown; use one of {VALID}"):
        parse_terapipe_config({"terapipe": {"schedule": "sequential"}})
    assert main(["plan", *SMALL, "--schedule", "sequential"]) == 2
    err = capsys.readouterr().err
    assert "--schedule" in err and "'sequential'" in err and "gpipe" in err


# ------------------------------------------------------------------------------------ registry behaviour


def test_register_refuses_conflicts_and_unregister_restores() -> None:
    gpipe = get_schedule("gpipe")
    with pytest.raises(ValueError, match=r"schedule 'gpipe' is already registered \(by .*\.gpipe\); pick another name"):
        register_schedule(ScheduleSpec(**{**vars(TOY), "name": "gpipe"}))
    assert register_schedule(gpipe) is gpipe   # the same value again: a no-op
    spec = register_schedule(TOY)
    try:
        assert unregister_schedule("sequential") is spec
    finally:
        if "sequential" in schedule_names():
            unregister_schedule("sequential")
    with pytest.raises(ValueError, match=f"schedule 'sequential' is not registered; registered: {VALID}$"):
        unregister_schedule("sequential")
    with registered_schedule(ScheduleSpec(**{**vars(gpipe), "description": "replaced"})):
        assert get_schedule("gpipe").description == "replaced"
    assert get_schedule("gpipe") is gpipe


@pytest.mark.parametrize("field, value, exc, needle", [
    ("name", "two words", ValueError, "ScheduleSpec.name = 'two words' must be a non-empty word"),
    ("name", "", ValueError, "must be a non-empty word"),
    ("builder", None, TypeError, "ScheduleSpec.builder of 'sequential' must be callable"),
    ("live_subbatches", 1.0, TypeError, "ScheduleSpec.live_subbatches of 'sequential' must be callable"),
    ("bubble", 0.5, TypeError, "ScheduleSpec.bubble of 'sequential' must be a BubbleFormula or None"),
    ("description", "a | b", ValueError, "one line without '|'"),
])
def test_spec_refuses_what_would_break_a_consumer(field: str, value: object, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        ScheduleSpec(**{**vars(TOY), field: value})
    with pytest.raises(TypeError, match="needs a ScheduleSpec, got dict"):
        register_schedule(vars(TOY))  # type: ignore[arg-type]


def test_one_chunk_per_rank_refuses_virtual_stages() -> None:
    assert one_chunk_per_rank(4) == (0, 1, 2, 3)
    for name in ("gpipe", "1f1b"):
        assert get_schedule(name).placement(3, 1) == (0, 1, 2)
        with pytest.raises(ValueError, match="virtual_stages = 2: this schedule places one chunk per rank"):
            get_schedule(name).placement(3, 2)


# ------------------------------------------------------------------------------------- built-in specs


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_builtin_closed_form_bubble_matches_the_simulator(name: str) -> None:
    bubble = get_schedule(name).bubble
    assert bubble is not None
    for K, m, n in itertools.product(range(1, 6), range(1, 4), range(1, 5)):
        res = simulate(build_schedule(name, K, m, n), FakeCost.uniform(FakeStage(1, 2), K), [8] * n)
        assert res.bubble_fraction == pytest.approx(bubble(K, m * n), abs=1e-12), (K, m, n)


def test_builtin_defaults_reach_config_and_defer_weights() -> None:
    for name, deferred, per_slice in (("gpipe", True, False), ("1f1b", False, True)):
        spec = get_schedule(name)
        assert (spec.deferred_weight_grads, spec.weights_per_slice) == (deferred, per_slice)
        assert parse_terapipe_config({"terapipe": {"schedule": name}}).deferred_weight_grads is deferred
        assert defer_weights(build_schedule(name, 2, 2, 3)).weights_per_slice is per_slice
        assert ir.WEIGHTS_PER_SLICE[name] is per_slice
    assert get_schedule("gpipe").dp_exact and not get_schedule("1f1b").dp_exact


def test_legacy_names_stay_importable() -> None:
    from ds_terapipe.planner.schedule import SCHEDULES, build_1f1b, build_gpipe, warmup_forwards
    from ds_terapipe.planner.slicing import SCHEDULES as SLICING_SCHEDULES

    assert SCHEDULES == SLICING_SCHEDULES == BUILTIN
    assert get_schedule("gpipe").builder is build_gpipe and get_schedule("1f1b").builder is build_1f1b
    assert warmup_forwards(0, 4, 8, 2) == 5
    with pytest.raises(AttributeError, match="has no attribute 'build_zb'"):
        ir.build_zb  # noqa: B018


def test_readme_schedule_table_is_the_registry_table() -> None:
    """README's table is rendered from the registry (`ds-terapipe schedules`); regenerate it when a spec changes."""
    text = README.read_text()
    table = schedule_table()
    assert table in text, f"README.md's schedule table is stale; replace it with:\n{table}"
    assert text.count("| schedule | placement |") == 1


@pytest.mark.parametrize("first", ["gpipe", "dualpipev", "one_f_one_b"])
def test_builtin_order_does_not_depend_on_which_schedule_module_is_imported_first(first: str) -> None:
    """A fresh interpreter that imports one schedule module directly: it loads the others from inside its own
    registration, and still lists the built-ins in their order (gpipe used to land last, changing the
    'unknown schedule' message with the order tests ran in)."""
    import subprocess
    import sys
    code = (f"import ds_terapipe.planner.schedules.{first}\n"
            "from ds_terapipe.planner.registry import schedule_names\nprint(','.join(schedule_names()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == ",".join(BUILTIN)

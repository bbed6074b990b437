"""Tier a: the vocabulary passes (VF/VB collectives) in the schedule IR: placement, one order, no deadlock."""

from __future__ import annotations

import itertools

import pytest

from ds_terapipe.planner.schedule import (Action, ActionKind, DeadlockError, ScheduleError, build_schedule,
                                          replay, schedule_from_strings, stream_strings, validate)
from ds_terapipe.planner.vocab import add_vocab_passes, vocab_schedule


def test_action_round_trip() -> None:
    for text in ("1VF0.2", "0VB3.0"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2VF1.0").is_collective and not Action.parse("2F1.0").is_collective
    assert Action.parse("2VF1.0").kind is ActionKind.VOCAB_F


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("deferred", [False, True])
def test_grid_validates_and_replays(name: str, deferred: bool) -> None:
    for stages, micro, slices in itertools.product(range(1, 6), range(1, 5), range(1, 5)):
        sched = vocab_schedule(name, stages, micro, slices, deferred)
        validate(sched)
        replay(sched)
        colls = [[(a.kind, a.microbatch, a.slice) for a in st if a.is_collective] for st in sched.stages]
        assert all(c == colls[0] for c in colls), (name, stages, micro, slices)
        assert len(colls[0]) == 2 * micro * slices
        last = sched.stages[-1]
        for p, a in enumerate(last):
            if a.kind is ActionKind.FORWARD:  # VF right after the last stage's forward
                assert last[p + 1] == Action(stages - 1, ActionKind.VOCAB_F, a.microbatch, a.slice)
            if a.kind is ActionKind.BACKWARD:  # VB right before its backward
                assert last[p - 1] == Action(stages - 1, ActionKind.VOCAB_B, a.microbatch, a.slice)


def test_forward_only_has_no_backward_pass() -> None:
    from ds_terapipe.runtime.schedule import forward_only

    sched = add_vocab_passes(forward_only(build_schedule("1f1b", 3, 2, 3)))
    replay(sched)  # (validate wants every B: a forward-only schedule is the runtime's, not a training one)
    assert {a.kind for st in sched.stages for a in st if a.is_collective} == {ActionKind.VOCAB_F}


def test_refuses_virtual_stages() -> None:
    with pytest.raises(ValueError, match="one chunk per rank.*gpipe or 1f1b"):
        add_vocab_passes(build_schedule("interleaved-1f1b", 2, 2, 2))


def test_order_mismatch_is_refused() -> None:
    lines = list(stream_strings(vocab_schedule("gpipe", 2, 1, 2)))
    swapped = lines[0].replace("0VF0.0", "X").replace("0VF0.1", "0VF0.0").replace("X", "0VF0.1")
    bad = schedule_from_strings("gpipe", 1, 2, [swapped, lines[1]])
    with pytest.raises(ScheduleError, match="collective #0"):
        validate(bad)
    with pytest.raises(ScheduleError, match="mis-orders collectives"):
        replay(bad)


def test_collective_behind_its_own_receive_deadlocks() -> None:
    """Rank 0 joins VB0.0 only after receiving B0.0's gradient, which rank 1 sends after VB0.0: a cycle."""
    lines = list(stream_strings(vocab_schedule("gpipe", 2, 1, 1)))
    assert lines[0] == "0F0.0 0SEND_F0.0 0VF0.0 0VB0.0 0RECV_B0.0 0B0.0"
    late = schedule_from_strings("gpipe", 1, 1, ["0F0.0 0SEND_F0.0 0VF0.0 0RECV_B0.0 0VB0.0 0B0.0", lines[1]])
    with pytest.raises(DeadlockError, match="collective #1"):
        replay(late)


def test_missing_anchor_is_refused() -> None:
    lines = list(stream_strings(vocab_schedule("gpipe", 2, 1, 1)))
    # the last rank's VB after its B: B would start without the hidden-state gradient
    moved = lines[1].replace("1VB0.0 1B0.0", "1B0.0 1VB0.0")
    with pytest.raises(ScheduleError, match="hidden-state gradient"):
        validate(schedule_from_strings("gpipe", 1, 1, [lines[0], moved]))

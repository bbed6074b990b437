"""Tier (a): the schedule IR, builders, comm lowering, validator and replay. Pure Python, no torch.

    python -m pytest -q tests/test_schedule.py
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import re

import numpy as np
import pytest

from ds_terapipe.planner.schedule import (
    SCHEDULES, Action, ActionKind, DeadlockError, PairingError, Schedule, ScheduleError, add_communication,
    build_1f1b, build_gpipe, build_schedule, defer_weights, match_messages, replay, schedule_from_strings,
    stream_strings, validate, warmup_forwards,
)

from ds_terapipe.planner.registry import get_schedule

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
#: Schedules with one chunk per rank (chunk = stage = rank): the per-stage properties below are theirs; schedules
#: with virtual stages are checked per chunk in tests/test_chunks.py.
ONE_CHUNK = tuple(name for name in SCHEDULES if get_schedule(name).virtual_stages == 1)
GRID = list(itertools.product(range(1, 7), range(1, 6), range(1, 7)))  # stages x microbatches x slices


def with_stream(schedule: Schedule, stage: int, stream: list[Action]) -> Schedule:
    streams = list(schedule.stages)
    streams[stage] = tuple(stream)
    return Schedule(schedule.name + "-edited", schedule.num_stages, schedule.num_microbatches,
                    schedule.num_slices, tuple(streams))


def peak_in_flight(stream, until: ActionKind = ActionKind.BACKWARD) -> int:
    """Most units a stage holds at once: forwarded and not yet through ``until`` (their B; their W: also the
    units holding W inputs)."""
    live = peak = 0
    for a in stream:
        live += (a.kind is F) - (a.kind is until)
        peak = max(peak, live)
    return peak


# ------------------------------------------------------------------------------------------------- Action


def test_action_str_examples():
    assert str(Action(1, F, 0, 2)) == "1F0.2"
    assert str(Action(0, ActionKind.RECV_B, 3, 0)) == "0RECV_B3.0"
    assert repr(Action(12, ActionKind.SEND_F, 10, 11)) == "12SEND_F10.11"


def test_action_parse_round_trips_over_many_actions():
    rng = random.Random(0)
    actions = [Action(s, k, b, i) for k in ActionKind for s, b, i in itertools.product(range(12), repeat=3)]
    actions += [Action(rng.randrange(10**6), rng.choice(list(ActionKind)), rng.randrange(10**6),
                       rng.randrange(10**6)) for _ in range(2000)]
    for a in actions:
        back = Action.parse(str(a))
        assert back == a and hash(back) == hash(a) and back.kind is a.kind
    assert len(set(actions)) == len({str(a) for a in actions})  # str is injective


@pytest.mark.parametrize("text", ["", "F0.0", "1F0", "1F0.0.0", "-1F0.0", "1X0.0", " 1F0.0", "1F0.0 ",
                                  "1f0.0", "1SEND0.0", "1F.0", "1RECV_FF0.0", "1F0.-1", "\u0661F0.0"])
def test_action_parse_rejects_bad_text(text):
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_action_parse_needs_str():
    with pytest.raises(TypeError):
        Action.parse(b"1F0.0")


def test_action_checks_its_fields():
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        Action(-1, F, 0, 0)
    with pytest.raises(ValueError, match="slice must be >= 0"):
        Action(0, F, 0, -2)
    with pytest.raises(TypeError, match="microbatch must be an int"):
        Action(0, F, 1.0, 0)
    with pytest.raises(TypeError, match="bool"):
        Action(True, F, 0, 0)
    with pytest.raises(ValueError, match="kind 'X' is not one of"):
        Action(0, "X", 0, 0)
    coerced = Action(np.int64(2), "SEND_B", np.int32(1), 0)
    assert coerced == Action(2, ActionKind.SEND_B, 1, 0) and type(coerced.chunk) is int
    assert coerced.kind is ActionKind.SEND_B


def test_action_is_an_immutable_value():
    a = Action(1, F, 2, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.chunk = 2
    assert {a, Action(1, F, 2, 3), Action(1, B, 2, 3)} == {Action(1, B, 2, 3), a}
    assert a.unit == (2, 3)


@pytest.mark.parametrize("kind,peer,compute", [(F, None, True), (B, None, True), (ActionKind.SEND_F, 4, False),
                                               (ActionKind.RECV_B, 4, False), (ActionKind.RECV_F, 2, False),
                                               (ActionKind.SEND_B, 2, False)])
def test_action_peer_and_flags(kind, peer, compute):
    a = Action(3, kind, 0, 0)
    assert a.peer == peer and a.is_compute is compute and a.is_comm is (not compute)


# ----------------------------------------------------------------------------------------------- builders


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_builder_validates_and_replays_over_grid(name):
    for K, m, n in GRID:
        sched = build_schedule(name, K, m, n)
        assert (sched.name, sched.num_stages, sched.num_microbatches, sched.num_slices) == (name, K, m, n)
        assert not sched.has_comm
        validate(sched)
        lowered = add_communication(sched)
        validate(lowered)
        result = replay(sched)
        assert result.order == lowered.stages
        for r, (stream, steps) in enumerate(zip(result.order, result.steps)):
            assert len(steps) == len(stream) and all(x < y for x, y in zip(steps, steps[1:]))
        for r, match in enumerate(match_messages(lowered)):  # a receive runs after its send
            for p, (sr, sp) in match.items():
                assert result.steps[r][p] > result.steps[sr][sp]
                assert lowered.stages[r][p].unit == lowered.stages[sr][sp].unit
        assert result.num_steps == 1 + max(st[-1] for st in result.steps)


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_builders_keep_unit_orders(name):
    """Forwards in (microbatch, slice) order; backwards microbatch 0 first, later slices first, on every stage."""
    for K, m, n in GRID:
        sched = build_schedule(name, K, m, n)
        for stream in sched.stages:
            assert [a.unit for a in stream if a.kind is F] == list(sched.units())
            assert [a.unit for a in stream if a.kind is B] == [(b, i) for b in range(m) for i in reversed(range(n))]


def test_gpipe_golden():
    assert stream_strings(build_gpipe(2, 2, 2)) == (
        "0F0.0 0F0.1 0F1.0 0F1.1 0B0.1 0B0.0 0B1.1 0B1.0",
        "1F0.0 1F0.1 1F1.0 1F1.1 1B0.1 1B0.0 1B1.1 1B1.0",
    )


def test_1f1b_golden():
    assert stream_strings(build_1f1b(3, 2, 2)) == (
        "0F0.0 0F0.1 0F1.0 0F1.1 0B0.1 0B0.0 0B1.1 0B1.0",  # warm-up 2+3-1-0 = 4 = every unit
        "1F0.0 1F0.1 1F1.0 1B0.1 1F1.1 1B0.0 1B1.1 1B1.0",
        "2F0.0 2F0.1 2B0.1 2B0.0 2F1.0 2F1.1 2B1.1 2B1.0",  # last stage: one micro-batch at a time
    )


def test_1f1b_warmup_and_peak_in_flight_bounded():
    for K, m, n in GRID:
        one, gp = build_1f1b(K, m, n), build_gpipe(K, m, n)
        for s, stream in enumerate(one.stages):
            warm = next(p for p, a in enumerate(stream) if a.kind is B)
            assert warm == warmup_forwards(s, K, m, n) == min(n + K - 1 - s, m * n)
            assert peak_in_flight(stream) == warm
            assert peak_in_flight(gp.stages[s]) == m * n
        assert peak_in_flight(one.stages[-1]) == n
        # the last stage never holds two micro-batches (their KV caches would both be alive there)
        alive: set[int] = set()
        for a in one.stages[-1]:
            if a.kind is F:
                alive.add(a.microbatch)
                assert len(alive) == 1, f"K={K} m={m} n={n}: last stage forwards {sorted(alive)} at once"
            elif a.kind is B and a.slice == 0:
                alive.discard(a.microbatch)
        if m >= 4 and K >= 2:
            assert sum(map(peak_in_flight, one.stages)) < sum(map(peak_in_flight, gp.stages))
            assert peak_in_flight(one.stages[-1]) < m * n


def test_build_schedule_rejects_unknown_names_and_bad_sizes():
    with pytest.raises(ValueError, match="schedule = 'zb' is unknown; valid: gpipe, 1f1b"):
        build_schedule("zb", 2, 2, 2)
    with pytest.raises(ValueError, match="schedule = None is unknown"):
        build_schedule(None, 2, 2, 2)
    for builder in (build_gpipe, build_1f1b):
        for pos, name in enumerate(("num_stages", "num_microbatches", "num_slices")):
            args = [2, 2, 2]
            args[pos] = 0
            with pytest.raises(ValueError, match=f"{name} = 0 must be >= 1"):
                builder(*args)
            args[pos] = 1.5
            with pytest.raises(TypeError, match=name):
                builder(*args)


def test_builders_are_memoised_values():
    assert build_1f1b(3, 2, 2) is build_1f1b(3, 2, 2)
    rebuilt = Schedule("gpipe", 2, 1, 1, build_1f1b(2, 1, 1).stages)  # one unit: both schedules coincide
    assert rebuilt == build_gpipe(2, 1, 1) and hash(rebuilt) == hash(build_gpipe(2, 1, 1))
    assert rebuilt != build_1f1b(2, 1, 1)  # the name is part of the value


def test_schedule_str_prints_every_action_in_a_grid():
    sched = build_1f1b(3, 2, 2)
    text = str(sched)
    assert text.splitlines()[1].split() == ["step", "rank", "0", "rank", "1", "rank", "2"]
    for stream in sched.stages:
        for a in stream:
            assert str(a) in text
    assert schedule_from_strings("1f1b", 2, 2, stream_strings(sched)) == sched


def test_schedule_checks_its_streams():
    with pytest.raises(ValueError, match="2 streams but num_stages=3"):
        Schedule("x", 3, 1, 1, ((), ()))
    with pytest.raises(ValueError, match=r"stages\[1\]\[0\] is 0F0.0, an action of stage 0"):
        Schedule("x", 2, 1, 1, ((), (Action(0, F, 0, 0),)))
    with pytest.raises(TypeError, match="must be an Action"):
        Schedule("x", 1, 1, 1, (("0F0.0",),))


# ---------------------------------------------------------------------------------------- communication


def test_add_communication_golden():
    assert stream_strings(add_communication(build_gpipe(2, 1, 2))) == (
        "0F0.0 0SEND_F0.0 0F0.1 0SEND_F0.1 0RECV_B0.1 0B0.1 0RECV_B0.0 0B0.0",
        "1RECV_F0.0 1F0.0 1RECV_F0.1 1F0.1 1B0.1 1SEND_B0.1 1B0.0 1SEND_B0.0",
    )


def test_add_communication_places_messages_next_to_their_compute():
    for K, m, n in GRID[::7]:
        for name in ONE_CHUNK:
            sched = build_schedule(name, K, m, n)
            lowered = add_communication(sched)
            assert lowered.has_comm == (K > 1) and lowered.compute_only() == sched
            for s, stream in enumerate(lowered.stages):
                for p, a in enumerate(stream):
                    before = stream[p - 1] if p else None
                    after = stream[p + 1] if p + 1 < len(stream) else None
                    if a.kind is F:
                        assert (before == Action(s, ActionKind.RECV_F, *a.unit)) == (s > 0)
                        assert (after == Action(s, ActionKind.SEND_F, *a.unit)) == (s < K - 1)
                    elif a.kind is B:
                        assert (before == Action(s, ActionKind.RECV_B, *a.unit)) == (s < K - 1)
                        assert (after == Action(s, ActionKind.SEND_B, *a.unit)) == (s > 0)
            assert add_communication(lowered) is lowered and add_communication(build_gpipe(1, m, n)).has_comm is False


# ---------------------------------------------------------------------------------------------- validate


def _violations(sched: Schedule) -> ScheduleError:
    with pytest.raises(ScheduleError) as info:
        validate(sched)
    assert type(info.value) is ScheduleError
    return info.value


def test_validate_reports_missing_duplicate_and_out_of_range():
    base = build_gpipe(2, 2, 2)
    err = _violations(with_stream(base, 1, [a for a in base.stages[1] if str(a) != "1B0.0"]))
    assert "1B0.0 is missing" in str(err)
    err = _violations(with_stream(base, 0, list(base.stages[0]) + [Action(0, F, 1, 1)]))
    assert "0F1.1 is a duplicate (first at position 3)" in str(err)
    err = _violations(with_stream(base, 0, list(base.stages[0]) + [Action(0, F, 2, 0)]))
    assert "0F2.0 is outside 2 micro-batches x 2 slices" in str(err)


def test_validate_reports_backward_of_slice_i_before_slice_i_plus_1():
    base = build_1f1b(3, 2, 3)
    stream = list(base.stages[1])
    i, j = stream.index(Action(1, B, 0, 2)), stream.index(Action(1, B, 0, 1))
    stream[i], stream[j] = stream[j], stream[i]
    err = _violations(with_stream(base, 1, stream))
    assert f"1B0.1 at position {i} runs before 1B0.2 at position {j}" in str(err)


def test_validate_reports_forward_order_and_backward_before_forward():
    base = build_gpipe(1, 1, 2)
    err = _violations(schedule_from_strings("x", 1, 2, ["0F0.1 0F0.0 0B0.1 0B0.0"]))
    assert "0F0.1 at position 0 runs before 0F0.0 at position 1" in str(err)
    err = _violations(schedule_from_strings("x", 1, 2, ["0F0.0 0B0.1 0F0.1 0B0.0"]))
    assert "0B0.1 at position 1 runs before 0F0.1 at position 2" in str(err)
    validate(base)


def test_validate_lists_every_violation():
    base = build_gpipe(3, 1, 1)
    streams = ["0F0.0", "1F0.0 1B0.0 1B0.0", "2B0.0 2F0.0"]
    err = _violations(schedule_from_strings("x", 1, 1, streams))
    assert len(err.violations) == 3, err.violations
    assert "0B0.0 is missing" in str(err) and "1B0.0 is a duplicate" in str(err)
    assert "2B0.0 at position 0 runs before 2F0.0" in str(err)
    validate(base)


def test_validate_checks_comm_against_compute():
    good = stream_strings(add_communication(build_gpipe(2, 1, 1)))
    assert good == ("0F0.0 0SEND_F0.0 0RECV_B0.0 0B0.0", "1RECV_F0.0 1F0.0 1B0.0 1SEND_B0.0")
    validate(schedule_from_strings("x", 1, 1, good))
    # A prefetched receive (posted earlier than "immediately before") is still consistent.
    validate(schedule_from_strings("x", 1, 1, ["0F0.0 0RECV_B0.0 0SEND_F0.0 0B0.0", good[1]]))
    err = _violations(schedule_from_strings("x", 1, 1, ["0F0.0 0SEND_F0.0 0B0.0 0RECV_B0.0", good[1]]))
    assert "0B0.0 at position 2 runs before 0RECV_B0.0 at position 3" in str(err)
    err = _violations(schedule_from_strings("x", 1, 1, ["0RECV_F0.0 " + good[0], good[1]]))
    assert "0RECV_F0.0 has no peer (stage -1 does not exist)" in str(err)
    err = _violations(schedule_from_strings("x", 1, 1, ["0F0.0 0RECV_B0.0 0B0.0", good[1]]))
    assert "0SEND_F0.0 is missing" in str(err)
    err = _violations(schedule_from_strings("x", 1, 1, [good[0], "1RECV_F0.0 1F0.0 1SEND_B0.0 1B0.0"]))
    assert "1SEND_B0.0 at position 2 runs before 1B0.0 at position 3" in str(err)


# ------------------------------------------------------------------------------------------------ replay


def test_replay_steps_golden():
    result = replay(build_gpipe(2, 1, 1))
    assert result.steps == ((0, 1, 6, 7), (2, 3, 4, 5)) and result.num_steps == 8
    assert replay(build_gpipe(1, 3, 2)).num_steps == 12  # one rank: one action per step


def test_replay_reports_deadlock_of_swapped_order_on_one_rank():
    """gpipe with stage 0's last forward swapped with its first backward: locally valid, globally stuck."""
    for K, m, n in GRID:
        if K < 2 or m < 2:
            continue
        base = build_gpipe(K, m, n)
        stream = list(base.stages[0])
        N = m * n
        stream[N - 1], stream[N] = stream[N], stream[N - 1]
        broken = with_stream(base, 0, stream)
        validate(broken)  # every per-stage rule holds; only the cross-stage order is wrong
        with pytest.raises(DeadlockError) as info:
            replay(broken)
        msg = str(info.value)
        assert re.search(rf"rank 0 blocked at position \d+ on 0RECV_B0\.{n - 1}: waits for 1SEND_B0\.{n - 1}", msg)
        assert re.search(rf"rank 1 blocked at position \d+ on 1RECV_F{m - 1}\.{n - 1}", msg), msg
        assert f">0RECV_B0.{n - 1}<" in msg and f">1RECV_F{m - 1}.{n - 1}<" in msg  # marked in the grid
        assert "step" in msg and "rank 0" in msg


def test_replay_reports_rank_that_waits_forever():
    base = add_communication(build_gpipe(3, 2, 2))
    lonely = with_stream(base, 0, list(base.stages[0]) + [Action(0, ActionKind.RECV_B, 1, 0)])
    with pytest.raises(DeadlockError) as info:
        replay(lonely)  # every other rank finishes
    msg = str(info.value)
    assert "rank 0 blocked at position 16 on 0RECV_B1.0: waits for send #4 on channel 1->0, but rank 1 issues " \
           "only 4: it waits forever" in msg, msg
    assert "rank 1 blocked" not in msg and ">0RECV_B1.0<" in msg


def test_replay_names_the_root_of_a_missing_send():
    base = add_communication(build_gpipe(3, 2, 2))
    broken = with_stream(base, 0, [a for a in base.stages[0] if str(a) != "0SEND_F1.1"])
    with pytest.raises(DeadlockError) as info:
        replay(broken)
    msg = str(info.value)
    assert "rank 1 blocked at position 9 on 1RECV_F1.1: waits for send #3 on channel 0->1, but rank 0 issues " \
           "only 3: it waits forever" in msg, msg
    assert "rank 2 blocked at position 6 on 2RECV_F1.1: waits for 1SEND_F1.1 (rank 1, position 11); rank 1 is " \
           "itself blocked" in msg
    with pytest.raises(ScheduleError, match="0SEND_F1.1 is missing"):
        validate(broken)


@pytest.mark.parametrize("name,K,m,n", [("gpipe", 3, 2, 3), ("1f1b", 3, 2, 1), ("1f1b", 3, 4, 1)])
def test_replay_reports_mispaired_channel(name, K, m, n):
    """Stage 1 forwards micro-batch 1 before micro-batch 0: valid on its own, but FIFO hands it the wrong tensor."""
    base = build_schedule(name, K, m, n)
    stream = list(base.stages[1])
    fwd = [p for p, a in enumerate(stream) if a.kind is F and a.microbatch < 2]
    units = [stream[p].unit for p in fwd]
    for p, u in zip(fwd, units[n:] + units[:n]):
        stream[p] = Action(1, F, *u)
    broken = with_stream(base, 1, stream)
    validate(broken)
    with pytest.raises(PairingError) as info:
        replay(broken)
    assert "channel 0->1: receive #0 1RECV_F1.0 (rank 1, position 0) is paired with send #0 0SEND_F0.0 " \
           "(rank 0, position 1)" in str(info.value), str(info.value)


def test_replay_reports_send_never_received_and_missing_peer():
    good = stream_strings(add_communication(build_gpipe(2, 1, 1)))
    extra = schedule_from_strings("x", 1, 1, [good[0] + " 0SEND_F0.0", good[1]])
    with pytest.raises(PairingError, match="send 0SEND_F0.0 .rank 0, position 4. is never received"):
        replay(extra)
    nowhere = schedule_from_strings("x", 1, 1, [good[0], good[1] + " 1SEND_F0.0"])
    with pytest.raises(ScheduleError, match="talks to rank 2, which does not exist"):
        replay(nowhere)
    with pytest.raises(TypeError):
        replay("gpipe")


def test_deadlock_grid_of_a_long_schedule_is_elided_around_the_stuck_actions():
    base = build_gpipe(2, 200, 1)
    stream = list(base.stages[0])
    stream[199], stream[200] = stream[200], stream[199]
    with pytest.raises(DeadlockError) as info:
        replay(with_stream(base, 0, stream))
    msg = str(info.value)
    assert "rows elided" in msg and ">0RECV_B0.0<" in msg and ">1RECV_F199.0<" in msg
    assert len(msg.splitlines()) < 120


# -- deferred weight gradients (W actions) ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("per_slice", [False, True])
@pytest.mark.parametrize("K,m,n", [(1, 1, 1), (2, 1, 4), (3, 2, 3), (4, 3, 2)])
def test_defer_weights_adds_w_after_the_backwards_it_follows(name, per_slice, K, m, n):
    base = build_schedule(name, K, m, n)
    sched = defer_weights(base, per_slice=per_slice)
    assert sched.defers_weights and not base.defers_weights
    assert sched.weights_per_slice == (per_slice and n > 1)
    validate(sched)
    lowered = add_communication(sched)
    validate(lowered)
    replay(sched)
    for s, stream in enumerate(sched.stages):
        ws = [a for a in stream if a.kind is ActionKind.WEIGHT]
        follows = [a for a in stream if a.kind is ActionKind.BACKWARD and (per_slice or a.slice == 0)]
        assert [w.unit for w in ws] == [b.unit for b in follows]  # one W per unit / per micro-batch, in order
        for w in ws:
            assert stream[stream.index(w) - 1] == Action(s, "B", w.microbatch, w.slice)
        # without the W actions it is the same schedule
        assert tuple(a for a in stream if a.kind is not ActionKind.WEIGHT) == base.stages[s]
    for s, stream in enumerate(lowered.stages):  # on s > 0 the gradient leaves before W runs
        for p, a in enumerate(stream):
            if a.kind is ActionKind.WEIGHT and s > 0:
                assert stream[p - 1] == Action(s, "SEND_B", a.microbatch, a.slice)
    assert defer_weights(sched) == sched  # already deferred: unchanged


def test_default_w_placement_follows_the_schedule():
    assert not defer_weights(build_schedule("gpipe", 2, 2, 3)).weights_per_slice
    assert defer_weights(build_schedule("1f1b", 2, 2, 3)).weights_per_slice


def test_w_action_round_trips_as_text():
    assert str(Action.parse("1W2.0")) == "1W2.0"
    sched = defer_weights(build_schedule("1f1b", 2, 2, 2))
    again = schedule_from_strings("1f1b", 2, 2, stream_strings(sched))
    assert again.stages == sched.stages and again.defers_weights


def test_validate_catches_misplaced_or_missing_w():
    good = stream_strings(defer_weights(build_schedule("gpipe", 1, 2, 2), per_slice=False))[0].split()
    early = [t for t in good if t != "0W0.0"]
    early.insert(early.index("0B0.0"), "0W0.0")   # before the micro-batch's last backward
    missing = [t for t in good if t != "0W1.0"]
    wrong_slice = [t if t != "0W1.0" else "0W1.1" for t in good]
    for tokens, expect in ((early, "0W0.0 at position"), (missing, "0W1.0 is missing"),
                           (wrong_slice, "0W0.1 is missing")):  # a W of slice > 0: one W per unit needed
        with pytest.raises(ScheduleError, match=expect):
            validate(schedule_from_strings("gpipe", 2, 2, [" ".join(tokens)]))


def test_defer_weights_needs_a_compute_only_schedule():
    with pytest.raises(ValueError, match="compute-only"):
        defer_weights(add_communication(build_schedule("gpipe", 2, 1, 2)))
    with pytest.raises(TypeError):
        defer_weights("gpipe")


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "dualpipev", "zbv"])
def test_micro_batches_with_their_own_slice_counts_lower_and_replay(name: str) -> None:
    """A step of micro-batches of different lengths runs the schedule of the largest slice count without the units
    a micro-batch lacks: for every schedule, training (with and without W, vocabulary passes) and evaluation,
    the lowered schedule holds exactly each micro-batch's units and replays without a deadlock."""
    from ds_terapipe.planner.lowering import lower, slice_counts_of
    from ds_terapipe.planner.schedule import replay

    rng = random.Random(name)
    v = get_schedule(name).virtual_stages
    for p in (2, 3):
        for m in (1, 2, 3, 5):
            counts = [rng.randint(1, 4) for _ in range(m)]
            for train, deferred, vocab in itertools.product((True, False), (False, True), (False, True)):
                sched = lower(name, p, m, max(counts), train=train, deferred_weight_grads=deferred,
                              virtual_stages=v, vocab_parallel=vocab, slice_counts=counts)
                forwards = {(a.chunk, a.microbatch, a.slice) for stream in sched.stages for a in stream
                            if a.kind.name == "FORWARD"}
                assert forwards == {(c, b, i) for c in range(p * v) for b in range(m) for i in range(counts[b])}
                replay(sched)
    base = lower(name, 2, 2, 3, virtual_stages=v)
    assert slice_counts_of(base, [3, 3]) is base
    with pytest.raises(ValueError, match="between 1 and 3 slices"):
        slice_counts_of(base, [4, 1])
    with pytest.raises(ValueError, match="each of the 2"):
        slice_counts_of(base, [1])

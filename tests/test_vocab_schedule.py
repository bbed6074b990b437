"""Tier a: the vocabulary passes (VF/VB collectives, and EF/EB of a split tied embedding) in the schedule IR:
placement, one order, no deadlock."""

from __future__ import annotations

import itertools

import pytest

from ds_terapipe.planner.schedule import (Action, ActionKind, DeadlockError, ScheduleError, build_schedule,
                                          replay, schedule_from_strings, stream_strings, validate)
from ds_terapipe.planner.vocab import add_vocab_passes, vocab_schedule


def test_action_round_trip() -> None:
    for text in ("1VF0.2", "0VB3.0", "2EF1.0", "0EB0.3"):
        assert str(Action.parse(text)) == text
    assert Action.parse("2VF1.0").is_collective and not Action.parse("2F1.0").is_collective
    assert Action.parse("2VF1.0").kind is ActionKind.VOCAB_F


# (schedule, chunks per rank, largest p of the grid): one chunk per rank, looped placements, the V of dualpipev
GRID = [("gpipe", 1, 5), ("1f1b", 1, 5), ("interleaved-1f1b", 2, 4), ("interleaved-1f1b", 3, 3),
        ("looped-bfs", 2, 4), ("looped-bfs", 3, 3), ("dualpipev", 2, 4)]


@pytest.mark.parametrize("name, v, max_p", GRID)
@pytest.mark.parametrize("deferred", [False, True])
@pytest.mark.parametrize("embedding", [False, True])
def test_grid_validates_and_replays(name: str, v: int, max_p: int, deferred: bool, embedding: bool) -> None:
    for stages, micro, slices in itertools.product(range(1, max_p + 1), range(1, 5), range(1, 5)):
        sched = vocab_schedule(name, stages, micro, slices, deferred, embedding=embedding, virtual_stages=v)
        assert sched.num_chunks == stages * v
        validate(sched)
        replay(sched)
        colls = [[(a.kind, a.microbatch, a.slice) for a in st if a.is_collective] for st in sched.stages]
        assert all(c == colls[0] for c in colls), (name, stages, micro, slices)
        assert len(colls[0]) == (4 if embedding else 2) * micro * slices
        # each rank writes VF/VB with its last chunk, EF/EB with its first
        for r, st in enumerate(sched.stages):
            mine = sched.chunks_of(r)
            assert all(a.chunk == (mine[0] if a.kind in (ActionKind.VOCAB_EMBED_F, ActionKind.VOCAB_EMBED_B)
                                   else mine[-1]) for a in st if a.is_collective), (name, stages, r)
        last_chunk = sched.num_chunks - 1
        last, first = sched.stages[sched.rank_of(last_chunk)], sched.stages[sched.rank_of(0)]
        for p, a in enumerate(last):
            if a.kind is ActionKind.FORWARD and a.chunk == last_chunk:  # VF right after the last chunk's forward
                assert Action(last_chunk, ActionKind.VOCAB_F, a.microbatch, a.slice) in _next_collectives(last, p, 1)
            if a.kind is ActionKind.BACKWARD and a.chunk == last_chunk:  # VB right before its backward
                assert Action(last_chunk, ActionKind.VOCAB_B, a.microbatch, a.slice) in \
                    _next_collectives(last, p, -1)
        kinds = {a.kind for a in first}
        assert (ActionKind.VOCAB_EMBED_F in kinds) == embedding and (ActionKind.VOCAB_EMBED_B in kinds) == embedding
        for p, a in enumerate(first if embedding else ()):
            if a.kind is ActionKind.FORWARD and a.chunk == 0:  # EF right before chunk 0's forward
                assert Action(0, ActionKind.VOCAB_EMBED_F, a.microbatch, a.slice) in _next_collectives(first, p, -1)
            if a.kind is ActionKind.BACKWARD and a.chunk == 0:  # EB right after its backward
                assert Action(0, ActionKind.VOCAB_EMBED_B, a.microbatch, a.slice) in _next_collectives(first, p, 1)


def _next_collectives(stream: tuple, p: int, step: int) -> list:
    """The collectives next to position p (after it: step 1, before it: -1), up to the next other action. Anchors
    of the first and last ranks at one dry-run step share a gap: e.g. EB after rank 0's B and VF after the last
    rank's F are both in it, in one order on every rank, so one of them is not adjacent to its anchor."""
    out = []
    p += step
    while 0 <= p < len(stream) and stream[p].is_collective:
        out.append(stream[p])
        p += step
    return out


@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2),
                                     ("dualpipev", 2)])
def test_runtime_lowering_loads_before_the_first_embedding_pass(name: str, v: int) -> None:
    """The first stage reads a micro-batch's token ids in its first EF: the load comes right before it; the
    rank of the last chunk still loads (labels) before its forward (under dualpipev it is rank 0, whose EF comes
    first); every rank's instructions carry the passes."""
    from deepspeed.runtime.pipe import schedule as ds_schedule

    from ds_terapipe.runtime.execution.schedule import TokenPipeSchedule, VocabEmbedBackwardPass, VocabEmbedForwardPass

    for stages in (1, 2, 3):
        for rank in range(stages):
            lowered = TokenPipeSchedule(name, 3, stages, rank, 2, vocab_parallel=True, vocab_embedding=True,
                                        virtual_stages=v)
            steps = [c for cmds in lowered.steps() for c in cmds]
            loads = [p for p, c in enumerate(steps) if isinstance(c, ds_schedule.LoadMicroBatch)]
            readers = {lowered.schedule.rank_of(0), lowered.schedule.rank_of(lowered.schedule.num_chunks - 1)}
            assert len(loads) == (3 if rank in readers else 0)
            for p in loads:
                nxt = steps[p + 1]
                want = VocabEmbedForwardPass if rank == 0 else ds_schedule.ForwardPass
                assert isinstance(nxt, want) and nxt.microbatch == steps[p].microbatch and nxt.slice_index == 0
            assert sum(isinstance(c, VocabEmbedForwardPass) for c in steps) == 6
            assert sum(isinstance(c, VocabEmbedBackwardPass) for c in steps) == 6


def test_forward_only_has_no_backward_pass() -> None:
    from ds_terapipe.planner.lowering import forward_only

    sched = add_vocab_passes(forward_only(build_schedule("1f1b", 3, 2, 3)))
    replay(sched)  # (validate wants every B: a forward-only schedule is the runtime's, not a training one)
    assert {a.kind for st in sched.stages for a in st if a.is_collective} == {ActionKind.VOCAB_F}


def test_dualpipev_anchors_on_rank_0() -> None:
    """Under the V placement the last chunk and chunk 0 are both on rank 0: VF/VB and EF/EB all anchor there,
    and a VB moved behind the last chunk's B (or an EF behind chunk 0's F) is refused, naming the chunk."""
    sched = vocab_schedule("dualpipev", 2, 1, 1, embedding=True)
    lines = list(stream_strings(sched))
    assert lines[0] == ("0EF0.0 0F0.0 0SEND_F0.0 3RECV_F0.0 3F0.0 3VF0.0 3VB0.0 3B0.0 3SEND_B0.0 0RECV_B0.0 0B0.0 "
                        "0EB0.0"), lines
    assert lines[1] == "1EF0.0 1RECV_F0.0 1F0.0 2F0.0 2SEND_F0.0 2VF0.0 2VB0.0 2RECV_B0.0 2B0.0 1B0.0 1SEND_B0.0 1EB0.0"
    place = sched.placement

    def rebuilt(first: str) -> object:
        return schedule_from_strings("dualpipev", 1, 1, [first, lines[1]], virtual_stages=2, placement=place)

    with pytest.raises(ScheduleError, match="3B0.0 at position 6 runs before 3VB0.0, whose hidden-state gradient"):
        validate(rebuilt(lines[0].replace("3VB0.0 3B0.0", "3B0.0 3VB0.0")))
    with pytest.raises(ScheduleError, match="0F0.0 at position 0 runs before 0EF0.0, the embedding it starts from"):
        validate(rebuilt(lines[0].replace("0EF0.0 0F0.0", "0F0.0 0EF0.0")))
    with pytest.raises(ScheduleError, match="written with chunk 0; rank 0 writes VF with its chunk 3"):
        validate(rebuilt(lines[0].replace("3VF0.0", "0VF0.0")))


def test_collective_order_across_chunks_is_checked() -> None:
    """interleaved-1f1b at p=2, v=2: swapping two of rank 0's vocabulary passes deadlocks or mis-orders."""
    lines = list(stream_strings(vocab_schedule("interleaved-1f1b", 2, 2, 2, virtual_stages=2)))
    assert "2VF0.0" in lines[0] and "3VF0.0" in lines[1]
    swapped = lines[0].replace("2VF0.0", "X").replace("2VF0.1", "2VF0.0").replace("X", "2VF0.1")
    bad = schedule_from_strings("interleaved-1f1b", 2, 2, [swapped, lines[1]], virtual_stages=2)
    with pytest.raises(ScheduleError, match="collective #"):
        validate(bad)


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


def test_embedding_anchors_are_checked() -> None:
    """EF after the first stage's forward (it would start without its embedding), EB before its backward (no
    gradient yet): both refused; a missing EB too."""
    lines = list(stream_strings(vocab_schedule("gpipe", 2, 1, 1, embedding=True)))
    assert lines[0] == "0EF0.0 0F0.0 0SEND_F0.0 0VF0.0 0VB0.0 0RECV_B0.0 0B0.0 0EB0.0", lines
    late = lines[0].replace("0EF0.0 0F0.0", "0F0.0 0EF0.0")
    with pytest.raises(ScheduleError, match="embedding it starts from"):
        validate(schedule_from_strings("gpipe", 1, 1, [late, lines[1]]))
    early = lines[0].replace("0B0.0 0EB0.0", "0EB0.0 0B0.0")
    with pytest.raises(ScheduleError, match="embedding-output gradient"):
        validate(schedule_from_strings("gpipe", 1, 1, [early, lines[1]]))
    missing = [line.replace(f" {r}EB0.0", "") for r, line in enumerate(lines)]
    with pytest.raises(ScheduleError, match="0EB0.0 is missing"):
        validate(schedule_from_strings("gpipe", 1, 1, missing))


def test_missing_anchor_is_refused() -> None:
    lines = list(stream_strings(vocab_schedule("gpipe", 2, 1, 1)))
    # the last rank's VB after its B: B would start without the hidden-state gradient
    moved = lines[1].replace("1VB0.0 1B0.0", "1B0.0 1VB0.0")
    with pytest.raises(ScheduleError, match="hidden-state gradient"):
        validate(schedule_from_strings("gpipe", 1, 1, [lines[0], moved]))

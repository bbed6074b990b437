"""The DeepSpeed instruction streams TokenPipeSchedule yields pair their sends and receives, rank by rank.

Each rank's instructions are mapped back to planner actions and the whole set of streams is replayed with the
runtime's semantics (non-blocking sends, blocking receives, FIFO pairing per channel): no schedule can deadlock
or deliver a tensor to the wrong (micro-batch, slice).
"""

from __future__ import annotations

import itertools

import pytest
from deepspeed.runtime.pipe import schedule as ds

from ds_terapipe.planner.schedule import (Action, ActionKind, PairingError, Schedule, ScheduleError,
                                         add_communication, build_schedule, replay)
from ds_terapipe.planner.lowering import forward_only
from ds_terapipe.runtime.execution.schedule import TokenPipeSchedule, WeightGradPass

KIND = {ds.ForwardPass: ActionKind.FORWARD, ds.BackwardPass: ActionKind.BACKWARD,
        ds.SendActivation: ActionKind.SEND_F, ds.RecvActivation: ActionKind.RECV_F,
        ds.SendGrad: ActionKind.SEND_B, ds.RecvGrad: ActionKind.RECV_B}


def lowered(name: str, stages: int, micro: int, slices: int, train: bool) -> tuple[Schedule, list[list]]:
    streams, raw = [], []
    for stage in range(stages):
        sched = TokenPipeSchedule(name, micro, stages, stage, slices, train=train)
        cmds = [cmd for step in sched for cmd in step]
        raw.append(cmds)
        streams.append(tuple(Action(stage, KIND[type(c)], c.microbatch, c.slice_index)
                             for c in cmds if type(c) in KIND))
    return Schedule(name=name, num_stages=stages, num_microbatches=micro, num_slices=slices,
                    stages=tuple(streams)), raw


GRID = list(itertools.product(["gpipe", "1f1b"], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 4, 5]))


@pytest.mark.parametrize("name,stages,micro,slices", GRID)
def test_streams_replay_and_pair(name: str, stages: int, micro: int, slices: int) -> None:
    for train in (True, False):
        schedule, raw = lowered(name, stages, micro, slices, train)
        replay(schedule)
        # the lowering keeps the planner's order, action for action, and adds nothing else that pairs
        plan = build_schedule(name, stages, micro, slices)
        assert schedule.stages == add_communication(plan if train else forward_only(plan)).stages
        for stage, cmds in enumerate(raw):
            forwards = [c for c in cmds if isinstance(c, ds.ForwardPass)]
            assert len(forwards) == micro * slices
            assert len([c for c in cmds if isinstance(c, ds.BackwardPass)]) == (micro * slices if train else 0)
            loads = [c.microbatch for c in cmds if isinstance(c, ds.LoadMicroBatch)]
            first_or_last = stage in (0, stages - 1)
            assert loads == (list(range(micro)) if first_or_last else [])
            # buffer ids are unique per unit
            assert len({c.buffer_id for c in forwards}) == micro * slices
            tail = [type(c) for c in cmds[-4:]]
            if train:
                assert tail == [ds.CommitP2P, ds.ReduceTiedGrads, ds.ReduceGrads, ds.OptimizerStep]
            else:
                assert ds.OptimizerStep not in [type(c) for c in cmds]


def test_backward_order_is_later_slices_first() -> None:
    _, raw = lowered("1f1b", 3, 3, 4, True)
    for cmds in raw:
        seen: dict[int, list[int]] = {}
        for c in cmds:
            if isinstance(c, ds.BackwardPass):
                seen.setdefault(c.microbatch, []).append(c.slice_index)
        assert all(order == sorted(order, reverse=True) for order in seen.values()), seen


def test_a_reordered_stream_is_caught() -> None:
    schedule, _ = lowered("gpipe", 2, 2, 2, True)
    stage1 = list(schedule.stages[1])
    # receive the second slice's activations before the first's: a mismatched pairing or a deadlock
    i = stage1.index(Action(1, ActionKind.RECV_F, 0, 0))
    j = stage1.index(Action(1, ActionKind.RECV_F, 0, 1))
    stage1[i], stage1[j] = stage1[j], stage1[i]
    broken = Schedule(name="broken", num_stages=2, num_microbatches=2, num_slices=2,
                      stages=(schedule.stages[0], tuple(stage1)))
    with pytest.raises(PairingError) as info:  # found from the streams alone, before anything runs
        replay(broken)
    assert type(info.value) is PairingError and issubclass(PairingError, ScheduleError)
    assert info.value.violations == (
        "channel 0->1: receive #0 1RECV_F0.1 (rank 1, position 0) is paired with send #0 0SEND_F0.0 (rank 0, "
        "position 1); FIFO delivery would hand unit 0.0 to 1RECV_F0.1. Make both ranks use the same unit order",)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_deferred_weight_grads_lower_to_weight_passes_after_the_sends(name: str) -> None:
    from ds_terapipe.runtime.execution.schedule import WeightGradPass

    stages, micro, slices = 3, 2, 3
    per_slice = name == "1f1b"  # the default placement (planner.schedule.WEIGHTS_PER_SLICE)
    for stage in range(stages):
        sched = TokenPipeSchedule(name, micro, stages, stage, slices, train=True, deferred_weight_grads=True)
        cmds = [cmd for step in sched for cmd in step]
        passes = [i for i, c in enumerate(cmds) if isinstance(c, WeightGradPass)]
        expected = [(b, i) for b in range(micro) for i in reversed(range(slices)) if per_slice or i == 0]
        assert [(cmds[i].microbatch, cmds[i].slice_index) for i in passes] == expected
        for i in passes:
            before = cmds[i - 1]
            # right after the backward it follows and, except on stage 0, after its gradient was sent on
            assert isinstance(before, ds.SendGrad if stage > 0 else ds.BackwardPass)
            assert (before.microbatch, before.slice_index) == (cmds[i].microbatch, cmds[i].slice_index)
        evaluation = TokenPipeSchedule(name, micro, stages, stage, slices, train=False, deferred_weight_grads=True)
        assert not any(isinstance(c, WeightGradPass) for step in evaluation for c in step)


def _instr(text: str, stage: int) -> tuple[str, dict[str, int]]:
    """``"F 0.1"`` on stage s -> ("ForwardPass", {buffer_id: 1, microbatch: 0, slice_index: 1, chunk: s}); ``"L 1"``:
    load micro-batch 1."""
    names = {"F": "ForwardPass", "B": "BackwardPass", "SA": "SendActivation", "RA": "RecvActivation",
             "SG": "SendGrad", "RG": "RecvGrad", "W": "WeightGradPass"}
    kind, *rest = text.split()
    if kind == "L":
        return "LoadMicroBatch", {"buffer_id": int(rest[0]), "microbatch": int(rest[0])}
    if not rest:
        return kind, {}
    micro, slice_ = (int(v) for v in rest[0].split("."))
    return names[kind], {"buffer_id": micro * 2 + slice_, "microbatch": micro, "slice_index": slice_, "chunk": stage}


TAIL = ["CommitP2P", "ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
# 1f1b, 2 stages, 2 micro-batches of 2 slices: unit (b, i) in buffer 2b+i; loads before a micro-batch's first
# forward (after its receive on the last stage); stage 0 runs 3 warm-up forwards, stage 1 alternates per unit.
GOLDEN_1F1B_2x2x2 = (
    ["L 0", "F 0.0", "SA 0.0", "F 0.1", "SA 0.1", "L 1", "F 1.0", "SA 1.0", "RG 0.1", "B 0.1", "F 1.1", "SA 1.1",
     "RG 0.0", "B 0.0", "RG 1.1", "B 1.1", "RG 1.0", "B 1.0", *TAIL],
    ["RA 0.0", "L 0", "F 0.0", "RA 0.1", "F 0.1", "B 0.1", "SG 0.1", "B 0.0", "SG 0.0", "RA 1.0", "L 1", "F 1.0",
     "RA 1.1", "F 1.1", "B 1.1", "SG 1.1", "B 1.0", "SG 1.0", *TAIL],
)


def test_golden_instruction_streams() -> None:
    """The exact DeepSpeed instructions, fields included, each rank runs for one small 1f1b step."""
    for stage, golden in enumerate(GOLDEN_1F1B_2x2x2):
        sched = TokenPipeSchedule("1f1b", 2, 2, stage, 2, train=True)
        got = [(type(c).__name__, dict(c.kwargs)) for step in sched for c in step]
        assert got == [_instr(t, stage) for t in golden], f"stage {stage}: {[repr(c) for step in sched for c in step]}"


@pytest.mark.parametrize("name,v", [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("looped-bfs", 2),
                                    ("dualpipev", 2), ("zbv", 2)])
@pytest.mark.parametrize("stages,micro,slices", [(2, 1, 1), (2, 2, 3), (3, 4, 2), (4, 8, 1)])
def test_virtual_stage_instructions(name: str, v: int, stages: int, micro: int, slices: int) -> None:
    """Several chunks per rank: every instruction names its chunk; each (chunk, unit) has its own buffer; a
    micro-batch is loaded once, in order, only on the ranks holding the first or last chunk, before the first
    forward that reads it; evaluation runs forwards only, and both streams replay without deadlock."""
    placement = build_schedule(name, stages, micro, slices, virtual_stages=v).placement
    for train in (True, False):
        streams = []
        for stage in range(stages):
            sched = TokenPipeSchedule(name, micro, stages, stage, slices, train=train, virtual_stages=v)
            assert sched.chunks == tuple(c for c, r in enumerate(placement) if r == stage)
            cmds = [c for step in sched for c in step]
            units = [c for c in cmds if "chunk" in c.kwargs]
            assert all(placement[c.chunk] == stage for c in units)
            by_buffer: dict[int, tuple] = {}
            for c in units:
                assert by_buffer.setdefault(c.buffer_id, (c.chunk, c.microbatch, c.slice_index)) == \
                    (c.chunk, c.microbatch, c.slice_index)
                assert 0 <= c.buffer_id < sched.num_pipe_buffers()
            loads = [i for i, c in enumerate(cmds) if isinstance(c, ds.LoadMicroBatch)]
            reads_data = {0, len(placement) - 1} & set(sched.chunks)
            assert [cmds[i].microbatch for i in loads] == (list(range(micro)) if reads_data else [])
            for i in loads:
                first_read = next(c for c in cmds if isinstance(c, ds.ForwardPass) and c.chunk in reads_data
                                  and c.microbatch == cmds[i].microbatch)
                assert cmds.index(first_read) > i
            if not train:
                assert not any(isinstance(c, (ds.BackwardPass, WeightGradPass)) for c in cmds)
            streams.append(sched.actions)
        replay(sched.schedule)


def test_a_backward_before_its_later_slices_is_a_schedule_error_naming_the_rule_and_the_fix() -> None:
    """The engine's runtime guard of the later-slices-first rule: a schedule (a custom one, or a builder's bug) that
    orders a micro-batch's backwards otherwise would read keys and values whose gradients never arrived. A
    ``ScheduleError`` (not an ``assert``): it stays under ``python -O``."""
    from types import SimpleNamespace

    from ds_terapipe.runtime.execution.engine import TokenPipelineEngine

    # the parts of an engine the check reads: slice 2 of 3 done, slice 1 not yet, micro-batch 1 on chunk 0
    engine = SimpleNamespace(_states={(0, 1): SimpleNamespace(backward_done={2}, num_slices=3)}, num_slices=3,
                             running=SimpleNamespace(schedule=SimpleNamespace(name="custom")))
    with pytest.raises(ScheduleError) as err:
        TokenPipelineEngine._exec_backward_pass(engine, 0, microbatch=1, slice_index=0, chunk=0)
    message = str(err.value)
    assert "schedule 'custom' runs the backward of slice 0 of micro-batch 1 on chunk 0 before its later slices [1]" \
        in message, message
    assert "last slice first (2 down to 0)" in message and "validate(schedule)" in message, message
    assert err.value.violations == ("0B1.0 before 0B1.1",)

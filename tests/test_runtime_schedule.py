"""The DeepSpeed instruction streams TokenPipeSchedule yields pair their sends and receives, rank by rank.

Each rank's instructions are mapped back to planner actions and the whole set of streams is replayed with the
runtime's semantics (non-blocking sends, blocking receives, FIFO pairing per channel): no schedule can deadlock
or deliver a tensor to the wrong (micro-batch, slice).
"""

from __future__ import annotations

import itertools

import pytest
from deepspeed.runtime.pipe import schedule as ds

from ds_terapipe.planner.schedule import Action, ActionKind, DeadlockError, Schedule, replay
from ds_terapipe.runtime.schedule import TokenPipeSchedule

KIND = {ds.ForwardPass: ActionKind.FORWARD, ds.BackwardPass: ActionKind.BACKWARD,
        ds.SendActivation: ActionKind.SEND_F, ds.RecvActivation: ActionKind.RECV_F,
        ds.SendGrad: ActionKind.SEND_B, ds.RecvGrad: ActionKind.RECV_B}


def lowered(name: str, stages: int, micro: int, slices: int, train: bool) -> tuple[Schedule, list[list]]:
    streams, raw = [], []
    for stage in range(stages):
        sched = TokenPipeSchedule(name, micro, stages, stage, slices, train=train)
        cmds = [cmd for step in sched for cmd in step]
        raw.append(cmds)
        streams.append(tuple(Action(stage, KIND[type(c)], c.microbatch, c.slice_index) for c in cmds if type(c) in KIND))
    return Schedule(name=name, num_stages=stages, num_microbatches=micro, num_slices=slices,
                    stages=tuple(streams)), raw


GRID = list(itertools.product(["gpipe", "1f1b"], [1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 4, 5]))


@pytest.mark.parametrize("name,stages,micro,slices", GRID)
def test_streams_replay_and_pair(name: str, stages: int, micro: int, slices: int) -> None:
    for train in (True, False):
        schedule, raw = lowered(name, stages, micro, slices, train)
        result = replay(schedule)
        assert result.num_steps > 0
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
    with pytest.raises(DeadlockError.__mro__[1]) as info:  # ScheduleError: PairingError or DeadlockError
        replay(broken)
    assert "1RECV_F0.1" in str(info.value) or "1RECV_F0.0" in str(info.value)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_deferred_weight_grads_lower_to_weight_passes_after_the_sends(name: str) -> None:
    from ds_terapipe.runtime.schedule import WeightGradPass

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

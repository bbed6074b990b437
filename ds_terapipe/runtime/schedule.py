"""TokenPipeSchedule: lowers the planner's schedule IR to DeepSpeed pipeline instructions.

The planner (:mod:`ds_terapipe.planner.schedule`) says, per stage, in which order the forward and backward
of every (micro-batch, slice) unit run, with communication derived by ``add_communication``. This class turns
one stage's action list into DeepSpeed's own instruction types (``ForwardPass``, ``SendActivation``, ...)
carrying two extra fields, ``microbatch`` and ``slice_index``, which :class:`TokenPipelineEngine`'s handlers read.
Because every rank lowers the same validated schedule, the sends and receives of neighbouring ranks pair up
by construction (checked by ``replay`` in the tests).

Buffer ids: unit (b, i) uses pipe buffer ``b * num_slices + i``; a micro-batch is loaded once, before the
forward of its slice 0, on the first and last stages. A ``W`` action (deferred weight gradients of a micro-batch,
slice 0, or of one slice) becomes :class:`WeightGradPass` with the same micro-batch and slice.
"""

from __future__ import annotations

from typing import Iterator

from deepspeed.runtime.pipe import schedule as ds_schedule

from ..planner.registry import get_schedule
from ..planner.schedule import Action, ActionKind, Schedule, add_communication, build_schedule

__all__ = ["TokenPipeSchedule", "forward_only"]


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, in its order (evaluation: no backward, nothing kept for it)."""
    stages = tuple(tuple(a for a in acts if a.kind == ActionKind.FORWARD) for acts in schedule.stages)
    return Schedule(name=f"{schedule.name}-forward", num_stages=schedule.num_stages,
                    num_microbatches=schedule.num_microbatches, num_slices=schedule.num_slices, stages=stages)


class WeightGradPass(ds_schedule.PipeInstruction):
    """Compute the deferred weight gradients recorded so far: a micro-batch's (slice 0, after all its
    backwards) or one slice's (when the schedule has a W per slice)."""


def require_one_chunk_per_rank(name: str) -> None:
    """Refuse a schedule that places several chunks per rank (virtual stages): the planner builds, validates and
    simulates them, but the engine runs one chunk per rank. Called by the config at parse time (every rank, before
    any step) and by :class:`TokenPipeSchedule` for direct users."""
    if get_schedule(name).virtual_stages != 1:
        raise ValueError(f"terapipe.schedule={name!r} places several chunks per rank (virtual stages), which the "
                         "engine does not run yet; train with 'gpipe' or '1f1b', or plan and simulate it with "
                         f"'ds-terapipe simulate --schedule {name}'")


class TokenPipeSchedule(ds_schedule.PipeSchedule):
    """One stage's view of a token-level schedule, as DeepSpeed instructions.

    Args:
        name: a registered schedule name (``ds-terapipe schedules`` lists them).
        micro_batches, stages, stage_id: as in DeepSpeed's ``PipeSchedule``.
        num_slices: slices per micro-batch.
        train: with backward, gradient reduction and optimizer step; else forwards only.
        deferred_weight_grads: add ``W`` actions (:class:`WeightGradPass`) at the schedule's default placement
            (``planner.schedule.defer_weights``): gpipe one per micro-batch after its last backward, 1f1b one
            per slice after its backward.
    """

    def __init__(self, name: str, micro_batches: int, stages: int, stage_id: int, num_slices: int,
                 train: bool = True, deferred_weight_grads: bool = False) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.num_slices = num_slices
        self.train = train
        require_one_chunk_per_rank(name)
        plan = build_schedule(name, stages, micro_batches, num_slices, deferred_weight_grads and train,
                              virtual_stages=1)
        self.schedule = add_communication(plan if train else forward_only(plan))
        self.actions: tuple[Action, ...] = self.schedule.stages[stage_id]

    def num_pipe_buffers(self) -> int:
        return self.micro_batches * self.num_slices

    def unit_buffer(self, microbatch: int, slice_index: int) -> int:
        return microbatch * self.num_slices + slice_index

    def steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        loaded = -1
        for action in self.actions:
            fields = dict(buffer_id=self.unit_buffer(action.microbatch, action.slice), microbatch=action.microbatch,
                          slice_index=action.slice)
            cmds: list[ds_schedule.PipeInstruction] = []
            kind = action.kind
            if kind == ActionKind.FORWARD:
                if action.slice == 0 and (self.is_first_stage or self.is_last_stage):
                    assert action.microbatch == loaded + 1, "micro-batches must start in order to load in order"
                    loaded = action.microbatch
                    cmds.append(ds_schedule.LoadMicroBatch(buffer_id=action.microbatch,
                                                           microbatch=action.microbatch))
                cmds.append(ds_schedule.ForwardPass(**fields))
            elif kind == ActionKind.BACKWARD:
                cmds.append(ds_schedule.BackwardPass(**fields))
            elif kind == ActionKind.WEIGHT:
                cmds.append(WeightGradPass(**fields))
            elif kind == ActionKind.SEND_F:
                cmds.append(ds_schedule.SendActivation(**fields))
            elif kind == ActionKind.RECV_F:
                cmds.append(ds_schedule.RecvActivation(**fields))
            elif kind == ActionKind.SEND_B:
                cmds.append(ds_schedule.SendGrad(**fields))
            elif kind == ActionKind.RECV_B:
                cmds.append(ds_schedule.RecvGrad(**fields))
            else:  # pragma: no cover - the IR has no other kinds
                raise AssertionError(f"unknown action {action}")
            yield cmds
        tail: list[ds_schedule.PipeInstruction] = [ds_schedule.CommitP2P()]
        if self.train:
            tail += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
        yield tail

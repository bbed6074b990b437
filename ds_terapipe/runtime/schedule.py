"""TokenPipeSchedule: lowers the planner's schedule IR to DeepSpeed pipeline instructions.

The planner (:mod:`ds_terapipe.planner.schedule`) says, per stage, in which order the forward and backward
of every (micro-batch, slice) unit run, with communication derived by ``add_communication``. This class turns
one stage's action list into DeepSpeed's own instruction types (``ForwardPass``, ``SendActivation``, ...)
carrying two extra fields, ``microbatch`` and ``slice_index``, which :class:`TokenPipelineEngine`'s handlers read.
Because every rank lowers the same validated schedule, the sends and receives of neighbouring ranks pair up
by construction (checked by ``replay`` in the tests).

With virtual stages a rank runs several chunks: every instruction also carries ``chunk`` (the global chunk id),
and transfers between two chunks of one rank are no instructions at all (the engine hands them over in its
forward and backward). Buffer ids: unit (b, i) of the k-th local chunk uses pipe buffer ``(k * m + b) * n + i``;
a micro-batch is loaded once, before the first forward of its slice 0 on a chunk that needs data (the first
chunk: inputs; the last: labels), on the ranks that hold those chunks. A ``W`` action (deferred weight gradients
of a micro-batch, slice 0, or of one slice) becomes :class:`WeightGradPass` with the same fields.
"""

from __future__ import annotations

from typing import Iterator

from deepspeed.runtime.pipe import schedule as ds_schedule

from ..planner.schedule import Action, ActionKind, Schedule, add_communication, build_schedule
from ..planner.vocab import add_vocab_passes
from .freeze import freeze_lowered

__all__ = ["TokenPipeSchedule", "VocabBackwardPass", "VocabEmbedBackwardPass", "VocabEmbedForwardPass",
           "VocabForwardPass", "forward_only"]


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, in its order (evaluation: no backward, nothing kept for it)."""
    return schedule.compute_only().with_streams(
        f"{schedule.name}-forward", [[a for a in acts if a.kind == ActionKind.FORWARD] for acts in schedule.stages])


class WeightGradPass(ds_schedule.PipeInstruction):
    """Compute deferred weight gradients: a micro-batch's (slice 0, after all its backwards) or one slice's (when
    the schedule has a W per slice, wherever it placed it)."""


class VocabForwardPass(ds_schedule.PipeInstruction):
    """``VF``: this rank's shard of the output layer for one (micro-batch, slice) (``runtime/vocab.py``)."""


class VocabBackwardPass(ds_schedule.PipeInstruction):
    """``VB``: its backward: shard weight gradient, the hidden-state gradient reduced to the last stage."""


class VocabEmbedForwardPass(ds_schedule.PipeInstruction):
    """``EF``: the split input embedding of one (micro-batch, slice) (``runtime/vocab_embedding.py``)."""


class VocabEmbedBackwardPass(ds_schedule.PipeInstruction):
    """``EB``: its backward: each rank adds its rows' gradient from the embedding-output gradient."""


class TokenPipeSchedule(ds_schedule.PipeSchedule):
    """One stage's view of a token-level schedule, as DeepSpeed instructions.

    Args:
        name: a registered schedule name (``ds-terapipe schedules`` lists them).
        micro_batches, stages, stage_id: as in DeepSpeed's ``PipeSchedule``.
        num_slices: slices per micro-batch.
        virtual_stages: chunks per rank (placed by the schedule).
        train: with backward, gradient reduction and optimizer step; else forwards only.
        deferred_weight_grads: add ``W`` actions (:class:`WeightGradPass`) at the schedule's default placement
            (``planner.schedule.defer_weights``): gpipe one per micro-batch after its last backward, 1f1b one
            per slice after its backward.
        num_frozen_chunks: leading chunks whose layers are all frozen (``runtime/freeze.py``): they run forwards
            only and no gradient is sent to them.
        vocab_parallel: add the vocabulary passes ``VF``/``VB`` (:func:`~ds_terapipe.planner.vocab.add_vocab_passes`)
            as :class:`VocabForwardPass`/:class:`VocabBackwardPass`.
        vocab_embedding: with ``vocab_parallel``, add the split input embedding's passes ``EF``/``EB`` too
            (:class:`VocabEmbedForwardPass`/:class:`VocabEmbedBackwardPass`); the first stage loads a micro-batch
            before its first ``EF``, which reads its token ids.
    """

    def __init__(self, name: str, micro_batches: int, stages: int, stage_id: int, num_slices: int,
                 train: bool = True, deferred_weight_grads: bool = False, virtual_stages: int = 1,
                 num_frozen_chunks: int = 0, vocab_parallel: bool = False, vocab_embedding: bool = False) -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.num_slices = num_slices
        self.train = train
        plan = build_schedule(name, stages, micro_batches, num_slices, deferred_weight_grads and train,
                              virtual_stages=virtual_stages)
        self.schedule = freeze_lowered(plan, num_frozen_chunks) if train else add_communication(forward_only(plan))
        if vocab_parallel:
            self.schedule = add_vocab_passes(self.schedule, embedding=vocab_embedding)
        self.actions: tuple[Action, ...] = self.schedule.stages[stage_id]
        self.chunks: tuple[int, ...] = self.schedule.chunks_of(stage_id)
        self._local = {chunk: index for index, chunk in enumerate(self.chunks)}
        # The chunks that read the batch: the first (inputs) and the last (labels).
        self.data_chunks = frozenset({0, self.schedule.num_chunks - 1} & set(self.chunks))

    def num_pipe_buffers(self) -> int:
        return len(self.chunks) * self.micro_batches * self.num_slices

    def unit_buffer(self, chunk: int, microbatch: int, slice_index: int) -> int:
        return (self._local[chunk] * self.micro_batches + microbatch) * self.num_slices + slice_index

    def steps(self) -> Iterator[list[ds_schedule.PipeInstruction]]:
        loaded = -1
        for action in self.actions:
            fields = dict(buffer_id=self.unit_buffer(action.stage, action.microbatch, action.slice),
                          microbatch=action.microbatch, slice_index=action.slice, chunk=action.stage)
            cmds: list[ds_schedule.PipeInstruction] = []
            kind = action.kind
            # A micro-batch is loaded before the first action that reads it: the forward of its slice 0 on a
            # chunk that reads data, or the EF of its slice 0 where chunk 0 is (EF reads the token ids).
            reads = (kind == ActionKind.FORWARD and action.stage in self.data_chunks) or \
                (kind == ActionKind.VOCAB_EMBED_F and 0 in self.data_chunks)
            if reads and action.slice == 0 and action.microbatch > loaded:
                assert action.microbatch == loaded + 1, "micro-batches must start in order to load in order"
                loaded = action.microbatch
                cmds.append(ds_schedule.LoadMicroBatch(buffer_id=action.microbatch, microbatch=action.microbatch))
            if kind == ActionKind.FORWARD:
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
            elif kind == ActionKind.VOCAB_F:
                cmds.append(VocabForwardPass(**fields))
            elif kind == ActionKind.VOCAB_B:
                cmds.append(VocabBackwardPass(**fields))
            elif kind == ActionKind.VOCAB_EMBED_F:
                cmds.append(VocabEmbedForwardPass(**fields))
            elif kind == ActionKind.VOCAB_EMBED_B:
                cmds.append(VocabEmbedBackwardPass(**fields))
            else:  # pragma: no cover - the IR has no other kinds
                raise AssertionError(f"unknown action {action}")
            yield cmds
        tail: list[ds_schedule.PipeInstruction] = [ds_schedule.CommitP2P()]
        if self.train:
            tail += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
        yield tail

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

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

from deepspeed.runtime.pipe import schedule as ds_schedule

from ...planner.lowering import lower
from ...planner.schedule import Action, ActionKind, ScheduleError

__all__ = ["DISPATCH", "Dispatch", "ShardGather", "ShardReduceScatter", "ShardRelease", "TokenPipeSchedule",
           "VocabBackwardPass", "VocabEmbedBackwardPass", "VocabEmbedForwardPass", "VocabForwardPass", "WeightGradPass"]


class WeightGradPass(ds_schedule.PipeInstruction):
    """Compute deferred weight gradients: a micro-batch's (slice 0, after all its backwards) or one slice's (when
    the schedule has a W per slice, wherever it placed it)."""


class VocabForwardPass(ds_schedule.PipeInstruction):
    """``VF``: this rank's shard of the output layer for one (micro-batch, slice) (``runtime/features/vocab.py``)."""


class VocabBackwardPass(ds_schedule.PipeInstruction):
    """``VB``: its backward: shard weight gradient, the hidden-state gradient reduced to the last stage."""


class VocabEmbedForwardPass(ds_schedule.PipeInstruction):
    """``EF``: the split input embedding of one (micro-batch, slice) (``runtime/features/vocab_embedding.py``)."""


class VocabEmbedBackwardPass(ds_schedule.PipeInstruction):
    """``EB``: its backward: each rank adds its rows' gradient from the embedding-output gradient."""


class ShardGather(ds_schedule.PipeInstruction):
    """``AG``: all-gather a chunk's sharded parameters over the data-parallel replicas
    (``runtime/features/sharding.py``)."""


class ShardRelease(ds_schedule.PipeInstruction):
    """``RL``: free a chunk's gathered parameters after a forward-only run."""


class ShardReduceScatter(ds_schedule.PipeInstruction):
    """``RS``: reduce-scatter the run's gradients into the shards and free the gathered parameters."""


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
        num_frozen_chunks: leading chunks whose layers are all frozen (``runtime/features/freeze.py``): they run
        forwards
            only and no gradient is sent to them.
        vocab_parallel: add the vocabulary passes ``VF``/``VB`` (:func:`~ds_terapipe.planner.vocab.add_vocab_passes`)
            as :class:`VocabForwardPass`/:class:`VocabBackwardPass`.
        slice_counts: per micro-batch, its slices when micro-batches of the step differ in length (``num_slices``
            is their largest; planner/lowering.py drops the units a micro-batch does not have).
        shard_params, shard_prefetch, shard_release: add the sharding actions ``AG``/``RS``/``RL``
            (:class:`ShardGather`, ...) around each run of one chunk (``planner/sharding.py``).
        vocab_embedding: with ``vocab_parallel``, add the split input embedding's passes ``EF``/``EB`` too
            (:class:`VocabEmbedForwardPass`/:class:`VocabEmbedBackwardPass`); the first stage loads a micro-batch
            before its first ``EF``, which reads its token ids.
    """

    def __init__(self, name: str, micro_batches: int, stages: int, stage_id: int, num_slices: int,
                 train: bool = True, deferred_weight_grads: bool = False, virtual_stages: int = 1,
                 num_frozen_chunks: int = 0, vocab_parallel: bool = False, vocab_embedding: bool = False,
                 slice_counts: Optional[Sequence[int]] = None, shard_params: bool = False,
                 shard_prefetch: bool = True, shard_release: str = "run") -> None:
        super().__init__(micro_batches=micro_batches, stages=stages, stage_id=stage_id)
        self.num_slices = num_slices
        self.train = train
        self.schedule = lower(name, stages, micro_batches, num_slices, train=train,
                              deferred_weight_grads=deferred_weight_grads, virtual_stages=virtual_stages,
                              num_frozen_chunks=num_frozen_chunks, vocab_parallel=vocab_parallel,
                              vocab_embedding=vocab_embedding, slice_counts=slice_counts,
                              shard_params=shard_params, shard_prefetch=shard_prefetch,
                              shard_release=shard_release)
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
            fields = dict(buffer_id=self.unit_buffer(action.chunk, action.microbatch, action.slice),
                          microbatch=action.microbatch, slice_index=action.slice, chunk=action.chunk)
            cmds: list[ds_schedule.PipeInstruction] = []
            kind = action.kind
            # A micro-batch is loaded before the first action that reads it: the forward of its slice 0 on a
            # chunk that reads data, or the EF of its slice 0 where chunk 0 is (EF reads the token ids).
            reads = (kind == ActionKind.FORWARD and action.chunk in self.data_chunks) or \
                (kind == ActionKind.VOCAB_EMBED_F and 0 in self.data_chunks)
            if reads and action.slice == 0 and action.microbatch > loaded:
                assert action.microbatch == loaded + 1, "micro-batches must start in order to load in order"
                loaded = action.microbatch
                cmds.append(ds_schedule.LoadMicroBatch(buffer_id=action.microbatch, microbatch=action.microbatch))
            dispatch = DISPATCH.get(kind)
            if dispatch is None:
                raise ScheduleError(f"action {action} of schedule {self.schedule.name!r}: the engine has no "
                                    f"instruction for kind {kind.name}; add it to DISPATCH")
            cmds.append(dispatch.instruction(**fields))
            yield cmds
        tail: list[ds_schedule.PipeInstruction] = [ds_schedule.CommitP2P()]
        if self.train:
            tail += [ds_schedule.ReduceTiedGrads(), ds_schedule.ReduceGrads(), ds_schedule.OptimizerStep()]
        yield tail


@dataclass(frozen=True)
class Dispatch:
    """How the engine runs one kind of action: the instruction it becomes, the engine method that executes it,
    and whether its span is recorded in the timeline (compute actions, whose times re-planning refits)."""

    instruction: type
    handler: str
    timed: bool = False


#: Every action kind the IR has, to its instruction and handler: the one table the lowering (here), the engine's
#: dispatch (``TokenPipelineEngine._INSTRUCTION_MAP``) and its timeline read. A kind missing here is refused.
DISPATCH: dict[ActionKind, Dispatch] = {
    ActionKind.FORWARD: Dispatch(ds_schedule.ForwardPass, "_exec_forward_pass", timed=True),
    ActionKind.BACKWARD: Dispatch(ds_schedule.BackwardPass, "_exec_backward_pass", timed=True),
    ActionKind.WEIGHT: Dispatch(WeightGradPass, "_exec_weight_grad_pass", timed=True),
    ActionKind.SEND_F: Dispatch(ds_schedule.SendActivation, "_exec_send_activations"),
    ActionKind.RECV_F: Dispatch(ds_schedule.RecvActivation, "_exec_recv_activations"),
    ActionKind.SEND_B: Dispatch(ds_schedule.SendGrad, "_exec_send_grads"),
    ActionKind.RECV_B: Dispatch(ds_schedule.RecvGrad, "_exec_recv_grads"),
    ActionKind.VOCAB_F: Dispatch(VocabForwardPass, "_exec_vocab_forward"),
    ActionKind.VOCAB_B: Dispatch(VocabBackwardPass, "_exec_vocab_backward"),
    ActionKind.VOCAB_EMBED_F: Dispatch(VocabEmbedForwardPass, "_exec_vocab_embed_forward"),
    ActionKind.VOCAB_EMBED_B: Dispatch(VocabEmbedBackwardPass, "_exec_vocab_embed_backward"),
    ActionKind.GATHER: Dispatch(ShardGather, "_exec_shard_gather"),
    ActionKind.RELEASE: Dispatch(ShardRelease, "_exec_shard_release"),
    ActionKind.REDUCE_SCATTER: Dispatch(ShardReduceScatter, "_exec_shard_reduce_scatter"),
}

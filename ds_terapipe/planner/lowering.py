"""The one lowering: a registered schedule and the run's sizes to the schedule every rank executes.

Why one function: the engine's instruction stream, the re-planner's and the freezer's predictions and the
tests must all see the same schedule for the same run, or a prediction describes a schedule nobody runs. Every
caller goes through :func:`lower`: the registered schedule built for (ranks, micro-batches, slices, chunks per
rank), deferred weight gradients when training, then for training the frozen chunks' backward removed
(:func:`~ds_terapipe.planner.freeze.freeze_lowered`, which also adds the p2p actions), for evaluation the forwards
alone, then the vocabulary passes (:func:`~ds_terapipe.planner.vocab.add_vocab_passes`). A step whose
micro-batches have different slice counts runs the schedule of the largest with the missing units removed.
"""

from __future__ import annotations

from typing import Optional, Sequence

from .freeze import freeze_lowered
from .schedule import ActionKind, Schedule, add_communication, build_schedule
from .sharding import add_shard_actions
from .vocab import add_vocab_passes

__all__ = ["forward_only", "lower", "slice_counts_of"]


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, in its order (evaluation: no backward, nothing kept for it)."""
    return schedule.compute_only().with_streams(
        f"{schedule.name}-forward", [[a for a in acts if a.kind == ActionKind.FORWARD] for acts in schedule.stages])


def slice_counts_of(schedule: Schedule, counts: Sequence[int]) -> Schedule:
    """``schedule`` with micro-batch ``b``'s actions of slices ``counts[b]`` and later removed (a step whose
    micro-batches have different lengths, each its own slicing).

    Why it stays correct: removing every action of a unit, on every rank, removes its nodes and their edges from
    the dependency graph, and the per-rank orders restricted to the rest are still consistent with what is left
    (any order that ran the whole schedule, restricted, runs this one), so no rank can wait on an action that no
    longer comes. A W per micro-batch (slice 0) stays with its micro-batch."""
    counts = tuple(int(c) for c in counts)
    if len(counts) != schedule.num_microbatches or not all(1 <= c <= schedule.num_slices for c in counts):
        raise ValueError(f"slice counts {list(counts)} must give each of the {schedule.num_microbatches} "
                         f"micro-batches between 1 and {schedule.num_slices} slices")
    if all(c == schedule.num_slices for c in counts):
        return schedule
    return schedule.with_streams(f"{schedule.name}-slices{'-'.join(map(str, counts))}",
                                 [[a for a in stream if a.slice < counts[a.microbatch]] for stream in schedule.stages])


def lower(name: str, num_ranks: int, micro_batches: int, num_slices: int, *, train: bool = True,
          deferred_weight_grads: bool = False, virtual_stages: int = 1, num_frozen_chunks: int = 0,
          vocab_parallel: bool = False, vocab_embedding: bool = False,
          slice_counts: Optional[Sequence[int]] = None, shard_params: bool = False,
          shard_prefetch: bool = True, shard_release: str = "run") -> Schedule:
    """The executed schedule (compute, p2p and vocabulary collectives) of one training or evaluation batch.

    Args:
        name: a registered schedule.
        num_ranks: pipeline ranks; ``virtual_stages`` chunks each.
        micro_batches, num_slices: units per step: micro-batches x slices of each.
        train: with backwards (and W when ``deferred_weight_grads``); else the forwards alone.
        num_frozen_chunks: leading chunks whose layers are all frozen: forward only, no gradient into them.
        vocab_parallel, vocab_embedding: add ``VF``/``VB`` (and ``EF``/``EB`` for a split input embedding).
        slice_counts: per micro-batch, its slices (``num_slices`` is then their largest): micro-batches of
            different lengths in one step (:func:`slice_counts_of`).
        shard_params: add sharded data parallelism's ``AG``/``RS``/``RL`` around each rank's runs of one chunk
            (:func:`~ds_terapipe.planner.sharding.add_shard_actions`; ``shard_prefetch``: gather one run ahead;
            ``shard_release``: free a chunk after each run, or after its last of the step).
    """
    plan = build_schedule(name, num_ranks, micro_batches, num_slices, deferred_weight_grads and train,
                          virtual_stages=virtual_stages)
    if slice_counts is not None:
        plan = slice_counts_of(plan, slice_counts)
    schedule = freeze_lowered(plan, num_frozen_chunks) if train else add_communication(forward_only(plan))
    if vocab_parallel:
        schedule = add_vocab_passes(schedule, embedding=vocab_embedding)
    if shard_params:
        schedule = add_shard_actions(schedule, prefetch=shard_prefetch, release=shard_release)
    return schedule

"""The one lowering: a registered schedule and the run's sizes to the schedule every rank executes.

Why one function: the engine's instruction stream, the re-planner's and the freezer's predictions and the
tests must all see the same schedule for the same run, or a prediction describes a schedule nobody runs. Every
caller goes through :func:`lower`: the registered schedule built for (ranks, micro-batches, slices, chunks per
rank), deferred weight gradients when training, then for training the frozen chunks' backward removed
(:func:`~ds_terapipe.planner.freeze.freeze_lowered`, which also adds the p2p actions), for evaluation the forwards
alone, then the vocabulary passes (:func:`~ds_terapipe.planner.vocab.add_vocab_passes`).
"""

from __future__ import annotations

from .freeze import freeze_lowered
from .schedule import ActionKind, Schedule, add_communication, build_schedule
from .vocab import add_vocab_passes

__all__ = ["forward_only", "lower"]


def forward_only(schedule: Schedule) -> Schedule:
    """The forwards of ``schedule`` alone, in its order (evaluation: no backward, nothing kept for it)."""
    return schedule.compute_only().with_streams(
        f"{schedule.name}-forward", [[a for a in acts if a.kind == ActionKind.FORWARD] for acts in schedule.stages])


def lower(name: str, num_ranks: int, micro_batches: int, num_slices: int, *, train: bool = True,
          deferred_weight_grads: bool = False, virtual_stages: int = 1, num_frozen_chunks: int = 0,
          vocab_parallel: bool = False, vocab_embedding: bool = False) -> Schedule:
    """The executed schedule (compute, p2p and vocabulary collectives) of one training or evaluation batch.

    Args:
        name: a registered schedule.
        num_ranks: pipeline ranks; ``virtual_stages`` chunks each.
        micro_batches, num_slices: units per step: micro-batches x slices of each.
        train: with backwards (and W when ``deferred_weight_grads``); else the forwards alone.
        num_frozen_chunks: leading chunks whose layers are all frozen: forward only, no gradient into them.
        vocab_parallel, vocab_embedding: add ``VF``/``VB`` (and ``EF``/``EB`` for a split input embedding).
    """
    plan = build_schedule(name, num_ranks, micro_batches, num_slices, deferred_weight_grads and train,
                          virtual_stages=virtual_stages)
    schedule = freeze_lowered(plan, num_frozen_chunks) if train else add_communication(forward_only(plan))
    if vocab_parallel:
        schedule = add_vocab_passes(schedule, embedding=vocab_embedding)
    return schedule

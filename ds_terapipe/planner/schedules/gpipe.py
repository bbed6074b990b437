"""``gpipe``: TeraPipe's schedule. Every stage runs all forwards, then all backwards.

Most activations of the three built-in schedules (every unit is alive at once) and the plainest dependency
structure: over equal stages its step time is the slicing DP's closed form, so the planner solves it exactly.
"""
from __future__ import annotations

import functools

from ..registry import ScheduleSpec, register_schedule, uniform_bubble
from ..schedule import B, F, Schedule, _make, _no_gc, _trusted, check_sizes

__all__ = ["build_gpipe"]


@functools.lru_cache(maxsize=32)
@_no_gc()
def _gpipe(num_stages: int, num_microbatches: int, num_slices: int) -> Schedule:
    units = [(b, i) for b in range(num_microbatches) for i in range(num_slices)]
    backward = [(b, i) for b in range(num_microbatches) for i in reversed(range(num_slices))]
    streams = tuple(tuple([_make(s, F, b, i) for b, i in units] + [_make(s, B, b, i) for b, i in backward])
                    for s in range(num_stages))
    return _trusted("gpipe", num_stages, num_microbatches, num_slices, streams, False)


def build_gpipe(num_stages: int, num_microbatches: int, num_slices: int) -> Schedule:
    """TeraPipe's schedule: every stage runs all forwards in (microbatch, slice) order, then all backwards.

    Backwards go micro-batch 0 first and, within a micro-batch, later slices first (required: B(s,b,i) needs the
    cache gradient from B(s,b,i+1)). Running micro-batches in the same order as :func:`build_1f1b` gives every
    stage the same backward sequence under both schedules, so weight gradients accumulate in the same order and
    the two schedules produce bitwise-identical gradients; the timing is the same as reverse micro-batch order
    because every micro-batch has the same slice costs.
    """
    check_sizes(num_stages, num_microbatches, num_slices)
    return _gpipe(num_stages, num_microbatches, num_slices)


def _all_units_live(stage: int, num_stages: int, num_units: int, num_slices: int) -> float:
    """Every forward runs before any backward: all units (micro-batches x splits) are alive on every stage."""
    return float(num_units)


GPIPE = register_schedule(ScheduleSpec(
    name="gpipe",
    builder=build_gpipe,
    description="all forwards, then all backwards (TeraPipe); most memory, planned exactly over equal stages",
    live_subbatches=_all_units_live,
    # gpipe holds every activation until its backwards anyway, so deferring W to one pass per micro-batch
    # (fewer, longer passes) costs little extra memory and hands gradients upstream sooner.
    deferred_weight_grads=True,
    weights_per_slice=False,
    dp_exact=True,
    bubble=uniform_bubble,
    memory_text="all m·n units",
))

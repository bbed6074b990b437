"""``looped-bfs``: Breadth-First Pipeline Parallelism's looped schedule over token slices.

Placement is looped (rank r holds chunks r, r+p, ...). Rank r runs every unit (micro-batch, slice) through its
first local chunk, then every unit through its second, ..., then the backwards with the local chunks in reverse,
each over every unit in backward order (micro-batch 0 first, later slices first). Each chunk's work is one
contiguous pass, which is what BFPP pairs with sharded data parallelism (a chunk's weights are gathered once
per step) at GPipe's memory (every unit alive).

Closed form (equal unit costs f and b, no communication), N = m·n units: the forward sweep through the p·v
chunks keeps every rank busy except when a unit wraps from rank p-1 to rank 0 before rank 0 is done with its
previous chunk, i.e. when N < p; rank r runs chunk r + kp from k·max(N, p) + r on. The forwards end after
(v-1)·max(N, p) + N + p - 1 unit-times, the backwards mirror them, so the bubble is
1 - v·N / ((v-1)·max(N, p) + N + p - 1), which is (p-1)/(v·m·n + p - 1) for m·n >= p.
"""
from __future__ import annotations

import functools

from ..registry import BubbleFormula, ScheduleSpec, register_schedule
from ..schedule import B, F, Schedule, _make, _no_gc, _trusted, check_sizes, looped_placement
from ._list import backward_units
from .interleaved import placement_looped

__all__ = ["build_looped_bfs"]


@functools.lru_cache(maxsize=32)
@_no_gc()
def _looped_bfs(num_ranks: int, num_microbatches: int, num_slices: int, virtual_stages: int) -> Schedule:
    p, v, n = num_ranks, virtual_stages, num_slices
    N = num_microbatches * n
    back = backward_units(num_microbatches, n)
    streams = tuple(tuple([_make(r + k * p, F, u // n, u % n) for k in range(v) for u in range(N)]
                          + [_make(r + k * p, B, u // n, u % n) for k in reversed(range(v)) for u in back])
                    for r in range(p))
    return _trusted("looped-bfs", p, num_microbatches, n, streams, False, virtual_stages=v,
                    placement=looped_placement(p, v))


def build_looped_bfs(num_stages: int, num_microbatches: int, num_slices: int, virtual_stages: int = 2) -> Schedule:
    """Looped breadth-first on ``num_stages`` ranks with ``virtual_stages`` chunks each (looped placement)."""
    check_sizes(num_stages, num_microbatches, num_slices)
    placement_looped(num_stages, virtual_stages)
    return _looped_bfs(num_stages, num_microbatches, num_slices, virtual_stages)


def _all_units_live(stage: int, num_stages: int, num_units: int, num_slices: int, virtual_stages: int = 2) -> float:
    """Every forward before any backward: all units alive on every chunk, i.e. on all of the rank's layers."""
    return float(num_units)


def _bubble(p: int, num_units: int, v: int = 2) -> float:
    return 1.0 - v * num_units / ((v - 1) * max(num_units, p) + num_units + p - 1)


LOOPED_BFS = register_schedule(ScheduleSpec(
    name="looped-bfs",
    builder=build_looped_bfs,
    description="looped breadth-first (BFPP): all units through one local chunk, then the next; backwards in "
                "reverse; pairs with sharded data parallelism, GPipe's memory",
    live_subbatches=_all_units_live,
    deferred_weight_grads=False,
    weights_per_slice=False,
    dp_exact=False,
    bubble=BubbleFormula(_bubble, "(p-1)/(v·m·n+p-1) for m·n >= p"),
    memory_text="all m·n units",
    placement=placement_looped,
    placement_text="looped: chunk c on rank c mod p (v >= 2)",
    virtual_stages=2,
))

"""``interleaved-1f1b``: Megatron-LM's interleaved 1F1B with token slices as extra pipeline units.

Placement is looped: rank r holds chunks r, r+p, ..., r+(v-1)p, so a unit crosses every rank v times and the
pipeline fills v times faster. Order (Megatron's grouping, with units (micro-batch, slice) in place of
micro-batches): units are taken in groups of G; rank r forwards a group through its first local chunk, then the
same group through its second, ..., then the next group; backwards go group by group with the local chunks in
reverse, units in backward order (later slices first). Megatron's G is p; with slices G = lcm(p, n), so that a
group holds whole micro-batches: a micro-batch's backwards start with its last slice, which must have gone
through the last chunk, and with G = p that slice could sit in the next group (measured: p = 3, v = 2, m = 2,
n = 3 idles 21% more than the closed form). The queues are merged 1F1B-style by list scheduling
(``_list.py``): a ready forward while the rank holds fewer than its cap of units in flight, else a ready
backward. The cap is Megatron's warm-up + 1 with G for p, 2(p-1-r) + (v-1)G + 1, grown by the n-1 later
slices the last chunk forwards before a micro-batch's first backward: 2(p-1-r) + (v-1)G + n.

Closed form (equal unit costs f, b, no communication, m·n a multiple of p): every rank works v·m·n
chunk-units of (f + b) and idles (p-1)(f + b), the fill of the first chunk-unit down the p ranks and the drain of
the last one: the bubble of Megatron's schedule over v·m·n units, (p-1) / (v·m·n + p - 1). The tests check it
against the simulator for f:b of 1:1, 1:2 and 2:1; for other m·n the simulated bubble is larger, never smaller.
"""
from __future__ import annotations

import functools
import math

from ..registry import BubbleFormula, ScheduleSpec, register_schedule
from ..schedule import Schedule, _no_gc, check_sizes, looped_placement
from ._list import backward_units, list_schedule

__all__ = ["build_interleaved_1f1b", "group_size", "interleaved_cap", "placement_looped"]


def placement_looped(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """Chunk c on rank c mod p; refuses v < 2 (with one chunk per rank use ``1f1b`` or ``gpipe``)."""
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 2:
        raise ValueError(f"virtual_stages = {virtual_stages!r}: this schedule interleaves several chunks per rank "
                         "(looped placement, chunk c on rank c mod p) and needs virtual_stages >= 2; use "
                         "virtual_stages = 2 (or more), or schedule 1f1b / gpipe for one chunk per rank")
    return looped_placement(num_ranks, virtual_stages)


def group_size(num_ranks: int, num_slices: int) -> int:
    """Units per group: lcm(p, n), whole micro-batches and a multiple of p (Megatron: p)."""
    return num_ranks * num_slices // math.gcd(num_ranks, num_slices)


def interleaved_cap(rank: int, num_ranks: int, num_slices: int, virtual_stages: int) -> int:
    """Chunk-units rank ``rank`` may hold in flight: Megatron's warm-up + 1 over groups of G units, plus the
    n - 1 later slices the last chunk forwards before a micro-batch's first backward."""
    G = group_size(num_ranks, num_slices)
    return 2 * (num_ranks - 1 - rank) + (virtual_stages - 1) * G + num_slices


@functools.lru_cache(maxsize=32)
@_no_gc()
def _interleaved(num_ranks: int, num_microbatches: int, num_slices: int, virtual_stages: int) -> Schedule:
    p, v, N = num_ranks, virtual_stages, num_microbatches * num_slices
    back = backward_units(num_microbatches, num_slices)
    G = group_size(p, num_slices)
    groups = [range(g, min(g + G, N)) for g in range(0, N, G)]
    fwd = [[[(r + k * p, u) for g in groups for k in range(v) for u in g]] for r in range(p)]
    bwd = [[[(r + k * p, back[s]) for g in groups for k in reversed(range(v)) for s in g]] for r in range(p)]
    caps = [interleaved_cap(r, p, num_slices, v) for r in range(p)]
    return list_schedule("interleaved-1f1b", p, num_microbatches, num_slices, v, looped_placement(p, v), fwd,
                         bwd, caps, forward_first=True)


def build_interleaved_1f1b(num_stages: int, num_microbatches: int, num_slices: int,
                           virtual_stages: int = 2) -> Schedule:
    """Interleaved 1F1B on ``num_stages`` ranks with ``virtual_stages`` chunks each (looped placement)."""
    check_sizes(num_stages, num_microbatches, num_slices)
    placement_looped(num_stages, virtual_stages)
    return _interleaved(num_stages, num_microbatches, num_slices, virtual_stages)


def _in_flight(stage: int, num_stages: int, num_units: int, num_slices: int, virtual_stages: int = 2) -> float:
    """The cap (``interleaved_cap``) in chunk-units, each 1/v of the rank's layers and 1/n of a sequence, with
    lcm(p, n) <= p·n (the exact cap is not monotone in n; this bound is, as the memory model needs); at most
    every unit on every chunk."""
    p, v, n = num_stages, virtual_stages, num_slices
    cap = 2 * (p - 1 - stage) + (v - 1) * p * n + n
    return min(float(num_units), cap / (v * n))


def _bubble(p: int, num_units: int, v: int = 2) -> float:
    return (p - 1) / (v * num_units + p - 1)


INTERLEAVED_1F1B = register_schedule(ScheduleSpec(
    name="interleaved-1f1b",
    builder=build_interleaved_1f1b,
    description="Megatron-LM interleaved 1F1B over token slices: v chunks per rank fill the pipeline v times "
                "faster at 1F1B-bounded memory; for few micro-batches on deep pipelines",
    live_subbatches=_in_flight,
    deferred_weight_grads=False,
    weights_per_slice=True,
    dp_exact=False,
    bubble=BubbleFormula(_bubble, "(p-1)/(v·m·n+p-1), m·n a multiple of p"),
    memory_text="2(p-1-r)+(v-1)·lcm(p,n)+n chunk-units",
    placement=placement_looped,
    placement_text="looped: chunk c on rank c mod p (v >= 2)",
    virtual_stages=2,
))

"""``dualpipev``: DeepSeek's DualPipeV (cut-in-half DualPipe) at token level, deferred W filling the bubble.

Placement is a V (as DeepSpeed's ``DualPipeVModule``): rank r holds chunk r on the way down and chunk 2p-1-r on
the way back up, so the first and the last chunk (embedding and loss) are both on rank 0, and the turn from
chunk p-1 to chunk p on rank p-1 is a local hand-off. v = 2 always.

Order: each rank's work is two forward queues (its up chunk first: it carries units towards the loss) and two
backward queues (its down chunk first: it finishes units and frees their memory), merged by list scheduling
(``_list.py``): a ready backward, else a forward while the rank holds fewer than its cap of units in flight,
else a deferred weight-gradient pass ``W`` of an earlier backward. Backwards compute input gradients only, so
gradients travel back as fast as forwards came, and the W passes fill the gaps where a rank waits for them:
DualPipeV's zero-bubble idea, with (micro-batch, slice) units in place of micro-batches. The cap, 2p + 2n
chunk-units on every rank, is about DualPipeV's 2p micro-batches in flight plus the slices the last chunk
forwards before a micro-batch's first backward (caps of 2p + n or 2(p - r) + 2n idle more; measured). The cap
counts units forwarded and not yet backwarded; a backwarded unit still holds its Linears' inputs and output
gradients until its W. W passes fill the waits, and once as many W's are pending as the cap allows in flight a W
runs before the next forward: without that bound, with m >= 2, most W's waited for the end of the step and every
unit's W inputs were held at once (measured at m = 8, 2 ranks, GPT 8 x 512: about 1 GiB a rank where torch's
DualPipeV holds 0.4). Units holding activations or W inputs stay under twice the cap (tested), and the closed
form below still holds.

Closed form (equal unit costs f = b = w, no communication): each rank works 2·m·n units of f + b + w. Rank
p-1 cannot start before its first input crossed p-1 chunks, (p-1)f, so the makespan is at least
(p-1)f + 2·m·n(f + b + w) and the bubble at least (p-1) / (6·m·n + p - 1). The schedule attains it once there
are units enough to fill every wait with another leg's work or a W: m >= 2 and m·n >= 2p (DualPipeV itself
needs 2p micro-batches); below that the simulated bubble is larger (e.g. m = 1: the backward waits for every
slice to go round the V). The tests check both against the simulator.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

from ..registry import BubbleFormula, ScheduleSpec, register_schedule
from ..schedule import Schedule, _no_gc, check_sizes, v_placement
from ._list import backward_units, list_schedule

__all__ = ["build_dualpipev", "dualpipev_cap", "placement_v", "v_bubble", "v_placement_of"]


def v_placement_of(name: str) -> Callable[[int, int], tuple[int, ...]]:
    """The placement of a V schedule called ``name``: chunks r and 2p-1-r on rank r; refuses virtual_stages != 2
    (a V has two legs), naming the schedule."""
    def placement(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
        if virtual_stages != 2 or isinstance(virtual_stages, bool):
            raise ValueError(f"virtual_stages = {virtual_stages!r}: {name} places exactly two chunks per rank "
                             "(chunks r and 2p-1-r, a V); use virtual_stages = 2, or interleaved-1f1b / looped-bfs "
                             "for other chunk counts")
        return v_placement(num_ranks)
    return placement


placement_v = v_placement_of("dualpipev")


def dualpipev_cap(rank: int, num_ranks: int, num_slices: int) -> int:
    """Chunk-units rank ``rank`` may hold in flight (over both its chunks)."""
    return 2 * num_ranks + 2 * num_slices


@functools.lru_cache(maxsize=32)
@_no_gc()
def _dualpipev(num_ranks: int, num_microbatches: int, num_slices: int) -> Schedule:
    p, N = num_ranks, num_microbatches * num_slices
    back = backward_units(num_microbatches, num_slices)
    fwd = [[[(2 * p - 1 - r, u) for u in range(N)], [(r, u) for u in range(N)]] for r in range(p)]
    bwd = [[[(r, u) for u in back], [(2 * p - 1 - r, u) for u in back]] for r in range(p)]
    caps = [dualpipev_cap(r, p, num_slices) for r in range(p)]
    return list_schedule("dualpipev", p, num_microbatches, num_slices, 2, v_placement(p), fwd, bwd, caps,
                         weights=True, weight_caps=caps)


def build_dualpipev(num_stages: int, num_microbatches: int, num_slices: int, virtual_stages: int = 2) -> Schedule:
    """Token-level DualPipeV on ``num_stages`` ranks (two chunks each, V placement), with its W actions."""
    check_sizes(num_stages, num_microbatches, num_slices)
    placement_v(num_stages, virtual_stages)
    return _dualpipev(num_stages, num_microbatches, num_slices)


def _in_flight(stage: int, num_stages: int, num_units: int, num_slices: int, virtual_stages: int = 2) -> float:
    cap = dualpipev_cap(stage, num_stages, num_slices)
    return min(float(num_units), cap / (2 * num_slices))


def _held(stage: int, num_stages: int, num_units: int, num_slices: int, virtual_stages: int = 2) -> float:
    """Units holding activations or W inputs: under twice the cap (module docstring; in the built schedule at p = 2,
    m = 8, 5 slices: 25 chunk-units at the peak against the cap's 14)."""
    cap = dualpipev_cap(stage, num_stages, num_slices)
    return min(float(num_units), (2 * cap - 1) / (2 * num_slices))


def v_bubble(p: int, num_units: int, v: int = 2) -> float:
    """f = b = w: rank p-1's fill over its 2·m·n units of three passes each (module docstring); a lower bound
    for any V order, which ``zbv`` shares."""
    return (p - 1) / (3 * v * num_units + p - 1)


DUALPIPEV = register_schedule(ScheduleSpec(
    name="dualpipev",
    builder=build_dualpipev,
    description="token-level DualPipeV (DeepSeek): V placement, loss and embedding on rank 0, deferred W fills "
                "the bubble; for few micro-batches with weight-gradient time to hide",
    live_subbatches=_in_flight,
    held_subbatches=_held,
    deferred_weight_grads=True,
    weights_per_slice=True,
    dp_exact=False,
    bubble=BubbleFormula(v_bubble, "(p-1)/(6·m·n+p-1) with W: f=b=w, m >= 2, m·n >= 2p"),
    memory_text="2p+2n chunk-units in flight; under twice that with the units holding W inputs",
    placement=placement_v,
    placement_text="V: chunks r and 2p-1-r on rank r (v = 2)",
    virtual_stages=2,
))

"""``zbv``: the zero-bubble V schedule (ZB-V) at token level, each backward's W right behind it.

Placement is the V of ``dualpipev``: rank r holds chunk r on the way down and chunk 2p-1-r on the way back up
(embedding and loss on rank 0, a local hand-off at the turn on rank p-1); v = 2 always.

Why a second V schedule: ``dualpipev`` merges its queues by a unit-time dry run (``_list.py``), which is exact
when a forward, a backward and a W cost the same and drifts when they do not: a rank that finishes its
backwards early runs forwards in pairs, the next rank waits for them, and the waits add up. Measured on CPU (GPT
8 x 512, L = 1024; ``benchmarks/results/virtual_stages.json``, the V schedules' per-rank forward, backward and W
times) a chunk's B costs about 1.25 F and its W 0.7 F; with those costs the simulator puts ``dualpipev`` at an 8%
bubble at p = 2, m = 8, one slice, and this order at 2.6%. ZB-V avoids the drift by construction: after
its warm-up every rank repeats the same round, F and B of its down chunk, then F and B of its up chunk, each B
followed by its W, so every rank does the same work per round whatever the ratios are.

Order on rank r (units (micro-batch, slice) in place of ZB-V's micro-batches; forwards in unit order, backwards
micro-batch by micro-batch, later slices first):
1. warm-up: 2(p-r)-1 + (n-1) forwards of the down chunk, then r pairs (up, down), then n-1 forwards of the up
   chunk, then p-r rounds of (F, B + W) on the up chunk. The n-1 extra forwards carry a micro-batch's later
   slices round the V before its first backward, which starts with the last slice (with n = 1 these are ZB-V's
   counts);
2. steady state: F + B + W on the down chunk, F + B + W on the up chunk, until every unit is forwarded;
3. cool-down: r pairs of backwards with their W put off, then the remaining backwards (the down chunk's with
   their W), then the W's put off, down chunk first (the stream stays on the chunk it ended on: one chunk switch
   fewer, one gather fewer under sharded data parallelism): the backwards travel to rank 0 without waiting for W's.

Memory: a rank holds at most 2p + 2(n - 1) chunk-units in flight, the units holding W inputs included (a W runs
right after its B outside the cool-down), and reaches it once m·n >= 2p + n - 2: p + n - 1 slices of a whole rank,
as token-level 1F1B's first rank (tested).

Closed form (equal unit costs f = b = w, no communication): rank p-1 waits (p-1)f for its first input and then
works 2·m·n units of f + b + w, so the makespan is at least (p-1)f + 6·m·n·f, a bubble of (p-1)/(6·m·n + p - 1):
attained with one slice once m >= 2(p - 1); with n slices the makespan is min(n - 1, p - 1) f longer (the n - 1
extra warm-up forwards delay the first backwards), where ``dualpipev`` attains the bound. With the CPU's unequal
costs it is the shorter of the two from m = 4 on (simulated for p 2..4, n 1, 2, 4); at m = 1 and 2 there is
little or no steady state and neither order wins everywhere. The tests check these against the simulator.
"""
from __future__ import annotations

import functools

from ..registry import BubbleFormula, ScheduleSpec, register_schedule
from ..schedule import Action, B, F, Schedule, W, _make, _no_gc, _trusted, check_sizes, v_placement
from ._list import backward_units
from .dualpipev import v_bubble, v_placement_of

__all__ = ["build_zbv", "placement_zbv", "zbv_cap"]

placement_zbv = v_placement_of("zbv")


def zbv_cap(rank: int, num_ranks: int, num_slices: int) -> int:
    """Most chunk-units a rank holds (activations, and W inputs with them): 2p + 2(n - 1)."""
    return 2 * num_ranks + 2 * (num_slices - 1)


def _rank_stream(r: int, p: int, m: int, n: int, back: list[int]) -> tuple[Action, ...]:
    """Rank r's actions in ZB-V order (module docstring); every call on a chunk past its last unit is a no-op."""
    N = m * n
    down, up = r, 2 * p - 1 - r
    out: list[Action] = []
    forwarded = {down: 0, up: 0}    # next unit to forward, per chunk (forward order)
    backwarded = {down: 0, up: 0}   # next position in backward order, per chunk
    put_off: dict[int, list[int]] = {down: [], up: []}

    def forward(c: int) -> None:
        u = forwarded[c]
        if u < N:
            out.append(_make(c, F, u // n, u % n))
            forwarded[c] = u + 1

    def backward(c: int, weights_now: bool = True) -> None:
        k = backwarded[c]
        if k < N:
            u = back[k]
            out.append(_make(c, B, u // n, u % n))
            backwarded[c] = k + 1
            if weights_now:
                out.append(_make(c, W, u // n, u % n))
            else:
                put_off[c].append(u)

    for _ in range(2 * (p - r) - 1 + n - 1):
        forward(down)
    for _ in range(r):
        forward(up)
        forward(down)
    for _ in range(n - 1):
        forward(up)
    for _ in range(p - r):
        forward(up)
        backward(up)
    while forwarded[down] < N or forwarded[up] < N:
        forward(down)
        backward(down)
        forward(up)
        backward(up)
    for _ in range(r):
        backward(down, weights_now=False)
        backward(up, weights_now=False)
    while backwarded[down] < N or backwarded[up] < N:
        backward(down)
        backward(up, weights_now=False)
    for c in (down, up):
        out.extend(_make(c, W, u // n, u % n) for u in put_off[c])
    return tuple(out)


@functools.lru_cache(maxsize=32)
@_no_gc()
def _zbv(num_ranks: int, num_microbatches: int, num_slices: int) -> Schedule:
    back = backward_units(num_microbatches, num_slices)
    streams = tuple(_rank_stream(r, num_ranks, num_microbatches, num_slices, back) for r in range(num_ranks))
    return _trusted("zbv", num_ranks, num_microbatches, num_slices, streams, has_comm=False, defers_weights=True,
                    weights_per_slice=num_slices > 1, virtual_stages=2, placement=v_placement(num_ranks))


def build_zbv(num_stages: int, num_microbatches: int, num_slices: int, virtual_stages: int = 2) -> Schedule:
    """Token-level ZB-V on ``num_stages`` ranks (two chunks each, V placement), with its W actions."""
    check_sizes(num_stages, num_microbatches, num_slices)
    placement_zbv(num_stages, virtual_stages)
    return _zbv(num_stages, num_microbatches, num_slices)


def _in_flight(stage: int, num_stages: int, num_units: int, num_slices: int, virtual_stages: int = 2) -> float:
    return min(float(num_units), zbv_cap(stage, num_stages, num_slices) / (2 * num_slices))


ZBV = register_schedule(ScheduleSpec(
    name="zbv",
    builder=build_zbv,
    description="token-level ZB-V (zero-bubble V): V placement, every rank repeats F, B and W of each chunk in "
                "turn, so unequal F/B/W times open fewer bubbles than dualpipev's merge; 1F1B's memory; for m >= 4",
    live_subbatches=_in_flight,
    held_subbatches=_in_flight,   # the cap counts the units holding W inputs too
    deferred_weight_grads=True,
    weights_per_slice=True,
    dp_exact=False,
    bubble=BubbleFormula(v_bubble, "(p-1)/(6·m·n+p-1) with W: f=b=w, n = 1, m >= 2(p-1); min(n-1, p-1) f more "
                                  "with slices"),
    memory_text="2p+2(n-1) chunk-units, the units holding W inputs included",
    placement=placement_zbv,
    placement_text="V: chunks r and 2p-1-r on rank r (v = 2)",
    virtual_stages=2,
))

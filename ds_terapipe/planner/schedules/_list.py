"""List scheduling: turn per-rank queues of chunk work into per-rank streams by a unit-time dry run.

Why: with several chunks per rank a rank chooses, at every step, between forwards and backwards of different
chunks; a fixed formula for that order (Megatron's warm-up counts) assumes one slice per micro-batch and breaks
(deadlocks) once a micro-batch's backward must wait for all its slices. Instead the builders give each rank its
work as ordered queues in priority order and this module runs all ranks in lock-step, one unit of time per
action, taking on each rank the first queue head whose dependencies are done: a backward if one is ready, else
a forward while the rank holds fewer than ``caps[r]`` units in flight (its activation memory), else a deferred
weight-gradient pass ``W`` (filling what would be a bubble), else idling (``forward_first`` swaps the first
two: 1F1B with the cap as warm-up). The order that dry run executes is the
schedule. It is deadlock-free by construction (the dry run is an execution that respects every dependency), for
any ranks, chunks, micro-batches and slices; a cap too tight to make progress is lifted for the step that would
otherwise stall, so caps bound memory without ever hanging the builder.

Dependencies (docs/design.md, per chunk): F(c,b,i) after F(c-1,b,i) and F(c,b,i-1); B(c,b,i) after F(c,b,i),
B(c+1,b,i) and B(c,b,i+1). Units are numbered in forward order u = b * n + i; backward order is micro-batch 0
first, later slices first (``backward_units``).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from ..schedule import B, F, W, Action, ActionKind, Schedule, _make, _trusted

__all__ = ["backward_units", "list_schedule"]

_NOT_YET = 1 << 60


def backward_units(num_microbatches: int, num_slices: int) -> list[int]:
    """Forward indices of the units in backward order: micro-batch 0 first, within it the last slice first."""
    return [b * num_slices + i for b in range(num_microbatches) for i in reversed(range(num_slices))]


def list_schedule(name: str, num_ranks: int, num_microbatches: int, num_slices: int, virtual_stages: int,
                  placement: tuple[int, ...], forward_queues: Sequence[Sequence[Sequence[tuple[int, int]]]],
                  backward_queues: Sequence[Sequence[Sequence[tuple[int, int]]]], caps: Sequence[int],
                  weights: bool = False, forward_first: bool = False,
                  weight_caps: Sequence[int] | None = None) -> Schedule:
    """Dry-run the queues (``(chunk, unit)`` pairs, units in forward numbering) and return the streams.

    ``forward_queues[r]`` / ``backward_queues[r]``: rank r's queues in priority order; every chunk's forwards
    must appear in forward order and its backwards in backward order. ``weights``: one ``W`` per (chunk, unit),
    run when the rank has nothing else ready and after its last backward otherwise; with ``weight_caps``, also
    before a forward once rank r has ``weight_caps[r]`` W's pending (each holds its unit's Linear inputs and
    output gradients: the cap bounds that memory as ``caps`` bounds the activations). ``forward_first``: a ready
    forward under the cap goes before a ready backward (1F1B with the cap as its warm-up: the rank fills up to
    the cap, then alternates as backwards free room); otherwise backwards go first.
    """
    n, C = num_slices, num_ranks * virtual_stages
    N = num_microbatches * n
    fin_f = [[_NOT_YET] * N for _ in range(C)]
    fin_b = [[_NOT_YET] * N for _ in range(C)]
    fq = [[deque(q) for q in qs] for qs in forward_queues]
    bq = [[deque(q) for q in qs] for qs in backward_queues]
    wq: list[deque[tuple[int, int]]] = [deque() for _ in range(num_ranks)]
    left = [sum(map(len, fq[r])) + sum(map(len, bq[r])) for r in range(num_ranks)]
    left_w = [left[r] // 2 if weights else 0 for r in range(num_ranks)]
    in_flight = [0] * num_ranks
    streams: list[list[Action]] = [[] for _ in range(num_ranks)]
    t = 0

    def f_ready(c: int, u: int) -> bool:
        return (c == 0 or fin_f[c - 1][u] <= t) and (u % n == 0 or fin_f[c][u - 1] <= t)

    def b_ready(c: int, u: int) -> bool:
        return fin_f[c][u] <= t and (c == C - 1 or fin_b[c + 1][u] <= t) and \
            (u % n == n - 1 or fin_b[c][u + 1] <= t)

    def take(r: int, queues: list[deque[tuple[int, int]]], ready: Callable[[int, int], bool],
             fin: list[list[int]], kind: ActionKind) -> bool:
        """Run the first ready queue head of ``kind`` on rank r, if any."""
        for q in queues:
            if q and ready(*q[0]):
                c, u = q.popleft()
                fin[c][u] = t + 1
                streams[r].append(_make(c, kind, u // n, u % n))
                in_flight[r] += 1 if kind is F else -1
                left[r] -= 1
                if kind is B and weights:
                    wq[r].append((c, u))
                return True
        return False

    def run_w(r: int) -> bool:
        if not wq[r]:
            return False
        c, u = wq[r].popleft()
        streams[r].append(_make(c, W, u // n, u % n))
        left_w[r] -= 1
        return True

    def step(r: int, capped: bool) -> bool:
        may_forward = not capped or in_flight[r] < caps[r]
        if forward_first and may_forward and take(r, fq[r], f_ready, fin_f, F):
            return True
        if take(r, bq[r], b_ready, fin_b, B):
            return True
        if weight_caps is not None and len(wq[r]) >= weight_caps[r] and run_w(r):
            return True   # the W inputs held are at their cap: a W before another forward adds more
        if not forward_first and may_forward and take(r, fq[r], f_ready, fin_f, F):
            return True
        return run_w(r)

    busy = [r for r in range(num_ranks) if left[r] or left_w[r]]
    while busy:
        moved = [step(r, True) for r in busy]
        if not any(moved):   # every rank waits: a cap is too tight to make progress; lift it for this step
            moved = [step(r, False) for r in busy]
            assert any(moved), f"{name}: list scheduling stalled at t={t} (queues out of dependency order)"
        t += 1
        busy = [r for r in busy if left[r] or left_w[r]]
    return _trusted(name, num_ranks, num_microbatches, num_slices, tuple(map(tuple, streams)), False,
                    weights, weights and n > 1, virtual_stages, placement)

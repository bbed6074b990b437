"""``1f1b``: token-level 1F1B (Seq1F1B). Warm-up forwards, then one backward / one forward, then cool-down.

Bounds the units in flight per stage (:func:`warmup_forwards`) at the same bubble as ``gpipe`` with uniform
costs; its step time is not the DP's closed form, so the planner scores candidates with the simulator.
"""
from __future__ import annotations

import functools

from ..registry import ScheduleSpec, register_schedule, uniform_bubble
from ..schedule import B, F, Schedule, _make, _no_gc, _trusted, check_sizes

__all__ = ["build_1f1b", "warmup_forwards"]


def warmup_forwards(stage: int, num_stages: int, num_microbatches: int, num_slices: int) -> int:
    """Forwards stage ``stage`` of the token-level 1F1B schedule runs before its first backward.

    The last stage must forward all ``n`` slices of micro-batch 0 before it can backward slice ``n-1``; each
    earlier stage runs one more so that its forward of the next unit overlaps the round trip of the backward
    from the stage after it (classic 1F1B uses ``K - s`` with ``n = 1``). The count is non-increasing in the
    stage, which is what makes the schedule deadlock-free, and it bounds the units in flight on the stage.
    """
    return min(num_slices + num_stages - 1 - stage, num_microbatches * num_slices)


@functools.lru_cache(maxsize=32)
@_no_gc()
def _one_f_one_b(num_stages: int, num_microbatches: int, num_slices: int) -> Schedule:
    units = [(b, i) for b in range(num_microbatches) for i in range(num_slices)]
    backward = [(b, i) for b in range(num_microbatches) for i in reversed(range(num_slices))]
    streams = []
    for s in range(num_stages - 1):
        done = warmup_forwards(s, num_stages, num_microbatches, num_slices)
        ops = [_make(s, F, b, i) for b, i in units[:done]]
        for b, i in backward:  # steady state: one backward, one forward; then the cool-down backwards
            ops.append(_make(s, B, b, i))
            if done < len(units):
                ops.append(_make(s, F, *units[done]))
                done += 1
        streams.append(tuple(ops))
    last = num_stages - 1   # one micro-batch at a time: all its forwards, then all its backwards
    streams.append(tuple(_make(last, kind, b, i) for b in range(num_microbatches)
                         for kind, order in ((F, range(num_slices)), (B, reversed(range(num_slices))))
                         for i in order))
    return _trusted("1f1b", num_stages, num_microbatches, num_slices, tuple(streams), False)


def build_1f1b(num_stages: int, num_microbatches: int, num_slices: int) -> Schedule:
    """Token-level 1F1B (Seq1F1B): units in (microbatch, slice) order, warm-up, one backward / one forward, cool-down.

    Stage ``s`` holds at most :func:`warmup_forwards` (``n + K - 1 - s``) units in flight instead of GPipe's
    ``m * n``, at the same bubble when F and B costs are uniform.

    The last stage runs one micro-batch at a time (its ``n`` forwards, then its ``n`` backwards), as stock 1F1B's
    last stage does. Interleaving the next micro-batch's forwards into those backwards would hold a second
    micro-batch's KV cache there (measured: 174 vs 133 MiB on the last stage, 2 CPU stages, m = 2) and delays the
    gradients the stage before it waits for; the simulator finds the sequential order no slower for K = 2..8 and
    m = 1..8 under measured costs (benchmarks/pipeline_speedup.py, docs/performance.md).
    """
    check_sizes(num_stages, num_microbatches, num_slices)
    return _one_f_one_b(num_stages, num_microbatches, num_slices)


def _warmup_window(stage: int, num_stages: int, num_units: int, num_slices: int) -> float:
    """W = n + K - 1 - stage units in flight (:func:`warmup_forwards`), i.e. W / n sub-batches' worth of tokens
    when the n slices are equal (for n = 1 classic 1F1B's K - stage micro-batches). An estimate, not a bound: the
    window can hold the longest slices, up to (K - 1 - stage) * (longest - mean slice) more tokens per sequence.
    It never grows with n, so a memory cap translates into a minimum slice count."""
    return min(float(num_units), (num_slices + num_stages - 1 - stage) / num_slices)


ONE_F_ONE_B = register_schedule(ScheduleSpec(
    name="1f1b",
    builder=build_1f1b,
    description="token-level 1F1B (Seq1F1B): bounded activations at the same bubble; the last stage runs one "
                "micro-batch at a time, as stock 1F1B",
    live_subbatches=_warmup_window,
    # 1F1B's point is bounded memory: deferred W is off by default (per-slice W measured +5-30% activations);
    # when on, one W per slice keeps the recorded pairs as short-lived as the activations.
    deferred_weight_grads=False,
    weights_per_slice=True,
    dp_exact=False,
    bubble=uniform_bubble,
    memory_text="n+p-1-s units (last stage: one micro-batch)",
))

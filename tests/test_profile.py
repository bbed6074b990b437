"""On-device profiling (runtime/profile.py, profile_stage): one point per (slice, context), rounds over the grid.

Single process, a linear "stage": what matters here is the grid, the order of the timed calls and the median,
not the model.
"""

from __future__ import annotations

import time

import torch
import torch.nn as nn

from ds_terapipe.runtime.context import current_slice
from ds_terapipe.runtime.profile import profile_stage

SEQ, HIDDEN = 64, 16


class _Recorder:
    """A linear stage that records the (start, end) of every timed forward and can stall chosen calls."""

    def __init__(self, stall_calls: frozenset[int] = frozenset(), stall_s: float = 0.0) -> None:
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.timed: list[tuple[int, int]] = []
        self.stall_calls, self.stall_s = stall_calls, stall_s

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_slice()
        if ctx is not None and ctx.slice_index == 1:   # the timed slice (slice 0 is the untimed prefix)
            self.timed.append((ctx.start, ctx.end))
            if len(self.timed) in self.stall_calls:
                time.sleep(self.stall_s)
        return self.layer(x)


def _profile(stage: _Recorder, **kw) -> list[dict]:
    x = torch.randn(1, SEQ, HIDDEN)
    return profile_stage(stage, list(stage.layer.parameters()), x, SEQ, 8, 1, slice_lengths=[8, 16, 32],
                         num_contexts=2, **kw)


def test_one_point_per_slice_and_context_in_the_cost_file_format() -> None:
    points = _profile(_Recorder(), warmup=1, repeats=3)
    grid = [(p["slice"], p["context"]) for p in points]
    assert grid == [(8, 0), (8, 56), (16, 0), (16, 48), (32, 0), (32, 32)]
    for p in points:
        assert set(p) == {"batch", "slice", "context", "forward_ms", "backward_ms"}
        assert p["batch"] == 1 and p["forward_ms"] > 0 and p["backward_ms"] > 0


def test_timed_calls_go_round_the_grid_rather_than_repeating_a_point() -> None:
    stage = _Recorder()
    _profile(stage, warmup=1, repeats=3)
    grid = [(c, c + s) for s in (8, 16, 32) for c in sorted({0, SEQ - s})]
    assert stage.timed == grid * 4   # warm-up round, then 3 timed rounds, each over every point once


def test_a_burst_of_load_spoils_no_median() -> None:
    # calls 2-4 stall: with a point's repeats back to back they would be all three timed samples of point 0
    stage = _Recorder(stall_calls=frozenset({2, 3, 4}), stall_s=0.25)
    points = _profile(stage, warmup=1, repeats=3)
    assert max(p["forward_ms"] for p in points) < 150, points
    stage = _Recorder(stall_calls=frozenset({7, 14}), stall_s=0.25)   # one sample each of two points
    points = _profile(stage, warmup=1, repeats=3)
    assert max(p["forward_ms"] for p in points) < 150, points

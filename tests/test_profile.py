"""On-device profiling (runtime/planning/profile.py, profile_stage): one point per (slice, context), rounds over the
grid.

Single process, a linear "stage" and a fake clock: the stage advances the clock by a duration chosen per timed
call (forward, and backward through a custom autograd function), so medians are exact and nothing depends on
the host's load.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from ds_terapipe.runtime.slicing.context import current_slice
from ds_terapipe.runtime.slicing.deferred import WeightGradStash, enable_deferred_weight_grads
from ds_terapipe.runtime.planning.profile import RECHECK_ROUNDS, profile_stage, weight_cost

SEQ, HIDDEN = 64, 16
LENGTHS = [8, 16, 32]
GRID = [(8, 0), (8, 56), (16, 0), (16, 48), (32, 0), (32, 32)]   # (slice, context), 2 contexts per length


class FakeClock:
    """Seconds that pass only when told to."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance_ms(self, ms: float) -> None:
        self.now += ms / 1e3


def _forward_ms(length: int, context: int) -> float:
    return length + context / 8   # distinct for every grid point


def _backward_ms(length: int, context: int) -> float:
    return 3 * length + context   # not a multiple of the forward: a swapped pair would show


class _ChargeBackward(torch.autograd.Function):
    """Identity whose backward advances the clock: the 'cost' of this slice's backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, clock: FakeClock, ms: float) -> torch.Tensor:
        ctx.clock, ctx.ms = clock, ms
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.clock.advance_ms(ctx.ms)
        return grad, None, None


class _Recorder:
    """A linear stage that records every timed forward and charges the fake clock for it (stalls: extra ms)."""

    def __init__(self, clock: FakeClock, stalls: dict[int, float] | None = None) -> None:
        self.layer = nn.Linear(HIDDEN, HIDDEN)
        self.clock = clock
        self.timed: list[tuple[int, int]] = []
        self.stalls = stalls or {}   # 1-based timed call -> extra forward ms

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ctx = current_slice()
        y = self.layer(x)
        if ctx is not None and ctx.slice_index == 1:   # the timed slice (slice 0 is the untimed prefix)
            self.timed.append((ctx.start, ctx.end))
            length, context = ctx.end - ctx.start, ctx.start
            self.clock.advance_ms(_forward_ms(length, context) + self.stalls.get(len(self.timed), 0.0))
            y = _ChargeBackward.apply(y, self.clock, _backward_ms(length, context))
        return y


def _profile(stage: _Recorder, **kw) -> list[dict]:
    x = torch.randn(1, SEQ, HIDDEN)
    return profile_stage(stage, list(stage.layer.parameters()), x, SEQ, 8, 1, slice_lengths=LENGTHS,
                         num_contexts=2, clock=stage.clock, **kw)


def _exact(points: list[dict]) -> bool:
    """Every point reports its own forward and backward time (to float rounding of the clock's seconds)."""
    return all(p["forward_ms"] == pytest.approx(_forward_ms(p["slice"], p["context"]), abs=1e-9) and
               p["backward_ms"] == pytest.approx(_backward_ms(p["slice"], p["context"]), abs=1e-9) for p in points)


def test_one_point_per_slice_and_context_with_its_own_forward_and_backward_time() -> None:
    points = _profile(_Recorder(FakeClock()), warmup=1, repeats=3)
    assert [(p["slice"], p["context"]) for p in points] == GRID
    for p in points:
        assert set(p) == {"batch", "slice", "context", "forward_ms", "backward_ms"}
        assert p["batch"] == 1
    assert _exact(points), points


def test_timed_calls_go_round_the_grid_rather_than_repeating_a_point() -> None:
    stage = _Recorder(FakeClock())
    _profile(stage, warmup=1, repeats=3)
    grid = [(c, c + s) for s in LENGTHS for c in sorted({0, SEQ - s})]
    assert stage.timed == grid * 4   # warm-up round, then 3 timed rounds, each over every point once


@pytest.mark.parametrize("stalled", [(2, 3, 4), (7, 14)], ids=["burst", "two-points"])
def test_a_burst_of_load_spoils_no_median(stalled: tuple[int, ...]) -> None:
    # timed calls 2-4 stall: with a point's repeats back to back they would be all three timed samples of point 0;
    # calls 7 and 14 are one sample each of two points
    stage = _Recorder(FakeClock(), stalls={call: 250.0 for call in stalled})
    points = _profile(stage, warmup=1, repeats=3)
    assert _exact(points), points


def test_warm_up_rounds_are_not_counted() -> None:
    # both warm-up rounds stall at every point: counted, they would be the median of 3 samples
    stage = _Recorder(FakeClock(), stalls={call: 1000.0 for call in range(1, 2 * len(GRID) + 1)})
    points = _profile(stage, warmup=2, repeats=1)
    assert _exact(points), points


def test_the_median_rejects_one_slow_sample() -> None:
    stage = _Recorder(FakeClock(), stalls={len(GRID) + 1: 90.0})   # the first timed sample of point 0
    points = _profile(stage, warmup=1, repeats=3)
    assert _exact(points), points


def test_a_plan_cache_recheck_rejects_one_slow_sample() -> None:
    # the recheck times one slice length at two contexts; one stalled sample of either point (the first timed round,
    # or the last) must not move what it reports, or a cache hit rescales every cached cost by the stall
    for call in (3, 6):
        stage = _Recorder(FakeClock(), stalls={call: 40.0})
        x = torch.randn(1, SEQ, HIDDEN)
        points = profile_stage(stage, list(stage.layer.parameters()), x, SEQ, 8, 1, slice_lengths=[16],
                               num_contexts=2, clock=stage.clock, **RECHECK_ROUNDS)
        assert [(p["slice"], p["context"]) for p in points] == [(16, 0), (16, 48)]
        assert _exact(points), (call, points)


def test_deferred_points_time_each_slices_weight_grads_and_fit_a_cost_per_slice_and_token(monkeypatch) -> None:
    # W of a slice of s tokens "takes" 2 + 0.5 * s ms (per sequence, 2 sequences: twice that): the fit must
    # give back the fixed part and the rate per sequence, from points at 3 lengths and 2 contexts each
    clock = FakeClock()
    original = WeightGradStash.compute

    def charged(self, into=None, slice_index=None):
        rows = {x.reshape(-1, x.shape[-1]).shape[0] for _, x, _ in self._pairs.get(stage.layer, [])}
        assert len(rows) == 1, "one slice's pairs per W in profiling"
        clock.advance_ms(2 * (2 + 0.5 * rows.pop() / 2))
        return original(self, into, slice_index)

    monkeypatch.setattr(WeightGradStash, "compute", charged)
    stage = _Recorder(clock)
    enable_deferred_weight_grads(stage.layer)
    x = torch.randn(2, SEQ, HIDDEN)
    points = profile_stage(stage, list(stage.layer.parameters()), x, SEQ, 8, 2, slice_lengths=LENGTHS,
                           num_contexts=2, clock=clock, deferred=True)
    assert [p["weight_ms"] for p in points] == pytest.approx([2 * (2 + 0.5 * s) for s, _ in GRID], abs=1e-9)
    assert _exact(points), points
    assert weight_cost(points, 2) == pytest.approx((2.0, 0.5), abs=1e-9)
    assert stage.layer.weight.grad is None   # timed into the profile's own running sums, never .grad


def test_weight_cost_never_fits_a_negative_term() -> None:
    pts = [{"slice": s, "weight_ms": w} for s, w in ((8, 1.0), (16, 4.5), (32, 9.0))]   # intercept would be < 0
    per_slice, per_token = weight_cost(pts, 1)
    assert per_slice == 0.0 and per_token > 0
    flat = [{"slice": s, "weight_ms": w} for s, w in ((8, 3.0), (16, 2.0), (32, 2.5))]  # slope would be < 0
    assert weight_cost(flat, 1) == pytest.approx((2.5, 0.0))


def test_a_burst_times_copies_back_to_back_so_the_idle_start_is_paid_once(monkeypatch) -> None:
    # On an accelerator the first kernels after a sync wait for the host (a head start the runtime's stream of
    # slices does not pay per slice). Model it: the first timed forward after each device sync costs 40 ms more.
    # With burst=3 each point's 3 copies run between two syncs: the head start is a third per copy.
    clock = FakeClock()
    alone = _profile(_head_start_stage(clock, monkeypatch), warmup=0, repeats=1, burst=1)
    stage = _head_start_stage(clock, monkeypatch)
    burst = _profile(stage, warmup=0, repeats=1, burst=3)
    for a, b in zip(alone, burst):
        f = _forward_ms(a["slice"], a["context"])
        assert a["forward_ms"] == pytest.approx(f + 40.0) and b["forward_ms"] == pytest.approx(f + 40.0 / 3)
        assert b["backward_ms"] == pytest.approx(_backward_ms(b["slice"], b["context"]))
    grid = [(c, c + s) for s in LENGTHS for c in sorted({0, SEQ - s})]
    assert stage.timed == [unit for unit in grid for _ in range(3)]   # each point's copies back to back


def _head_start_stage(clock: FakeClock, monkeypatch) -> type:   # noqa: ANN001
    """A stage whose first timed forward after each device sync costs 40 ms more (the host's head start on an
    accelerator, which a run of slices does not pay per slice)."""
    import ds_terapipe.runtime.planning.profile as profile_module
    idle = {"after_sync": True}
    monkeypatch.setattr(profile_module, "synchronize", lambda: idle.update(after_sync=True))

    class _HeadStart(_Recorder):
        def __call__(self, x: torch.Tensor) -> torch.Tensor:
            ctx = current_slice()
            if ctx is not None and ctx.slice_index == 1 and idle["after_sync"]:
                self.clock.advance_ms(40.0)
                idle["after_sync"] = False
            return super().__call__(x)
    return _HeadStart(clock)


@pytest.mark.parametrize("on", ["cpu clock", "accelerator events"])
def test_a_lead_in_copy_takes_the_burst_start_and_is_not_timed(on: str, monkeypatch) -> None:
    """``lead_in``: each point runs one more copy first in each phase; the burst is timed from that copy's end,
    so the head start falls on it and each timed copy reports its own cost exactly (deferred W too, whose first
    pass is dearer). With accelerator events the marks are events recorded after the copies and read after the
    sync."""
    import ds_terapipe.runtime.planning.profile as profile_module
    clock = FakeClock()
    if on == "accelerator events":
        class _Event:
            def __init__(self, enable_timing: bool) -> None:
                assert enable_timing
                self.at = None

            def record(self) -> None:
                self.at = clock()

            def elapsed_time(self, end: "_Event") -> float:
                return (end.at - self.at) * 1e3

        monkeypatch.setattr(profile_module, "get_accelerator", lambda: type("A", (), {"Event": _Event}))
        real = profile_module._marks
        monkeypatch.setattr(profile_module, "_marks",
                            lambda device, clk, lead_in: real(torch.device("meta"), clk, lead_in))
    stage = _head_start_stage(clock, monkeypatch)
    original = WeightGradStash.compute
    passes = []

    def charged(self, into=None, slice_index=None):   # W of a slice of s tokens takes s ms, the first one 40 more
        rows = next(x.reshape(-1, x.shape[-1]).shape[0] for _, x, _ in self._pairs[stage.layer])
        clock.advance_ms(rows + (40.0 if not passes else 0.0))
        passes.append(rows)
        return original(self, into, slice_index)

    monkeypatch.setattr(WeightGradStash, "compute", charged)
    enable_deferred_weight_grads(stage.layer)
    points = _profile(stage, warmup=0, repeats=1, burst=3, lead_in=True, deferred=True)
    assert _exact(points), points
    assert [p["weight_ms"] for p in points] == pytest.approx([s for s, _ in GRID], abs=1e-9)
    grid = [(c, c + s) for s in LENGTHS for c in sorted({0, SEQ - s})]
    assert stage.timed == [unit for unit in grid for _ in range(4)]   # the lead-in copy and the burst of 3

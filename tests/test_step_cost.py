"""The whole-step part of the cost model: each term, its file format, and how simulator and planner use it.

    python -m pytest -q tests/test_step_cost.py

Tier (a) for the planner (pure Python, milliseconds), plus single-process checks of the runtime timers that
must measure without changing the model or the optimizer (``runtime/planning/step_profile.py``).
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from ds_terapipe.planner.cost import PipelineCost
from ds_terapipe.planner.schedule import build_schedule
from ds_terapipe.planner.simulate import simulate
from ds_terapipe.planner.slicing import plan_slicing
from ds_terapipe.planner.step_cost import StepCost


def points(scale: float = 1.0) -> list[dict]:
    """Forward 0.01 ms per token + context term, backward twice that; with a fixed 0.5 ms per action."""
    out = []
    for s in (32, 64, 128, 256, 512, 1024):
        for c in (0, 256, 512, 992):
            if s + c <= 1024:
                f = scale * (0.5 + 0.01 * s + 2e-6 * s * c)
                out.append({"slice": s, "context": c, "forward_ms": f, "backward_ms": 2 * f})
    return out


def pipeline(step: dict | None = None, *, shift_f: float = 0.0, shift_b: float = 0.0, stages: int = 2) -> PipelineCost:
    pts = [{**p, "forward_ms": p["forward_ms"] + shift_f, "backward_ms": p["backward_ms"] + shift_b}
           for p in points()]
    obj: dict = {"points": pts, "comm": {"latency_ms": 0.05}, "num_stages": stages}
    if step is not None:
        obj["step"] = step
    return PipelineCost.from_dict(obj)


# -- the file format ----------------------------------------------------------------------------------------------

def test_a_cost_file_without_step_reads_and_plans_as_before() -> None:
    old = pipeline()
    assert old.step is None and "step" not in old.to_dict()
    assert PipelineCost.from_dict({**old.to_dict(), "step": None}).step is None
    zero = pipeline({})
    assert zero.step == StepCost()
    for schedule in ("gpipe", "1f1b"):
        a = plan_slicing(old, 1024, num_microbatches=2, granularity=32, schedule=schedule)
        b = plan_slicing(zero, 1024, num_microbatches=2, granularity=32, schedule=schedule)
        assert (a.slices, a.predicted_ms, a.unsliced_ms) == (b.slices, b.predicted_ms, b.unsliced_ms)


def test_step_round_trips_through_the_cost_file() -> None:
    step = {"action_ms": {"forward": [0.3, 0.4], "backward": 1.5, "weight": 0.0}, "optimizer_ms": [20.0, 25.0],
            "grad_reduce_ms": 0.0, "tied_reduce_ms": 3.0, "tied_ranks": [0, 1], "sync_ms": 0.7}
    cost = pipeline(step)
    again = PipelineCost.from_dict(copy.deepcopy(cost.to_dict()))
    assert again.step == cost.step
    assert again.to_dict()["step"] == cost.to_dict()["step"]
    assert cost.step.action_ms("forward", 1, 2) == 0.4 and cost.step.action_ms("backward", 1, 2) == 1.5


@pytest.mark.parametrize("step, message", [
    ({"optimiser_ms": 1.0}, "unknown key 'optimiser_ms'"),
    ({"action_ms": {"fwd": 1.0}}, "unknown key 'fwd'"),
    ({"optimizer_ms": -1.0}, "cost.step.optimizer_ms = -1.0 must be >= 0"),
    ({"action_ms": {"backward": [1.0, float("nan")]}}, "cost.step.action_ms.backward[1]"),
    ({"sync_ms": "1"}, "cost.step.sync_ms = '1' is not a number"),
    ({"tied_ranks": 0}, "must be a list of ranks"),
    ({"tied_ranks": [-1]}, "tied_ranks[0] = -1 must be >= 0"),
])
def test_bad_step_objects_are_refused_naming_the_field(step: dict, message: str) -> None:
    with pytest.raises(ValueError, match=None) as err:
        pipeline(step)
    assert message in str(err.value)


def test_per_stage_lists_must_fit_the_pipeline() -> None:
    cost = pipeline({"optimizer_ms": [1.0, 2.0, 3.0]})
    with pytest.raises(ValueError, match="step.optimizer_ms has 3 entries but the pipeline has 2"):
        simulate(build_schedule("gpipe", 2, 1, 2), cost, [512, 512])
    with pytest.raises(ValueError, match="tied_ranks"):
        StepCost(tied_ranks=(0, 5)).check_sizes(2, 2)
    with pytest.raises(ValueError, match=r"names rank\(s\) \[2\] of a 2-rank pipeline"):   # ranks are 0-based
        StepCost(tied_ranks=(0, 2)).check_sizes(2, 2)
    StepCost(tied_ranks=(0, 1)).check_sizes(2, 2)


# -- each term in the simulator -----------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule, deferred", [("gpipe", False), ("1f1b", False), ("gpipe", True),
                                                ("interleaved-1f1b", False)])
def test_a_fixed_cost_per_action_is_the_same_as_that_much_more_compute_per_action(schedule: str,
                                                                                    deferred: bool) -> None:
    v = 2 if schedule == "interleaved-1f1b" else 1
    sched = build_schedule(schedule, 2, 3, 4, deferred, virtual_stages=v)
    slices = [128, 256, 256, 384]
    with_step = pipeline({"action_ms": {"forward": 0.7, "backward": 1.3}}, stages=2 * v)
    shifted = pipeline(shift_f=0.7, shift_b=1.3, stages=2 * v)
    a, b = simulate(sched, with_step, slices), simulate(sched, shifted, slices)
    assert a.makespan_ms == pytest.approx(b.makespan_ms, rel=1e-12)
    assert [e.start_ms for e in a.events] == pytest.approx([e.start_ms for e in b.events], rel=1e-12)
    assert a.makespan_ms > simulate(sched, pipeline(stages=2 * v), slices).makespan_ms


def test_the_fixed_cost_of_a_weight_pass_is_charged_per_w_action() -> None:
    sched = build_schedule("gpipe", 2, 2, 4, True)
    base = pipeline({})
    step = pipeline({"action_ms": {"weight": 5.0}})
    # every rank runs one W per micro-batch; the last W of stage 0 ends the step
    assert simulate(sched, step, [256] * 4).makespan_ms == pytest.approx(
        simulate(sched, base, [256] * 4).makespan_ms + 2 * 5.0, rel=1e-9)


def test_the_tail_is_sync_plus_the_slowest_ranks_reductions_and_optimizer() -> None:
    step = {"optimizer_ms": [10.0, 30.0], "tied_reduce_ms": 5.0, "tied_ranks": [0, 1], "grad_reduce_ms": [0.0, 2.0],
            "sync_ms": 1.0}
    cost = pipeline(step)
    assert cost.step.tail_ms(2) == pytest.approx(1.0 + max(10 + 5 + 0, 30 + 5 + 2))
    res = simulate(build_schedule("1f1b", 2, 2, 4), cost, [256] * 4)
    assert res.tail_ms == pytest.approx(38.0) and res.step_ms == pytest.approx(res.makespan_ms + 38.0)
    # only the tied ranks pay the tied reduce
    assert StepCost(optimizer_ms=(10.0, 30.0), tied_reduce_ms=50.0, tied_ranks=(0,)).tail_ms(2) == 60.0
    # p2p latency is the stage's comm latency: each boundary crossing on the critical path pays it
    far = PipelineCost.from_dict({**pipeline().to_dict(), "comm": {"latency_ms": 10.05}})
    sched = build_schedule("gpipe", 2, 1, 1)
    assert simulate(sched, far, [1024]).makespan_ms == pytest.approx(
        simulate(sched, pipeline(), [1024]).makespan_ms + 2 * 10.0, rel=1e-9)


# -- the planner ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_planners_prediction_is_the_whole_step(schedule: str) -> None:
    tail = {"optimizer_ms": [40.0, 45.0], "tied_reduce_ms": 3.0, "tied_ranks": [0, 1], "sync_ms": 1.0}
    plain = plan_slicing(pipeline(), 1024, num_microbatches=2, granularity=32, schedule=schedule)
    whole = plan_slicing(pipeline(tail), 1024, num_microbatches=2, granularity=32, schedule=schedule)
    assert whole.slices == plain.slices   # the tail is the same for every plan
    assert whole.predicted_ms == pytest.approx(plain.predicted_ms + 49.0, rel=1e-12)
    assert whole.unsliced_ms == pytest.approx(plain.unsliced_ms + 49.0, rel=1e-12)
    res = simulate(build_schedule(schedule, 2, 2, len(whole.slices)), pipeline(tail), list(whole.slices))
    assert res.step_ms == pytest.approx(whole.predicted_ms, rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_fixed_cost_per_action_makes_the_planner_cut_fewer_slices(schedule: str) -> None:
    counts = [plan_slicing(pipeline({"action_ms": {"forward": o, "backward": o}}), 1024, num_microbatches=1,
                           granularity=32, schedule=schedule).num_slices for o in (0.0, 2.0, 20.0)]
    assert counts[0] >= counts[1] >= counts[2] and counts[0] > counts[2]
    # and it plans as if the per-action cost were compute
    a = plan_slicing(pipeline({"action_ms": {"forward": 2.0, "backward": 2.0}}), 1024, granularity=32,
                     schedule=schedule)
    b = plan_slicing(pipeline(shift_f=2.0, shift_b=2.0), 1024, granularity=32, schedule=schedule)
    assert a.slices == b.slices and a.predicted_ms == pytest.approx(b.predicted_ms, rel=1e-9)


def test_the_refit_scales_the_points_and_keeps_the_fixed_cost_per_action() -> None:
    from ds_terapipe.planner.refit import refit_cost

    cost = pipeline({"action_ms": {"forward": 1.0, "backward": 2.0}})
    model = cost.chunk(0)
    f, b = float(model.forward_ms(128, 256)), float(model.backward_ms(128, 256))
    # measured: the points' time x 1.5, plus the per-action cost: the refit scales the points by 1.5 exactly
    samples = [(0, "F", 128, 256, 4, 4 * (1.5 * f + 1.0)), (0, "B", 128, 256, 4, 4 * (1.5 * b + 2.0))]
    refit, ratios = refit_cost(_per_stage(cost), [samples], 1)
    assert ratios[0]["F"] == pytest.approx(1.5) and ratios[0]["B"] == pytest.approx(1.5)
    assert refit["step"] == cost.to_dict()["step"]


def _per_stage(cost: PipelineCost) -> dict:
    obj = cost.to_dict()
    stage = {k: obj.pop(k) for k in ("points", "comm", "bytes_per_element") if k in obj}
    return {**obj, "stages": [copy.deepcopy(stage) for _ in range(cost.num_chunks)]}


# -- the runtime timers -------------------------------------------------------------------------------------------

def test_timing_the_optimizer_step_changes_neither_the_model_nor_the_optimizer() -> None:
    from ds_terapipe.runtime.planning.step_profile import time_optimizer_step

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.LayerNorm(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()   # the optimizer has state now
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    ms = time_optimizer_step(opt, clip_norm=1.0, warmup=1, repeats=2)
    assert ms > 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    after = opt.state_dict()
    assert after["param_groups"] == state["param_groups"]
    for k, v in state["state"].items():
        assert all(torch.equal(v[n], after["state"][k][n]) for n in v)
    assert time_optimizer_step(object()) == 0.0   # no torch optimizer found: the term is left out
    # a stage larger than the limit is timed on a prefix and scaled by elements (the real state stays untouched)
    assert time_optimizer_step(opt, warmup=0, repeats=1, limit=10) > 0
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_a_prefix_stands_for_the_rest_scaled_by_elements() -> None:
    from ds_terapipe.runtime.planning.step_profile import _sample

    tensors = [torch.zeros(100), torch.zeros(50), torch.zeros(250)]
    assert _sample(tensors, 1000) == (tensors, 1.0)
    part, scale = _sample(tensors, 160)   # exactly 160 elements: the third tensor's first 10
    assert [t.numel() for t in part] == [100, 50, 10] and scale == pytest.approx(400 / 160)
    assert part[2].data_ptr() == tensors[2].data_ptr()   # a view, not a copy
    part, scale = _sample(tensors, 10)
    assert [t.numel() for t in part] == [10] and scale == pytest.approx(40.0)
    # a tiny tensor before a huge one (a norm's weight before a block's first projection) must not stand for
    # the huge one: the sample takes the huge one's leading elements
    norm, proj = torch.zeros(8, 8), torch.zeros(1000, 1000)
    part, scale = _sample([norm, proj], 1000)
    assert sum(t.numel() for t in part) == 1000 and scale == pytest.approx((64 + 10**6) / 1000)
    assert part[1].dim() == 1   # flat: elementwise work does not care about the shape


def test_a_fixed_cost_per_timed_call_is_not_scaled_with_the_elements() -> None:
    # a timed call costs 5 ms whatever its size (launch, sync) plus 0.01 ms per element: 10,000 elements timed on
    # a 1,000-element sample must come out at 5 + 100 ms, not (5 + 10) x 10
    from ds_terapipe.runtime.planning.step_profile import _scaled_ms

    tensors = [torch.zeros(64), torch.zeros(100, 99), torch.zeros(36)]
    fake = lambda sample: 5.0 + 0.01 * sum(t.numel() for t in sample)   # noqa: E731
    assert _scaled_ms(fake, tensors, 1000) == pytest.approx(5.0 + 0.01 * 10_000)
    assert _scaled_ms(fake, tensors, 10**6) == pytest.approx(5.0 + 0.01 * 10_000)   # all of it: timed as is
    flat = lambda sample: 7.0   # noqa: E731  - no slope (noise): the sample's time scaled whole
    assert _scaled_ms(flat, tensors, 1000) == pytest.approx(70.0)


def test_gradient_accumulation_is_timed_as_autograd_runs_it_an_add_per_parameter() -> None:
    # AccumulateGrad adds each parameter's gradient on its own; a fused foreach add over all of them timed 2x
    # slower on a GPU for a large layer, so the timer must run what autograd runs
    from torch.utils._python_dispatch import TorchDispatchMode

    from ds_terapipe.runtime.planning.step_profile import time_grad_accumulation

    class _Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    params = list(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)).parameters())
    with _Ops() as ops:
        time_grad_accumulation(params, warmup=0, repeats=1)
    assert ops.names.count("add_") == len(params) and not any("foreach" in n for n in ops.names), ops.names


def test_gradient_accumulation_is_timed_on_buffers_not_on_grad() -> None:
    from ds_terapipe.runtime.planning.step_profile import time_grad_accumulation

    model = torch.nn.Linear(256, 256)
    assert time_grad_accumulation(list(model.parameters()), warmup=0, repeats=1) > 0
    assert all(p.grad is None for p in model.parameters())
    assert time_grad_accumulation([]) == 0.0
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    assert time_grad_accumulation([frozen]) == 0.0
    assert np.isfinite(time_grad_accumulation(list(model.parameters())))

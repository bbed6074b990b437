"""Online re-planning (runtime/planning/replan.py): the refit of measured action times, and its config. The switch
itself,
on every rank at the same step and without changing results, is tests/test_engine_virtual.py's."""

from __future__ import annotations

import copy

import pytest

from ds_terapipe.config import parse_terapipe_config
from ds_terapipe.planner.cost import PipelineCost
from ds_terapipe.planner.schedule import Action, ActionKind
from ds_terapipe.planner.simulate import TimedAction
from ds_terapipe.planner.step_cost import StepCost
from ds_terapipe.planner.refit import measured_over_predicted, measured_sums, refit_cost, refit_step

F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT


def _cost(num_stages: int = 2) -> dict:
    points = [{"batch": 1, "slice": s, "context": c, "forward_ms": 1.0 * s / 8 + 0.01 * c,
               "backward_ms": 2.0 * s / 8 + 0.02 * c} for s in (8, 16, 32) for c in (0, 16, 32)]
    return {"stages": [{"points": [dict(p) for p in points], "weight_ms_per_token": 0.05}
                       for _ in range(num_stages)]}


def _event(chunk: int, kind: ActionKind, mb: int, i: int, ms: float) -> TimedAction:
    return TimedAction(chunk % 2, Action(chunk, kind, mb, i), 100.0, 100.0 + ms)


def test_measured_sums_group_actions_by_what_the_cost_model_predicts() -> None:
    slices = (16, 16, 32)
    timeline = [_event(0, F, 0, 0, 1.0), _event(0, F, 1, 0, 3.0), _event(0, F, 0, 2, 5.0), _event(1, B, 0, 1, 2.0),
                _event(1, W, 0, 0, 4.0)]
    per_mb = measured_sums(timeline, slices, 64, weights_per_slice=False)
    assert per_mb == [(0, "F", 16, 0, 2, 4.0), (0, "F", 32, 32, 1, 5.0), (1, "B", 16, 16, 1, 2.0),
                      (1, "W", 64, 0, 1, 4.0)]   # one W per micro-batch covers the whole sequence
    per_slice = measured_sums(timeline, slices, 64, weights_per_slice=True)
    assert (1, "W", 16, 0, 1, 4.0) in per_slice


def test_refit_scales_each_chunk_and_kind_by_measured_over_predicted() -> None:
    cost = _cost()
    model = PipelineCost.from_dict(cost)
    f = float(model.chunk(0).forward_ms(16, 16, 1))
    b = float(model.chunk(1).backward_ms(32, 0, 1))
    w = float(model.chunk(1).weight_ms(64, 1))
    samples = [(0, "F", 16, 16, 2, 2 * f * 1.5), (1, "B", 32, 0, 1, b * 0.5), (1, "W", 64, 0, 1, w * 2.0)]
    refit, ratios = refit_cost(cost, [samples], batch=1)
    assert ratios[0] == pytest.approx({"F": 1.5, "B": 1.0, "W": 1.0})   # no samples: the scale stays
    assert ratios[1] == pytest.approx({"F": 1.0, "B": 0.5, "W": 2.0})
    new = PipelineCost.from_dict(refit)
    assert float(new.chunk(0).forward_ms(16, 16, 1)) == pytest.approx(1.5 * f, rel=1e-6)
    assert float(new.chunk(0).backward_ms(16, 16, 1)) == pytest.approx(float(model.chunk(0).backward_ms(16, 16, 1)))
    assert float(new.chunk(1).backward_ms(32, 0, 1)) == pytest.approx(0.5 * b, rel=1e-6)
    assert float(new.chunk(1).weight_ms(64, 1)) == pytest.approx(2.0 * w, rel=1e-6)
    assert cost == _cost()   # the plan's own costs are not modified


def test_a_stall_in_one_measured_step_does_not_move_the_refit() -> None:
    # three measured steps of 16 forwards each, 1.5x the model; in one step a 40 ms stall of the host lands in one
    # forward (and the backward of another step runs 0.9x): each kind takes the median of its steps' ratios
    cost = _cost()
    model = PipelineCost.from_dict(cost)
    f = float(model.chunk(0).forward_ms(16, 16, 1))
    b = float(model.chunk(1).backward_ms(32, 0, 1))
    steps = [[(0, "F", 16, 16, 16, 16 * f * 1.5), (1, "B", 32, 0, 4, 4 * b)] for _ in range(3)]
    steps[1][0] = (0, "F", 16, 16, 16, 16 * f * 1.5 + 40.0)
    steps[2][1] = (1, "B", 32, 0, 4, 4 * b * 0.9)
    _, ratios = refit_cost(cost, steps, batch=1)
    assert ratios[0]["F"] == pytest.approx(1.5) and ratios[1]["B"] == pytest.approx(1.0)
    assert ratios[0]["B"] == ratios[1]["F"] == ratios[1]["W"] == 1.0   # no samples: the scale stays
    # a kind measured in one step only takes that step's ratio
    _, ratios = refit_cost(cost, [steps[0][:1], steps[0][1:]], batch=1)
    assert ratios[0]["F"] == pytest.approx(1.5) and ratios[1]["B"] == pytest.approx(1.0)


def test_refit_predicts_one_w_per_micro_batch_as_its_slices_w_work() -> None:
    cost = _cost()
    for stage in cost["stages"]:
        stage["weight_ms_per_slice"] = 1.0
    model = PipelineCost.from_dict(cost)
    slices = (16, 16, 32)
    w = sum(float(model.chunk(1).weight_ms(s, 1)) for s in slices)   # 3 fixed parts + 64 tokens
    refit, ratios = refit_cost(cost, [[(1, "W", 64, 0, 2, 2 * w * 1.25)]], batch=1, slices=slices)
    assert ratios[1]["W"] == pytest.approx(1.25)
    assert refit["stages"][1]["weight_ms_per_slice"] == pytest.approx(1.25)
    assert refit["stages"][1]["weight_ms_per_token"] == pytest.approx(0.05 * 1.25)


def test_a_step_s_actions_lose_the_fixed_cost_per_action_a_profile_s_points_keep_theirs() -> None:
    # the refit (a step's actions) takes the model's fixed 0.5 ms per forward off first; the plan cache's
    # re-timing (profile points, per_action=False) compares the whole milliseconds
    cost = {**_cost(), "step": {"action_ms": {"forward": 0.5}}}
    f = float(PipelineCost.from_dict(cost).chunk(0).forward_ms(16, 16, 1))
    samples = [(0, "F", 16, 16, 2, 2 * (2 * f + 0.5))]
    assert measured_over_predicted(cost, samples, 1)[0]["F"] == pytest.approx(2.0)
    assert measured_over_predicted(cost, samples, 1, per_action=False)[0]["F"] == pytest.approx(2.0 + 0.5 / f)
    assert measured_over_predicted(cost, samples, 1, per_action=False)[1] == {"F": 1.0, "B": 1.0, "W": 1.0}


@pytest.mark.parametrize("num_stages", [1, 2])
def test_equal_stages_written_once_are_refit_and_rescaled_per_stage(num_stages: int) -> None:
    """A profile of equal stages (every one-chunk engine's) is written once, ``"points"`` at the top: the plan
    cache's re-timing, the refit and the rescale read it as ``num_stages`` stages, and the rescaled cost keeps the
    other stages' times where only one stage's changed."""
    from ds_terapipe.planner.cost import per_stage_cost, scaled_cost
    from ds_terapipe.planner.freeze import frozen_cost

    uniform = PipelineCost.from_dict({**_cost(1)["stages"][0], "num_stages": num_stages}).to_dict()
    assert "stages" not in uniform and uniform["num_stages"] == num_stages
    given = copy.deepcopy(uniform)
    model = PipelineCost.from_dict(uniform)
    f = float(model.chunk(0).forward_ms(16, 16, 1))
    ratios = measured_over_predicted(uniform, [(0, "F", 16, 16, 1, 2 * f)], 1, per_action=False)
    assert sorted(ratios) == list(range(num_stages)) and ratios[0]["F"] == pytest.approx(2.0)
    refit, _ = refit_cost(uniform, [[(0, "F", 16, 16, 1, 2 * f)]], batch=1)
    scaled = PipelineCost.from_dict(scaled_cost(uniform, {0: {"F": 3.0}}))
    assert float(scaled.chunk(0).forward_ms(16, 16, 1)) == pytest.approx(3 * f, rel=1e-6)
    if num_stages == 2:
        assert float(scaled.chunk(1).forward_ms(16, 16, 1)) == pytest.approx(f, rel=1e-6)
    assert float(PipelineCost.from_dict(refit).chunk(0).forward_ms(16, 16, 1)) == pytest.approx(2 * f, rel=1e-6)
    assert len(per_stage_cost(uniform)["stages"]) == num_stages and "points" not in per_stage_cost(uniform)
    assert len(PipelineCost.from_dict(frozen_cost(uniform, list(range(num_stages + 1)), 0)).stages) == num_stages
    assert uniform == given   # none of it changed the cost it was given


def test_refit_step_takes_each_rank_s_own_tail_and_the_collectives_without_the_wait() -> None:
    # rank 0 finished its schedule 40 ms early and waited in the tied all-reduce; rank 1 (last in) waited least.
    # Rank 2 is outside the tied group: its ReduceTiedGrads only hands W over, local work of its own.
    old = {"action_ms": {"forward": 0.5}, "optimizer_ms": 20.0, "tied_reduce_ms": 1.0, "tied_ranks": [0, 1],
           "sync_ms": 2.0}
    steps = [{"step": 1000.0 + d, "loop": 990.0 + d, "optimizer": 30.0 + d, "grad_reduce": 1.0}
             for d in (0.0, 4.0, 8.0)]     # three measured steps: the medians are the middle ones
    terms = [(0, {**t, "tied_reduce": 45.0, "step": t["step"] + 3}) for t in steps] \
        + [(1, {**t, "tied_reduce": 5.0, "optimizer": 60.0}) for t in steps] \
        + [(2, {**t, "tied_reduce": 7.0, "loop": t["loop"] - 5}) for t in steps]
    refit, measured = refit_step(old, terms, num_ranks=3)
    new = StepCost.from_dict(refit)
    assert new.tied_reduce_ms == 5.0 and new.tied_ranks == (0, 1)
    assert new.optimizer_ms == (34.0, 60.0, 34.0)
    assert new.grad_reduce_ms == (1.0, 1.0, 8.0)            # rank 2: its W hand-over joins its own reduction
    assert new.sync_ms == 10.0                             # step - loop, the smallest over ranks
    assert new.forward_ms == (0.5,)                        # the fixed cost per action stays the init's
    assert measured["step_ms"] == 1004.0
    # the slowest rank's schedule without its tail: rank 2, 989 - (7 + 1 + 34); the rest of the step follows it
    assert measured["schedule_ms"] == 947.0 and measured["tail_ms"] == 57.0
    assert new.tail_ms(3) == 10.0 + max(5 + 1 + 34, 5 + 1 + 60, 8 + 34)


def test_the_time_outside_the_loop_is_the_median_of_each_step_s_own() -> None:
    # three steps spend 2, 30 (a stall) and 4 ms outside their loops of 1000, 990 and 980 ms: the median of the
    # steps' own is 4; the difference of the medians of step (1002) and loop (990), from different steps, says 12
    measured = ((1000.0, 2.0), (990.0, 30.0), (980.0, 4.0))
    terms = [(0, {"step": loop + outside, "loop": loop}) for loop, outside in measured]
    refit, _ = refit_step(None, terms, num_ranks=1)
    assert StepCost.from_dict(refit).sync_ms == 4.0


def test_refit_step_keeps_the_init_terms_when_a_rank_measured_nothing() -> None:
    old = {"optimizer_ms": 20.0, "sync_ms": 2.0}
    terms = [(0, {"step": 10.0, "loop": 9.0, "optimizer": 1.0})]
    assert refit_step(old, terms, num_ranks=2) == (old, {})
    assert refit_step(None, terms, num_ranks=2) == (None, {})
    refit, _ = refit_step(None, terms, num_ranks=1)         # a cost without a step part gets one
    assert StepCost.from_dict(refit).optimizer_ms == (1.0,) and StepCost.from_dict(refit).sync_ms == 1.0


def test_replan_needs_auto_slices_and_valid_settings() -> None:
    ok = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "replan": {"enabled": True}}})
    assert ok.replan.enabled and ok.replan.warmup_steps == 5 and ok.replan.min_gain == 0.03
    with pytest.raises(ValueError, match="replan.enabled needs slices \"auto\""):
        parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "slices": 4, "replan": {"enabled": True}}})
    with pytest.raises(ValueError, match="measure_steps"):
        parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "replan": {"measure_steps": 0}}})


def test_the_time_between_actions_is_fitted_so_the_simulated_schedule_takes_what_the_steps_measured() -> None:
    """The refit scales each action to its measured span; what the engine does between actions (sends, receives,
    the instruction loop) no span contains, so the refit adds a fixed time per forward and backward action that
    makes the simulated schedule match the measured one. A plan with more slices then pays it more often. When
    the simulation already takes as long, nothing is added."""
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate
    from ds_terapipe.planner.refit import calibrate_action_gap

    cost = {**_cost(), "step": {"action_ms": {"forward": 0.5, "backward": [0.2, 0.3]}, "optimizer_ms": 1.0}}
    slices = (16, 16, 32)
    schedule = build_schedule("1f1b", 2, 2, len(slices))
    base = simulate(schedule, PipelineCost.from_dict(cost), list(slices)).makespan_ms
    fitted, gap = calibrate_action_gap(cost, schedule, slices, 1, 1.2 * base)
    assert gap > 0
    got = simulate(schedule, PipelineCost.from_dict(fitted), list(slices)).makespan_ms
    assert got == pytest.approx(1.2 * base, rel=1e-4)
    step = StepCost.from_dict(fitted["step"])
    assert step.forward_ms == pytest.approx((0.5 + gap,)) and step.backward_ms == pytest.approx((0.2 + gap, 0.3 + gap))
    assert step.optimizer_ms == (1.0,) and fitted["stages"] == cost["stages"]   # the rest untouched
    # more slices, more actions: the same gap costs a finer plan more
    finer = build_schedule("1f1b", 2, 2, 8)
    extra = [simulate(finer, PipelineCost.from_dict(c), [8] * 8).makespan_ms for c in (cost, fitted)]
    assert extra[1] - extra[0] > got - base
    # already as long as measured (or longer): unchanged
    same, none = calibrate_action_gap(cost, schedule, slices, 1, 0.9 * base)
    assert none == 0.0 and same == cost
    bare = {k: v for k, v in cost.items() if k != "step"}   # no step terms at init: they start at 0
    assert calibrate_action_gap(bare, schedule, slices, 1, 1.1 * base)[1] > 0


def test_the_replanner_measures_only_the_steps_after_its_warmup() -> None:
    """``Replanner`` (runtime/planning/replan.py): the timeline is recorded from the step after ``warmup_steps``
    for ``measure_steps`` steps, and only those steps' actions and tails reach the refit (a warm-up step runs
    slower: cold caches, first allocations)."""
    from types import SimpleNamespace

    from ds_terapipe.runtime.planning.replan import Replanner

    cfg = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 32, "slices": "auto", "replan": {
        "enabled": True, "warmup_steps": 2, "measure_steps": 2}}})
    engine = SimpleNamespace(terapipe=cfg, record_timeline=False, uniform_step=True, stage_id=0,
                             plan=SimpleNamespace(slices=(16, 16), seq_len=32),
                             running=SimpleNamespace(schedule=SimpleNamespace(weights_per_slice=False)))
    replanner = Replanner(engine)
    decided = []
    replanner._decide = decided.append
    recorded = []
    for step in range(1, 6):
        replanner.before_step(engine)
        recorded.append(engine.record_timeline)
        engine.last_timeline = [_event(0, ActionKind.FORWARD, 0, 0, float(step))]
        engine.last_step_terms = {"optimizer_ms": float(step)}
        if step == 4:
            assert [[ms for *_, ms in samples] for samples in replanner.samples] == [[3.0]] and \
                [t["optimizer_ms"] for _, t in replanner.step_terms] == [3.0]
        replanner.after_step(engine)
    assert recorded == [False, False, True, True, False] and decided == [engine]
    assert replanner.done and engine.record_timeline is False


def test_the_replanner_and_the_freezer_meet_in_an_abort_aware_barrier_before_their_collectives(monkeypatch) -> None:
    """The re-plan decision's gather and a freeze's re-plan broadcast block without a deadline; a rank that failed
    after the last step's barrier (in DeepSpeed's logging at the end of ``train_batch``) must stop its peers before
    them, in a barrier that watches the abort flag (``engine.barrier``)."""
    from types import SimpleNamespace

    import ds_terapipe.runtime.planning.replan as replan_module
    from ds_terapipe.runtime.features.freeze import Freezer
    from ds_terapipe.runtime.planning.replan import Replanner

    calls: list[str] = []
    engine = SimpleNamespace(barrier=lambda what: calls.append(f"barrier: {what}"))
    monkeypatch.setattr(replan_module.dist, "get_world_size", lambda: 1)

    def gather(out: list, obj: object) -> None:
        calls.append("all_gather_object")
        raise RuntimeError("stop here")

    monkeypatch.setattr(replan_module.dist, "all_gather_object", gather)
    with pytest.raises(RuntimeError, match="stop here"):
        Replanner._decide(SimpleNamespace(samples=[], step_terms=[]), engine)
    assert calls == ["barrier: the re-planner's measured steps", "all_gather_object"], calls

    calls.clear()
    freezer = SimpleNamespace(target=lambda step: 2, steps_taken=lambda e: 5, num_frozen_layers=0,
                              _check_counts=lambda target: None, apply=lambda e, target: calls.append("apply"),
                              maybe_repack=lambda e: calls.append("maybe_repack"))
    Freezer.before_step(freezer, engine)
    assert calls == ["barrier: the step before freezing", "apply", "maybe_repack"], calls

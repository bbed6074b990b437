"""Progressive freezing (runtime/features/freeze.py): its config, the schedule without frozen chunks' backward, the
frozen
cost model, the automatic rule; then, on 2 gloo ranks (one launch), training with frozen layers against the
unsliced reference with the same layers frozen at the same steps, and the refusals."""

from __future__ import annotations

import pytest

from ds_terapipe.config import AutoFreezeConfig, parse_terapipe_config
from ds_terapipe.planner.cost import PipelineCost
from ds_terapipe.planner.registry import get_schedule, schedule_names
from ds_terapipe.planner.schedule import ActionKind, build_schedule
from ds_terapipe.planner.simulate import simulate
from ds_terapipe.planner.verify import replay
from ds_terapipe.planner.freeze import auto_freeze_count, freeze_lowered, frozen_chunk_count, frozen_cost


def _parse(freeze: object) -> object:
    return parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, "freeze": freeze}}).freeze


# -- config -----------------------------------------------------------------------------------------------------
def test_freeze_config_schedule_and_auto() -> None:
    cfg = _parse({"schedule": [[0, 1], [10, 3], [20, 3]]})
    assert cfg.schedule == [[0, 1], [10, 3], [20, 3]] and cfg.auto is None and cfg.replan
    auto = _parse({"auto": {"check_interval": 5, "aggressiveness": 1.0}}).auto
    assert auto.check_interval == 5 and auto.tolerance == 0.1 and auto.aggressiveness == 1.0
    assert parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64}}).freeze is None


@pytest.mark.parametrize("freeze, match", [
    ({"schedule": [[5, 1], [2, 3]]}, "not monotone: \\[5, 1\\] then \\[2, 3\\]"),
    ({"schedule": [[1, 3], [2, 1]]}, "never unfreezes"),
    ({"schedule": [[1, 3], [1, 4]]}, "not monotone"),
    ({"schedule": [[1, -1]]}, ">= 0"),
    ({"schedule": [[1]]}, "pairs of ints"),
    ({"schedule": []}, "non-empty"),
    ({}, "exactly one policy"),
    ({"schedule": [[1, 2]], "auto": {}}, "not both"),
    ({"auto": {"aggressiveness": 0}}, "aggressiveness=0 must be > 0"),
    ({"auto": {"aggressiveness": 1.5}}, "aggressiveness=1.5 must be <= 1"),
    ({"auto": {"agressiveness": 0.5}}, "freeze.auto: unknown key\\(s\\) \\['agressiveness'\\]; valid keys are"),
    ({"shedule": [[1, 2]]}, "terapipe.freeze: unknown key\\(s\\) \\['shedule'\\]"),
])
def test_freeze_config_refusals(freeze: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        _parse(freeze)


# -- schedule and cost model --------------------------------------------------------------------------------------
def _grid() -> list[tuple[str, int, int]]:
    out = []
    for name in schedule_names():
        spec = get_schedule(name)
        for p in (2, 3, 4):
            out.append((name, p, spec.virtual_stages))
    return out


@pytest.mark.parametrize("name, p, v", _grid())
def test_frozen_chunks_drop_backward_and_every_gradient_into_them(name: str, p: int, v: int) -> None:
    for deferred in (False, True):
        for frozen in range(p * v):
            plan = build_schedule(name, p, 3, 2, deferred, virtual_stages=v)
            lowered = freeze_lowered(plan, frozen)
            replay(lowered)  # pairs up and runs to the end on every rank
            for stream in lowered.stages:
                for a in stream:
                    if a.chunk < frozen:
                        assert a.kind in (ActionKind.FORWARD, ActionKind.SEND_F, ActionKind.RECV_F), (frozen, a)
                    if a.kind is ActionKind.SEND_B:
                        assert a.chunk - 1 >= frozen, (frozen, a)
            trained = sum(1 for st in lowered.stages for a in st if a.kind is ActionKind.BACKWARD)
            assert trained == (p * v - frozen) * 3 * 2


def test_frozen_chunk_count_and_cost() -> None:
    parts = [0, 4, 7]
    assert [frozen_chunk_count(parts, k) for k in range(8)] == [0, 0, 0, 0, 1, 1, 1, 2]
    points = [{"batch": 1, "slice": s, "context": c, "forward_ms": 1.0 * s, "backward_ms": 2.0 * s}
              for s in (8, 16) for c in (0, 8)]
    cost = {"stages": [{"points": [dict(q) for q in points], "weight_ms_per_token": 0.5} for _ in range(2)]}
    half = frozen_cost(cost, parts, 2)   # chunk 0: 2 of 4 layers still train
    assert half["stages"][0]["points"][0]["backward_ms"] == pytest.approx(8.0)
    assert half["stages"][0]["weight_ms_per_token"] == pytest.approx(0.25)
    assert half["stages"][1] == cost["stages"][1] and half["stages"][0]["points"][0]["forward_ms"] == 8.0
    gone = frozen_cost(cost, parts, 4)
    assert all(q["backward_ms"] == 0.0 for q in gone["stages"][0]["points"])
    assert cost["stages"][0]["points"][0]["backward_ms"] == 16.0   # not modified
    # the simulated step of the frozen schedule is shorter, and the planner's schedule accepts the frozen cost
    model, frozen_model = PipelineCost.from_dict(cost), PipelineCost.from_dict(gone)
    plan = build_schedule("1f1b", 2, 4, 2)
    full = simulate(freeze_lowered(plan, 0), model, [8, 8]).makespan_ms
    less = simulate(freeze_lowered(plan, 1), frozen_model, [8, 8]).makespan_ms
    assert less < full


# -- the automatic rule -------------------------------------------------------------------------------------------
def test_auto_rule_freezes_stable_layers_front_to_back_within_the_budget() -> None:
    layers = [0, 1, 2, 3, 4, 6]   # layer 5 has no parameters
    cfg = AutoFreezeConfig(tolerance=0.1, aggressiveness=0.5)
    prev = {i: 1.0 for i in layers}
    stable = {i: 1.05 for i in layers}
    # all stable: at most floor(0.5 x 6) = 3 freeze, front first
    assert auto_freeze_count(0, prev, stable, layers, cfg) == 3
    # layer 1 moved: only layer 0 freezes (a layer that is not stable stops the run)
    assert auto_freeze_count(0, prev, {**stable, 1: 2.0}, layers, cfg) == 1
    # the first training layer moved: nothing, even if later ones are stable
    assert auto_freeze_count(0, prev, {**stable, 0: 0.5}, layers, cfg) == 0
    # a prefix is never undone, whatever the norms say
    assert auto_freeze_count(3, {3: 1.0, 4: 1.0, 6: 1.0}, {3: 9.0, 4: 9.0, 6: 9.0}, layers, cfg) == 3
    # layers without parameters ride along; the last layer with parameters never freezes
    all_in = AutoFreezeConfig(tolerance=0.1, aggressiveness=1.0)
    assert auto_freeze_count(0, prev, stable, layers, all_in) == 6
    assert auto_freeze_count(4, {4: 1.0, 6: 1.0}, {4: 1.0, 6: 1.0}, layers, all_in) == 6
    assert auto_freeze_count(6, {6: 1.0}, {6: 1.0}, layers, all_in) == 6
    # at least one per check when aggressiveness x training layers < 1; a cap holds
    tiny = AutoFreezeConfig(tolerance=0.1, aggressiveness=0.01)
    assert auto_freeze_count(0, prev, stable, layers, tiny) == 1
    capped = AutoFreezeConfig(tolerance=0.1, aggressiveness=1.0, max_frozen_layers=2)
    assert auto_freeze_count(0, prev, stable, layers, capped) == 2


def test_auto_rule_is_monotone_over_a_run() -> None:
    import random

    rng = random.Random(0)
    layers = list(range(8))
    cfg = AutoFreezeConfig(tolerance=0.2, aggressiveness=0.5)
    frozen, prev = 0, {i: 1.0 for i in layers}
    history = []
    for _ in range(40):
        now = {i: prev[i] * rng.uniform(0.7, 1.3) for i in layers}
        frozen = auto_freeze_count(frozen, {i: prev[i] for i in layers if i >= frozen},
                                   {i: now[i] for i in layers if i >= frozen}, layers, cfg)
        history.append(frozen)
        prev = now
    assert history == sorted(history) and history[-1] <= 7 and history[-1] > 0


def test_auto_checks_count_steps_taken_after_the_warmup_and_give_every_training_layer_a_norm() -> None:
    """``Freezer.observe_gradients`` on one rank (no process group: the collective half is ``after_optimizer_step``)
    with ``warmup_steps`` 3, ``check_interval`` 2 and one step DeepSpeed skipped: a check at steps taken 3, 5, 7
    only (none pending between them), the squared norms of every training layer, 0 for a layer without gradients
    (its gradient vanished: stable for the rule, not missing)."""
    from types import SimpleNamespace

    import torch

    from ds_terapipe.runtime.features.freeze import Freezer

    layers = [torch.nn.Linear(2, 1, bias=False) for _ in range(3)]
    layers[1].weight.grad, layers[2].weight.grad = torch.full((1, 2), 2.0), torch.full((1, 2), 3.0)
    module = SimpleNamespace(_local_start=0, _local_stop=3, _layer_specs=[None] * 3,
                             _modules={str(i): layer for i, layer in enumerate(layers)})
    freezer = object.__new__(Freezer)
    freezer.cfg = SimpleNamespace(auto=_parse({"auto": {"warmup_steps": 3, "check_interval": 2}}).auto)
    freezer.num_frozen_layers, freezer.param_layers = 0, (0, 1, 2)
    freezer.grads = SimpleNamespace(read=lambda param: param.grad, scale=lambda: 1.0)
    engine = SimpleNamespace(module=module, optimizer=object(), stage_id=0, skipped_steps=1)
    checked = []
    for taken in range(9):
        engine.global_steps = taken + 1
        freezer._check = "a check of an earlier step"
        freezer.observe_gradients(engine)
        if freezer._check is not None:
            checked.append((taken, freezer._check))
    assert [taken for taken, _ in checked] == [3, 5, 7]
    assert checked[-1][1] == (8, {0: 0.0, 1: 8.0, 2: 18.0}, 1.0, 1)   # (DeepSpeed's step, squares, scale, skipped)


def test_layer_norms_sum_each_layer_s_split_rows_once_and_undo_the_loss_scale() -> None:
    """``layer_norms``: a layer's squares from one stage, a split table's rows summed over the stages that hold
    them, the root divided by the loss scale (an fp16 gradient is the scaled one)."""
    from ds_terapipe.runtime.features.freeze import layer_norms

    tables = [{0: 36.0, (1, 0): 16.0}, {0: 36.0, (1, 1): 48.0, 2: 4.0}]   # a replica repeats layer 0's value
    assert layer_norms(tables) == {0: 6.0, 1: 8.0, 2: 2.0}
    assert layer_norms(tables, scale=2.0) == {0: 3.0, 1: 4.0, 2: 1.0}
    # ZeRO 1 on 2 replicas of one stage: each holds fragments of a layer's gradient (key (layer, stage, partition)),
    # summed; a replica that holds none of layer 1 still names it (its own key, 0)
    zero1 = [{0: 0.0, 1: 0.0, (0, 0, 0): 20.0, (1, 0, 0): 9.0}, {0: 0.0, 1: 0.0, (0, 0, 1): 16.0}]
    assert layer_norms(zero1) == {0: 6.0, 1: 3.0}


# -- 2 gloo ranks --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def freeze_results(tmp_path_factory):
    from tests.dist_harness import launch

    results = launch("freeze", 2, tmp_path_factory.mktemp("freeze"), timeout_s=600)
    return [r["results"] for r in results]


def _cases(results, prefix: str):
    return [(rank, case) for rank, cases in enumerate(results) for case in cases if case["case"].startswith(prefix)]


def test_frozen_training_equals_the_reference_with_those_layers_frozen(freeze_results) -> None:
    cases = _cases(freeze_results, "schedule ") + _cases(freeze_results, "auto")
    assert len(cases) == 2 * 6
    for rank, case in cases:
        where = f"rank {rank} {case['case']}"
        assert len(case["losses"]) == len(case["ref_losses"]) == len(case["grad_errs"]) > 0, where
        for got, want in zip(case["losses"], case["ref_losses"]):
            assert got == pytest.approx(want, rel=1e-5), where
        for step in case["grad_errs"]:
            assert step["err"] <= 1e-5, (where, step)
            assert not step["missing"], (where, step)   # every gradient the reference has, this rank has too
        # after a freeze only the trained parameters have gradients (the reference's names, compared above)
        assert case["param_rel_err"] <= 1e-5, (where, case["param_worst"])


def test_frozen_parameters_stay_bit_identical_without_optimizer_state(freeze_results) -> None:
    some_frozen: dict[str, bool] = {}
    for rank, case in _cases(freeze_results, "schedule ") + _cases(freeze_results, "auto"):
        assert all(not changed for changed in case["changed"]), (rank, case["case"], case["changed"])
        assert all(not state for state in case["with_state"]), (rank, case["case"])
        some_frozen[case["case"]] = some_frozen.get(case["case"], False) or any(case["frozen"])
        # the tied embedding weight keeps training through the head
        assert all("tied_modules.embed.wte.weight" not in frozen for frozen in case["frozen"])
    assert len(some_frozen) == 6 and all(some_frozen.values()), some_frozen


def test_a_rank_with_only_frozen_layers_runs_forward_only(freeze_results) -> None:
    for rank, case in _cases(freeze_results, "schedule "):
        # from step 2 on layers [0, 4) are frozen: with v = 1 that is all of rank 0, which gets no gradient
        if case["local_chunks"] == [0]:
            assert {"B", "RECV_B"} <= set(case["actions"][0])
            assert case["actions"][-1] == ["F", "SEND_F"], case
        if case["local_chunks"] == [1]:
            assert "SEND_B" not in case["actions"][-1] and "B" in case["actions"][-1]
        events = case["events"]
        assert [e["layers"] for e in events] == [[0, 2], [2, 4]] and [e["step"] for e in events] == [1, 2]


def test_auto_policy_freezes_front_to_back_the_same_on_every_rank_and_replans(freeze_results) -> None:
    per_rank = [case for _, case in _cases(freeze_results, "auto")]
    assert per_rank[0]["events"] == per_rank[1]["events"]
    events = per_rank[0]["events"]
    assert events, "the auto policy with a generous tolerance froze nothing"
    counts = [e["layers"][1] for e in events]
    assert counts == sorted(counts) and all(e["layers"][0] < e["layers"][1] for e in events)
    assert all(b["layers"][0] == a["layers"][1] for a, b in zip(events, events[1:]))
    assert counts[-1] < 7
    # re-planned from the profiled costs with the frozen backward removed: predicted faster each time
    assert all(e["after_ms"] < e["before_ms"] for e in events), events
    assert per_rank[0]["slices"] == per_rank[1]["slices"]


def test_freeze_refusals_on_every_rank_before_training(freeze_results) -> None:
    expected = {"refuse too many": "freeze 9 layers but the model has 7",
                "refuse all": "freezes every layer with parameters",
                "refuse repack micro-batches": "gradient_accumulation_steps=3 must be divisible by the 2 pipeline"}
    for rank, cases in enumerate(freeze_results):
        got = {c["case"]: c for c in cases if c["case"].startswith("refuse")}
        assert sorted(got) == sorted(expected)
        for name, text in expected.items():
            assert got[name]["raised"] == "ValueError" and text in got[name]["message"], (rank, got[name])


def test_a_resumed_run_freezes_the_same_layers_and_continues_identically(freeze_results) -> None:
    for rank, cases in enumerate(freeze_results):
        case = next(c for c in cases if c["case"] == "resume")
        assert case["frozen"][0] == case["frozen"][1] > 0, (rank, case)
        assert case["frozen_names"][0] == case["frozen_names"][1], (rank, case)
        # the second engine's own plan differed (set by the worker): the load ran the checkpoint's slicing again,
        # and both runs went on with the same slicing (a freeze in that step may have re-planned both)
        assert case["profiled"] != case["saved_slices"] == case["loaded_slices"], (rank, case)
        assert case["slices"][0] == case["slices"][1], (rank, case)
        # the step after the load may freeze more and re-plan: then both runs switch alike (the resumed one
        # re-plans from the checkpoint's costs, not from its own profile)
        assert case["sources"][1] == "checkpoint" or case["sources"] == ["replanned", "replanned"], (rank, case)
        assert case["losses"][0] == case["losses"][1] and case["params_equal"], (rank, case)


def test_a_rank_with_nothing_left_to_train_joins_gradient_clipping(freeze_results) -> None:
    for rank, cases in enumerate(freeze_results):
        case = next(c for c in cases if c["case"] == "untied clipping")
        assert len(case["losses"]) == len(case["ref_losses"]) == 3, case
        assert case["losses"] == pytest.approx(case["ref_losses"], rel=1e-5), case
        # the parameters after 3 clipped steps are the reference's clipped by the global norm (rank 0's frozen ones
        # included), and the clipping mattered: without it the reference ends elsewhere
        assert case["param_rel_err"] <= 1e-5, (rank, case["param_worst"], case["param_rel_err"])
        assert case["unclipped_param_rel_err"] > 1e-3 or case["stage"] == 0, case
        assert not any(case["changed"]), case
        if case["stage"] == 0:
            assert case["frozen"][1:] == [case["frozen"][1]] * 2 and case["frozen"][1] > 0 and not case["trained"]
            assert case["actions"][-1] == ["F", "SEND_F"]
        else:
            assert case["trained"]


def test_a_repack_continues_on_fewer_stages_and_trains_as_if_nothing_moved(freeze_results) -> None:
    cases = [(rank, c) for rank, c in _cases(freeze_results, "repack ") if c["case"] != "repack resume"]
    assert len(cases) == 2 * 2
    for rank, case in cases:
        where = f"rank {rank} {case['case']}"
        # stage 0 held layers [0, 4) only: at step 2 the run went on as 1 stage x 2 replicas, 1 micro-batch each
        repacks = [e for e in case["events"] if "repack" in e]
        assert [e["step"] for e in repacks] == [2], (where, case["events"])
        assert repacks[0]["repack"]["stages"] == [2, 1] and repacks[0]["repack"]["replicas"] == [1, 2], where
        assert (case["num_stages"], case["replicas"], case["micro_batches"], case["stage"]) == (1, 2, 1, 0), where
        assert set(case["names"]) >= set(case["plain_names"]), where   # every layer on every rank now
        # the same losses and parameters as the run that kept 2 stages, and as the unsliced reference
        assert len(case["losses"]) == len(case["plain_losses"]) == len(case["ref_losses"]) > 0, where
        for got, plain, ref in zip(case["losses"], case["plain_losses"], case["ref_losses"]):
            assert got == pytest.approx(plain, rel=1e-5) and got == pytest.approx(ref, rel=1e-5), where
        assert case["param_rel_err"] <= 1e-5 and case["ref_param_rel_err"] <= 1e-5, (where, case["ref_worst"])
        assert case["evals"][1] == pytest.approx(case["evals"][0], rel=1e-5), (where, case["evals"])
        assert case["stray_waiters"] == 0, where   # the replaced engine's transfer thread was stopped
        # frozen weights moved bit-identical (both runs trained them with the same slices before they froze);
        # only the trained layers carry optimizer state
        assert case["first_slices"][0] == case["first_slices"][1], (where, case["first_slices"])
        assert not case["frozen_differ"] and not any(case["changed"]) and not any(case["with_state"]), where
        assert case["state_names"] and all(not n.startswith(("1.", "2.", "3.")) for n in case["state_names"]), where


def test_a_checkpoint_written_after_a_repack_resumes_repacked_and_exports(freeze_results) -> None:
    for rank, cases in enumerate(freeze_results):
        case = next(c for c in cases if c["case"] == "repack resume")
        assert case["layout"] == [1, 2] and case["frozen"] == 4, (rank, case)
        assert case["losses"][0] == case["losses"][1] and case["params_equal"] and case["state_equal"], (rank, case)
        assert case["exported_matches"], (rank, case)

"""Tier (a): planning for schedules with virtual stages: the slicing DP plans for the schedule it simulates, the
CLI's --virtual-stages, memory estimates per rank, and timelines with one row per rank and chunks labelled.

    python -m pytest -q tests/test_chunk_planning.py
"""
from __future__ import annotations

import json

import pytest

from ds_terapipe.cli import main
from ds_terapipe.planner.presets import analytic_pipeline_cost, preset_memory_model
from ds_terapipe.planner.schedule import build_schedule
from ds_terapipe.planner.simulate import simulate
from ds_terapipe.planner.slicing import MemoryModel, SlicingPlan, _Simulated, memory_shortfall, plan_slicing
from ds_terapipe.trace import events_to_chrome_trace, load_chrome_trace
from tests.test_cli import linear_cost_points

CHUNKED = {"interleaved-1f1b": (2, 3), "looped-bfs": (2, 4), "dualpipev": (2,), "zbv": (2,)}
SMALL = ["--model", "gpt3-1b", "--device", "a100", "--stages", "4", "--seq-len", "512", "--granularity", "32"]


@pytest.mark.parametrize("name", CHUNKED)
def test_plan_is_the_simulated_schedule_it_will_run(name):
    p, L, g, m = 4, 512, 32, 2
    for v in CHUNKED[name]:
        cost = analytic_pipeline_cost("gpt3-1b", "a100", p * v)
        plan = plan_slicing(cost, L, num_microbatches=m, granularity=g, schedule=name, virtual_stages=v)
        assert (plan.num_stages, plan.virtual_stages, plan.schedule) == (p, v, name)
        res = simulate(build_schedule(name, p, m, plan.num_slices, virtual_stages=v), cost, list(plan.slices))
        assert plan.predicted_ms == pytest.approx(res.makespan_ms, rel=1e-12)
        assert plan.bubble_fraction == pytest.approx(res.bubble_fraction, rel=1e-12)
        unsliced = simulate(build_schedule(name, p, m, 1, virtual_stages=v), cost, [L])
        assert plan.unsliced_ms == pytest.approx(unsliced.makespan_ms, rel=1e-12)
        assert plan.predicted_ms <= plan.unsliced_ms and plan.num_slices > 1
    default = plan_slicing(analytic_pipeline_cost("gpt3-1b", "a100", 2 * p), L, granularity=g, schedule=name)
    assert default.virtual_stages == 2   # the schedule's default


@pytest.mark.parametrize("name", CHUNKED)
def test_lower_bounds_stay_below_the_simulated_makespan_with_chunks(name):
    """The bound that lets the planner skip candidates is sound per chunk, with comm and local hand-offs."""
    v = CHUNKED[name][-1]
    cost = analytic_pipeline_cost("gpt3-1b", "v100", 3 * v)
    sim = _Simulated(cost, name, 256, virtual_stages=v)
    plans = [[256]] + [[16 * x for x in parts] for parts in ([8, 8], [4, 4, 8], [1, 2, 3, 4, 6], [2] * 8)]
    for units in (1, 2, 5):
        bounds = sim.lower_bounds(plans, units, 1)
        for plan, bound in zip(plans, bounds):
            res = sim.run(plan, units, 1)
            assert bound <= res.makespan_ms + 1e-9, (plan, units, bound, res.makespan_ms)
            assert bound >= max(res.busy_ms) - 1e-9   # a rank works all its chunks: the rank bound
        assert max(bounds) > 0


def test_planner_refuses_costs_and_chunk_counts_it_cannot_plan():
    with pytest.raises(ValueError, match="cost has 6 stages, not a multiple of virtual_stages = 4: the cost model's "
                                         "stages are chunks"):
        plan_slicing(analytic_pipeline_cost("gpt3-1b", "a100", 6), 256, granularity=32, schedule="looped-bfs",
                     virtual_stages=4)
    with pytest.raises(ValueError, match="virtual_stages = 3: dualpipev places exactly two chunks per rank"):
        plan_slicing(analytic_pipeline_cost("gpt3-1b", "a100", 6), 256, granularity=32, schedule="dualpipev",
                     virtual_stages=3)
    with pytest.raises(ValueError, match="virtual_stages = 2: this schedule places one chunk per rank"):
        plan_slicing(analytic_pipeline_cost("gpt3-1b", "a100", 4), 256, granularity=32, schedule="1f1b",
                     virtual_stages=2)


def test_memory_estimates_per_rank_with_chunks():
    memory = preset_memory_model("gpt3-1b", 4)
    args = dict(num_stages=4, num_microbatches=4, micro_batch_size=1, num_splits=1, seq_len=512, num_slices=8)
    gpipe = memory.peak_bytes(schedule="gpipe", **args)
    assert memory.peak_bytes(schedule="looped-bfs", virtual_stages=2, **args) == gpipe   # every unit alive
    inter = memory.peak_bytes(schedule="interleaved-1f1b", virtual_stages=2, **args)
    assert inter < gpipe
    # The estimate never grows with the slice count (a memory cap becomes a minimum slice count).
    for name, v in (("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("dualpipev", 2), ("zbv", 2)):
        values = [MemoryModel.live_subbatches(name, 0, 4, 4 * n, n, v) for n in range(1, 33)]
        assert all(b <= a + 1e-12 for a, b in zip(values, values[1:])), (name, v)
        values = [MemoryModel.held_subbatches(name, 0, 4, 4, n, v) for n in range(1, 33)]
        assert all(b <= a + 1e-12 for a, b in zip(values, values[1:])), (name, v)
        values = [memory.peak_bytes(schedule=name, virtual_stages=v, **{**args, "num_slices": n}) for n in range(1, 33)]
        assert all(b <= a + 1e-9 for a, b in zip(values, values[1:])), (name, v)
    # Suggestions name only schedules that run the same chunks per rank.
    short = memory_shortfall(memory, 1.0, schedule="interleaved-1f1b", num_stages=4, num_microbatches=4,
                             micro_batch_size=1, seq_len=512, granularity=32, virtual_stages=2)
    assert short is not None and short.lower_schedule == "zbv"   # the V that holds least


@pytest.mark.parametrize("name", ["dualpipev", "zbv"])
@pytest.mark.parametrize("factors", [(34.0, 32.0), (2.0, 32.0)], ids=["no recomputation", "recomputation"])
def test_v_schedules_estimate_the_w_inputs_their_units_hold(name, factors):
    """A backwarded unit keeps its Linears' inputs and output gradients until its W. dualpipev's W's may wait
    behind later work, so the estimate prices up to twice its in-flight cap, the units beyond it at the W inputs'
    size; zbv's cap already counts them. Against the exact peak of each built schedule (a rank's units holding
    activations and those holding only W inputs, weighed at each action), with and without recomputation (which
    shrinks activations, not W inputs): never below it, and for dualpipev at m >= 4 within 25% above it."""
    act, w_in = factors
    mem = MemoryModel(1, 1, bytes_per_element=2, activation_factor=act, weight_input_factor=w_in)
    per_unit, per_w = act + 4.0, w_in   # bytes per token per layer per hidden: activations + KV cache; W inputs
    for p, m, n in ((2, 1, 4), (2, 2, 4), (2, 4, 2), (2, 8, 5), (3, 8, 2), (4, 4, 3), (4, 8, 1), (4, 16, 2)):
        sched = build_schedule(name, p, m, n, deferred_weight_grads=True)
        tokens = 1024
        estimate = mem.peak_bytes(schedule=name, num_stages=p, num_microbatches=m, micro_batch_size=1, num_splits=1,
                                  seq_len=tokens, num_slices=n, virtual_stages=2)
        exact = 0.0
        for stream in sched.stages:
            live = waiting = 0
            for action in stream:
                live += (action.kind.name == "FORWARD") - (action.kind.name == "BACKWARD")
                waiting += (action.kind.name == "BACKWARD") - (action.kind.name == "WEIGHT")
                # a chunk-unit is 1/n of a micro-batch's tokens on half a rank's layers (one layer per rank here)
                exact = max(exact, (live * per_unit + waiting * per_w) * tokens / (2 * n))
        assert exact <= estimate + 1e-6, (p, m, n, exact, estimate)
        if name == "dualpipev" and m >= 4 and factors[0] > factors[1]:
            assert estimate <= 1.25 * exact, (p, m, n, exact, estimate)
        # without deferral (shard_params turns it off) a backward computes its weight gradients: no W inputs wait
        plain = MemoryModel(1, 1, bytes_per_element=2, activation_factor=act, weight_input_factor=w_in,
                            deferred_weight_grads=False)
        live = max(MemoryModel.live_subbatches(name, r, p, m, n, 2) for r in range(p))
        got = plain.peak_bytes(schedule=name, num_stages=p, num_microbatches=m, micro_batch_size=1, num_splits=1,
                               seq_len=tokens, num_slices=n, virtual_stages=2)
        assert got == pytest.approx(live * per_unit * tokens)


def test_slicing_plan_keeps_virtual_stages_and_reads_old_dicts():
    plan = plan_slicing(analytic_pipeline_cost("gpt3-1b", "a100", 8), 256, granularity=32,
                        schedule="interleaved-1f1b")
    assert SlicingPlan.from_dict(plan.to_dict()) == plan and plan.to_dict()["virtual_stages"] == 2
    assert " v=2 " in str(plan)
    old = plan_slicing(analytic_pipeline_cost("gpt3-1b", "a100", 4), 256, granularity=32).to_dict()
    del old["virtual_stages"]
    assert SlicingPlan.from_dict(old).virtual_stages == 1


# -------------------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("name", CHUNKED)
def test_cli_plan_and_simulate_round_trip_with_virtual_stages(name, capsys, tmp_path):
    v = CHUNKED[name][-1]
    argv = [*SMALL, "--microbatches", "2", "--schedule", name, "--virtual-stages", str(v)]
    assert main(["plan", *argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    for key in ("slices", "predicted_ms", "unsliced_ms", "speedup", "bubble_fraction"):
        assert key in plan
    assert (plan["num_stages"], plan["virtual_stages"], sum(plan["slices"])) == (4, v, 512)
    trace = tmp_path / "t.json"
    assert main(["simulate", *argv, "--json", "--trace", str(trace)]) == 0
    sim = json.loads(capsys.readouterr().out)
    assert sim["slices"] == plan["slices"] and sim["virtual_stages"] == v and sim["num_stages"] == 4
    assert sim["makespan_ms"] == pytest.approx(plan["predicted_ms"], rel=1e-12)
    assert len(sim["busy_ms"]) == len(sim["peak_in_flight"]) == 4
    events = load_chrome_trace(trace)   # one row (pid) per rank, actions name their chunks
    assert {e.stage for e in events} == set(range(4)) and {e.action.chunk for e in events} == set(range(4 * v))
    doc = json.loads(trace.read_text())
    names = {ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "process_name"}
    assert names == {f"rank {r}" for r in range(4)}
    assert all("chunk" in ev["args"] for ev in doc["traceEvents"] if ev["ph"] == "X")
    given = [a for a in argv if a not in ("--granularity", "32")]   # --slices replaces the search
    assert main(["simulate", *given, "--slices", ",".join(map(str, plan["slices"]))]) == 0
    text = capsys.readouterr().out
    assert f"4 x a100 ({v} chunks each)" in text and "per rank" in text


def test_cli_default_virtual_stages_and_v1_output_unchanged(capsys):
    assert main(["plan", *SMALL, "--schedule", "dualpipev", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["virtual_stages"] == 2
    assert main(["plan", *SMALL]) == 0
    out = capsys.readouterr().out
    assert out.startswith("pipeline:    gpt3-1b on 4 x a100 (analytic cost), gpipe, seq_len 512, ") and "chunks" not in out


@pytest.mark.parametrize("argv, needle", [
    (["--schedule", "dualpipev", "--virtual-stages", "3"],
     "--schedule dualpipev --virtual-stages 3: virtual_stages = 3: dualpipev places exactly two chunks per rank"),
    (["--schedule", "gpipe", "--virtual-stages", "2"],
     "--schedule gpipe --virtual-stages 2: virtual_stages = 2: this schedule places one chunk per rank"),
    (["--schedule", "interleaved-1f1b", "--virtual-stages", "1"],
     "needs virtual_stages >= 2"),
    (["--schedule", "looped-bfs", "--virtual-stages", "8"],
     "--stages 4 x --virtual-stages 8 = 32 chunks exceeds the 24 layers of gpt3-1b"),
    (["--schedule", "looped-bfs", "--virtual-stages", "0"], "--virtual-stages"),
])
def test_cli_refuses_virtual_stages_it_cannot_run(argv, needle, capsys):
    assert main(["plan", *SMALL, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds-terapipe: error: ") and needle in err and len(err.strip().splitlines()) == 1


def test_cli_cost_file_describes_chunks(capsys, tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps({"num_stages": 6, "points": linear_cost_points(256, 0.01)}))
    assert main(["plan", "--cost", str(path), "--seq-len", "256", "--granularity", "32", "--schedule", "dualpipev",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["num_stages"], plan["virtual_stages"]) == (3, 2)
    assert main(["plan", "--cost", str(path), "--seq-len", "256", "--granularity", "32", "--schedule",
                 "looped-bfs", "--virtual-stages", "4"]) == 2
    assert "describes 6 stages, not a multiple of --virtual-stages 4" in capsys.readouterr().err


def test_chrome_trace_of_one_chunk_runs_is_unchanged(tmp_path):
    res = simulate(build_schedule("1f1b", 2, 1, 2), analytic_pipeline_cost("gpt3-1b", "a100", 2), [64, 64])
    doc = json.loads(events_to_chrome_trace(res.events, tmp_path / "t.json").read_text())
    assert {ev["args"]["name"] for ev in doc["traceEvents"] if ev["name"] == "process_name"} == {"stage 0", "stage 1"}
    assert all(set(ev["args"]) == {"microbatch", "slice"} for ev in doc["traceEvents"] if ev["ph"] == "X")


def test_engine_schedule_takes_the_chunks_its_schedule_places():
    pytest.importorskip("deepspeed")
    from ds_terapipe.runtime.execution.schedule import TokenPipeSchedule

    for name in CHUNKED:
        with pytest.raises(ValueError, match="virtual_stages = 1"):
            TokenPipeSchedule(name, 2, 2, 0, 2)   # one chunk per rank is not this schedule's placement
        assert {a.chunk for a in TokenPipeSchedule(name, 2, 2, 0, 2, virtual_stages=2).actions} == \
            ({0, 2} if name not in ("dualpipev", "zbv") else {0, 3})
    assert TokenPipeSchedule("1f1b", 2, 2, 0, 2).actions   # one chunk per rank: as before

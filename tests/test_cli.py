"""Tier (a): the ds-terapipe command line, run in-process (``main(argv)``) except for two subprocess checks.

    python -m pytest -q tests/test_cli.py

Small pipelines (gpt3-1b on 4 stages, 512 tokens, granularity 32) keep the in-process tests to milliseconds; the
48-stage GPT-3 175B plan of the issue runs once, as a ``python -m ds_terapipe`` round trip.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ds_terapipe.cli import main
from ds_terapipe.planner.presets import DEVICE_PRESETS, MODEL_PRESETS

SMALL = ["--model", "gpt3-1b", "--device", "a100", "--stages", "4", "--seq-len", "512", "--granularity", "32"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    assert len(out.strip().splitlines()) == 1, f"--json must print exactly one line, got {out!r}"
    return json.loads(out)


def linear_cost_points(max_len: int, ms_per_token: float) -> list[dict]:
    """Forward ms = ms_per_token * slice (backward twice that), independent of context: covers slices and contexts
    up to ``max_len`` so nothing is extrapolated."""
    points = []
    for s in (32, 64, 128, 256, max_len):
        for c in (0, 64, max_len - 32):
            points.append({"slice": s, "context": c, "forward_ms": ms_per_token * s,
                           "backward_ms": 2 * ms_per_token * s})
    return points


def write_json(path: Path, obj: object) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


@contextlib.contextmanager
def cli_log() -> Iterator[list[logging.LogRecord]]:
    """The CLI's own log records (whatever the root logger's or the package logger's handlers are)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    cli_logger = logging.getLogger("ds_terapipe.cli")
    cli_logger.addHandler(handler)
    try:
        yield records
    finally:
        cli_logger.removeHandler(handler)


# --------------------------------------------------------------------------------------------------------------
# Subprocess: the 48-stage plan through `python -m`, and an error's exit status

def test_module_json_round_trip_gpt3_175b_48_stages() -> None:
    argv = ["plan", "--model", "gpt3-175b", "--device", "v100", "--stages", "48", "--seq-len", "2048",
            "--micro-batch", "1", "--json"]
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "ds_terapipe", *argv], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    heavy = re.findall(r"\|\s+((?:torch|deepspeed)(?:\.\S+)?)\s*$", proc.stderr, flags=re.M)
    assert not heavy, f"the CLI imported {heavy[:5]}; it must stay planner-only"
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    plan = json.loads(proc.stdout)
    for key in ("slices", "predicted_ms", "unsliced_ms", "speedup", "bubble_fraction", "schedule", "num_stages",
                "seq_len", "granularity", "plan_seconds"):
        assert key in plan, key
    assert sum(plan["slices"]) == 2048 and all(s > 0 and s % 8 == 0 for s in plan["slices"])
    assert (plan["num_stages"], plan["seq_len"], plan["granularity"], plan["schedule"]) == (48, 2048, 8, "gpipe")
    assert plan["speedup"] == pytest.approx(plan["unsliced_ms"] / plan["predicted_ms"], rel=1e-12)
    assert plan["speedup"] >= 1.0
    assert len(plan["slices"]) > 1, "48 stages and one micro-batch: slicing must pay off"
    assert 0.0 <= plan["bubble_fraction"] < 1.0 and plan["plan_seconds"] > 0


def test_module_error_exit_status() -> None:
    proc = subprocess.run([sys.executable, "-m", "ds_terapipe", "plan", "--model", "gpt3-1b", "--device", "a100",
                           "--stages", "4", "--seq-len", "500"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith("ds-terapipe: error: --granularity 8 does not divide --seq-len 500")


def test_cli_configures_its_own_logging(tmp_path: Path) -> None:
    """The library installs only a NullHandler; the CLI, being the application, must show warnings itself and
    honour DS_TERAPIPE_LOG_LEVEL (set after import here, as the library no longer reads it)."""
    path = write_json(tmp_path / "cost.json", {"points": linear_cost_points(512, 0.01)})
    argv = ["plan", "--cost", path, "--stages", "2", "--seq-len", "512", "--device", "a100", "--json"]

    def run_cli(level: str | None) -> subprocess.CompletedProcess:
        script = ("import logging, os, sys, ds_terapipe; lg = logging.getLogger('ds_terapipe'); "
                  "lg.handlers[:] = [logging.NullHandler()]; lg.propagate = True; lg.setLevel(logging.NOTSET); "
                  f"os.environ.pop('DS_TERAPIPE_LOG_LEVEL', None); {level!r} and os.environ.update("
                  f"DS_TERAPIPE_LOG_LEVEL={level!r}); from ds_terapipe.cli import main; sys.exit(main(sys.argv[1:]))")
        return subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=120)

    proc = run_cli(None)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^\[.+\] \[WARNING\] \[ds_terapipe\.cli\] --device a100 is not used with --cost",
                     proc.stderr, flags=re.M), proc.stderr
    assert json.loads(proc.stdout)["num_stages"] == 2
    assert "[DEBUG]" not in proc.stderr
    assert "[DEBUG] [ds_terapipe.planner" in run_cli("debug").stderr
    quiet = run_cli("error")
    assert quiet.returncode == 0 and quiet.stderr == ""
    bad = run_cli("loud")
    assert bad.returncode == 2 and "DS_TERAPIPE_LOG_LEVEL='LOUD' is not a logging level; use" in bad.stderr


# --------------------------------------------------------------------------------------------------------------
# plan

def test_plan_text_shows_slices_times_speedup(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "plan", *SMALL, "--microbatches", "2")
    assert rc == 0, err
    plan = run_json(capsys, "plan", *SMALL, "--microbatches", "2")
    assert f"--slices {','.join(map(str, plan['slices']))}" in out
    assert f"speedup {plan['speedup']:.2f}x" in out
    assert f"{plan['predicted_ms']:.4g} ms sliced vs {plan['unsliced_ms']:.4g} ms unsliced" in out
    assert f"bubble {100 * plan['bubble_fraction']:.1f}%" in out


def test_plan_json_fields(capsys: pytest.CaptureFixture[str]) -> None:
    plan = run_json(capsys, "plan", *SMALL, "--microbatches", "3", "--schedule", "1f1b", "--micro-batch", "2")
    assert sum(plan["slices"]) == 512 and all(s % 32 == 0 for s in plan["slices"])
    assert (plan["schedule"], plan["num_stages"], plan["seq_len"], plan["granularity"]) == ("1f1b", 4, 512, 32)
    assert (plan["num_microbatches"], plan["micro_batch_size"], plan["batch_splits"]) == (3, 2, [2])
    assert plan["speedup"] == pytest.approx(plan["unsliced_ms"] / plan["predicted_ms"], rel=1e-12)
    assert plan["speedup"] >= 1.0  # the unsliced plan is always a candidate
    assert plan["cost"] == {"kind": "analytic", "model": "gpt3-1b", "device": "a100"}
    assert plan["memory_bytes"] is None


def test_plan_max_slices_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    free = run_json(capsys, "plan", *SMALL)
    assert len(free["slices"]) > 2, "the bound below must bind"
    capped = run_json(capsys, "plan", *SMALL, "--max-slices", "2")
    assert len(capped["slices"]) <= 2 and sum(capped["slices"]) == 512
    assert capped["predicted_ms"] >= free["predicted_ms"]
    roomy = run_json(capsys, "plan", *SMALL, "--memory-gb", "1000")
    assert roomy["memory_bytes"] is not None and 0 < roomy["memory_bytes"] <= 1000 * 2 ** 30
    assert roomy["slices"] == free["slices"]
    # GPipe with one micro-batch keeps the whole sequence alive whatever the slicing: the estimate is the floor.
    floor_gib = roomy["memory_bytes"] / 2 ** 30
    assert run_json(capsys, "plan", *SMALL, "--memory-gb", f"{floor_gib * 1.001}")["memory_bytes"] == \
        roomy["memory_bytes"]
    rc, out, err = run(capsys, "plan", *SMALL, "--memory-gb", f"{floor_gib * 0.999}")
    assert rc == 2 and out == "" and err.startswith(f"ds-terapipe: error: --memory-gb {floor_gib * 0.999:g} "), err
    assert f"{floor_gib:.3g} GiB" in err


def test_memory_refusal_suggests_only_what_helps(capsys: pytest.CaptureFixture[str]) -> None:
    # 4 micro-batches of 4 under 1F1B: splitting the batch halves the sub-batches in flight; nothing else helps.
    rc, _, err = run(capsys, "plan", *SMALL, "--micro-batch", "4", "--microbatches", "4", "--schedule", "1f1b",
                     "--memory-gb", "0.01")
    assert rc == 2 and "add --split-batch" in err and "--schedule 1f1b" not in err and "--max-slices" not in err


def test_split_batch_plan_and_simulation_agree(capsys: pytest.CaptureFixture[str]) -> None:
    # A small vocabulary: the embedding's dense gradient, written once per unit, does not dominate the sub-batches
    sim = run_json(capsys, "simulate", *SMALL, "--micro-batch", "8", "--split-batch", "--vocab", "1000")
    plan = sim["plan"]
    splits = sim["batch_splits"]
    assert plan["batch_splits"] == splits and len(splits) > 1, "this case is chosen so that splitting pays"
    # Sub-batches are pipeline units: the CLI must simulate what the planner scored.
    assert sim["makespan_ms"] == pytest.approx(plan["predicted_ms"], rel=1e-9)
    assert len(sim["peak_in_flight"]) == 4 and sim["peak_in_flight"][0] == len(splits) * len(sim["slices"])


def test_plan_accepts_preset_names_in_any_case(capsys: pytest.CaptureFixture[str]) -> None:
    upper = run_json(capsys, "plan", "--model", "GPT3-1B", "--device", "A100", *SMALL[4:])
    assert upper["slices"] == run_json(capsys, "plan", *SMALL)["slices"]


# --------------------------------------------------------------------------------------------------------------
# --cost: a measured cost file

def test_plan_with_cost_file_linear_cost_picks_finest_slices(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    # Time proportional to tokens, no context term, no comm: sum_i w_i is the same for every slicing, so the
    # optimum makes max_i t_i smallest: every slice one granule. GPipe closed form: m*sum w + (K-1)*max t.
    path = write_json(tmp_path / "cost.json", {"points": linear_cost_points(256, 0.01)})
    plan = run_json(capsys, "plan", "--cost", path, "--stages", "4", "--seq-len", "256", "--granularity", "32",
                    "--microbatches", "2")
    assert plan["slices"] == [32] * 8
    w_token = 0.03  # forward + backward per token
    assert plan["predicted_ms"] == pytest.approx(2 * w_token * 256 + 3 * w_token * 32, rel=1e-9)
    assert plan["unsliced_ms"] == pytest.approx(2 * w_token * 256 + 3 * w_token * 256, rel=1e-9)
    assert plan["cost"] == {"kind": "measured", "file": path}


def test_cost_file_stages_list_implies_stage_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    points = linear_cost_points(256, 0.01)
    path = write_json(tmp_path / "cost.json", {"stages": [{"points": points}] * 3})
    plan = run_json(capsys, "plan", "--cost", path, "--seq-len", "256", "--granularity", "32")
    assert plan["num_stages"] == 3 and sum(plan["slices"]) == 256
    path = write_json(tmp_path / "cost_n.json", {"points": points, "num_stages": 5})
    assert run_json(capsys, "plan", "--cost", path, "--seq-len", "256", "--granularity", "32")["num_stages"] == 5


def test_a_cost_measured_with_deferred_weight_grads_keeps_its_w_work(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A cost from the engine's profile with deferred weight gradients (the plan cache's, e.g. gpipe's default)
    has backward times without them and W terms for them: plan and simulate run the W actions, as the engine
    that measured it did, so both predict what the engine predicts. (They used to drop the W work: 1374 ms for
    a plan the engine predicted at 1744 ms from the same file.)"""
    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate

    stage = {"points": linear_cost_points(256, 0.01), "weight_ms_per_token": 0.02, "weight_ms_per_slice": 0.5}
    obj = {"stages": [stage, stage]}
    path = write_json(tmp_path / "cost.json", obj)
    sim = run_json(capsys, "simulate", "--cost", path, "--seq-len", "256", "--granularity", "32")
    assert sim["deferred_weight_grads"] is True
    cost, slices = PipelineCost.from_dict(obj), sim["slices"]
    with_w = simulate(build_schedule("gpipe", 2, 1, len(slices), True), cost, slices)
    without_w = simulate(build_schedule("gpipe", 2, 1, len(slices), False), cost, slices)
    assert sim["makespan_ms"] == pytest.approx(with_w.makespan_ms, rel=1e-12)
    assert with_w.makespan_ms > without_w.makespan_ms + 0.02 * 256   # stage 0's W pass at least is on the path
    assert sim["plan"]["predicted_ms"] == pytest.approx(with_w.step_ms, rel=1e-9)
    rc, out, _ = run(capsys, "simulate", "--cost", path, "--seq-len", "256", "--granularity", "32")
    assert rc == 0 and "deferred W actions" in out
    # a cost without W terms is simulated without W actions, as before
    plain = write_json(tmp_path / "plain.json", {"stages": [{"points": stage["points"]}] * 2})
    assert run_json(capsys, "simulate", "--cost", plain, "--seq-len", "256",
                    "--granularity", "32")["deferred_weight_grads"] is False


def test_a_cost_of_one_chunk_per_rank_for_a_schedule_of_two_is_explained_in_chunks(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A cost measured on 2 stages (one chunk each) planned with --stages 2 and an interleaved schedule: the file
    times chunks, the schedule places 2 per rank, so it needs 2 x 2 = 4; said that way, as compare says it (it
    used to say "cost.num_stages = 2 but num_stages = 4 was requested", 4 being nothing the user typed)."""
    points = linear_cost_points(256, 0.01)
    files = [write_json(tmp_path / "n.json", {"points": points, "num_stages": 2}),
             write_json(tmp_path / "s.json", {"stages": [{"points": points}] * 2})]
    for command in ("plan", "simulate"):
        for path in files:
            rc, out, err = run(capsys, command, "--cost", path, "--stages", "2", "--seq-len", "256",
                               "--schedule", "interleaved-1f1b")
            assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1, err
            for text in (f"--cost {path} times 2 chunks, not 2 ranks x 2", "interleaved-1f1b places 2 chunks on each",
                         "needs a cost of 2 x 2 = 4 chunks", "profile 2 chunks per rank",
                         "--stages 1 to plan 1 rank x 2", "--schedule 1f1b"):
                assert text in err, (text, err)
            assert "was requested" not in err
    # the fixes it names work
    assert run_json(capsys, "plan", "--cost", files[0], "--stages", "1", "--seq-len", "256",
                    "--schedule", "interleaved-1f1b")["virtual_stages"] == 2
    assert run_json(capsys, "plan", "--cost", files[0], "--stages", "2", "--seq-len", "256",
                    "--schedule", "1f1b")["num_stages"] == 2


def test_an_engine_plan_cache_file_is_read_as_its_cost(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """docs/cost_format.md: the engine writes a cost file when it profiles and the CLI reads it. What it writes
    is its plan-cache file (terapipe.plan_cache), the cost under "cost" next to "key", "plan", "stage_meta":
    --cost takes that file as it is (it used to fail with "cost has unknown key 'key'")."""
    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.slicing import plan_slicing
    from ds_terapipe.runtime.planning.plan_cache import CacheEntry, store_plan

    cost = PipelineCost.from_dict({"points": linear_cost_points(256, 0.01)}, num_stages=2).to_dict()
    plain = write_json(tmp_path / "cost.json", cost)
    cache = str(tmp_path / "plans" / "terapipe-plan-0123.json")
    store_plan(CacheEntry(cache, "0123"), plan_slicing(PipelineCost.from_dict(cost), 256, granularity=32), cost,
               [{"rank": 0}], profile_seconds=1.5)
    argv = ["--seq-len", "256", "--granularity", "32", "--microbatches", "2"]
    with cli_log() as records:
        got = run_json(capsys, "plan", "--cost", cache, *argv, "-v")
    want = run_json(capsys, "plan", "--cost", plain, *argv)
    assert got["cost"] == {"kind": "measured", "file": cache, "entry": "cost"}
    assert {k: v for k, v in got.items() if k not in ("cost", "plan_seconds")} == \
        {k: v for k, v in want.items() if k not in ("cost", "plan_seconds")}
    assert any("is an engine plan-cache file: planning from its \"cost\" entry" in r.getMessage() for r in records)
    assert run_json(capsys, "simulate", "--cost", cache, *argv)["num_stages"] == 2
    compared = run_json(capsys, "compare", "--cost", cache, "--stages", "2", *argv)
    assert {p["schedule"] for p in compared["plans"]} == {"gpipe", "1f1b"}
    # a cache file without costs, and the layer-partition cache next to it, are refused with what to pass
    for name, obj, needle in (("nocost", {"key": "k", "plan": {}, "cost": None}, "whose \"cost\" is null"),
                              ("partition", {"key": "k", "plan": {"parts": [0, 1]},
                                             "cost": {"layer_kinds": [], "points": []}}, "layer-partition cache")):
        path = write_json(tmp_path / f"{name}.json", obj)
        rc, out, err = run(capsys, "plan", "--cost", path, *argv)
        assert rc == 2 and out == "" and f"--cost {path} " in err and needle in err and "; pass" in err, err


def test_a_sequence_longer_than_the_cost_measured_warns_once(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """--seq-len past the longest measured slice (and slice + context) plans on extrapolated times: one warning
    naming what was measured, the length asked for and the fix; none within the measurements; once in compare."""
    path = write_json(tmp_path / "cost.json", {"points": linear_cost_points(256, 0.01)})
    short = ["--cost", path, "--stages", "2", "--seq-len", "256"]
    long = ["--cost", path, "--stages", "2", "--seq-len", "1024"]
    for argv in (["plan", *long, "--granularity", "32"], ["simulate", *long, "--slices", "1024"],
                 ["compare", *long, "--granularity", "32"]):
        with cli_log() as records:
            rc, _, err = run(capsys, *argv)
        assert rc == 0, err
        warnings = [r.getMessage() for r in records if r.levelno == logging.WARNING]
        assert len(warnings) == 1, (argv, warnings)
        for text in ("--seq-len 1024", f"--cost {path}", "longest measured slice is 256 tokens",
                     "longest context 224", "extrapolates", "profile slices and context up to 1024"):
            assert text in warnings[0], (text, warnings[0])
        assert "\n" not in warnings[0]
    for argv in (["plan", *short, "--granularity", "32"], ["simulate", *short, "--slices", "256"]):
        with cli_log() as records:
            assert run(capsys, *argv)[0] == 0
        assert not [r for r in records if r.levelno >= logging.WARNING], argv


# --------------------------------------------------------------------------------------------------------------
# simulate

def test_simulate_matches_plan_and_given_slices(capsys: pytest.CaptureFixture[str]) -> None:
    sim = run_json(capsys, "simulate", *SMALL, "--microbatches", "2", "--schedule", "1f1b")
    plan = sim["plan"]
    assert sim["slices"] == plan["slices"]
    # Unequal stages (the last one carries the LM head): the planner scores plans with this very simulator.
    assert sim["makespan_ms"] == pytest.approx(plan["predicted_ms"], rel=1e-9)
    assert sim["unsliced_makespan_ms"] == pytest.approx(plan["unsliced_ms"], rel=1e-9)
    assert len(sim["peak_in_flight"]) == len(sim["busy_ms"]) == 4
    n = len(sim["slices"])
    assert sim["peak_in_flight"][0] == min(n + 3, 2 * n)  # token 1F1B warm-up on stage 0
    given = run_json(capsys, "simulate", *SMALL[:-2], "--microbatches", "2", "--schedule", "1f1b",
                     "--slices", ",".join(map(str, plan["slices"])))
    assert given["plan"] is None and given["slices"] == plan["slices"]
    assert given["makespan_ms"] == pytest.approx(sim["makespan_ms"], rel=1e-12)
    one = run_json(capsys, "simulate", *SMALL[:-2], "--slices", "512")
    assert one["makespan_ms"] == pytest.approx(one["unsliced_makespan_ms"], rel=1e-12)
    assert one["speedup"] == pytest.approx(1.0)


def test_simulate_text(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "simulate", *SMALL[:-2], "--slices", "128,128,256", "--schedule", "gpipe")
    assert rc == 0, err
    sim = run_json(capsys, "simulate", *SMALL[:-2], "--slices", "128,128,256", "--schedule", "gpipe")
    assert f"makespan {sim['makespan_ms']:.4g} ms" in out and "peak units per stage 3 3 3 3" not in out
    assert "peak units per stage 4x3" in out  # GPipe: all 3 slices of the one micro-batch on every stage


def test_simulate_writes_loadable_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_terapipe.trace import load_chrome_trace

    out = tmp_path / "sub" / "trace.json"
    sim = run_json(capsys, "simulate", *SMALL, "--microbatches", "2", "--trace", str(out))
    assert sim["trace"] == str(out)
    doc = json.loads(out.read_text())
    complete = [e for e in doc["traceEvents"] if e.get("ph") == "X"]
    assert len(complete) == 2 * 4 * 2 * len(sim["slices"])  # F and B per stage, micro-batch and slice
    events = load_chrome_trace(out)
    assert max(e.end_ms for e in events) == pytest.approx(sim["makespan_ms"], rel=1e-9)
    assert doc["otherData"]["slices"] == sim["slices"]


def test_simulate_writes_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    rc, stdout, err = run(capsys, "simulate", *SMALL, "--plot", str(out))
    assert rc == 0, err
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert f"timeline:    {out}" in stdout


# --------------------------------------------------------------------------------------------------------------
# presets

def test_compare_ranks_every_schedule_as_plan_plans_it(capsys: pytest.CaptureFixture[str]) -> None:
    """Each row is exactly what ``plan --schedule NAME`` gives (its own chunks per rank), fastest first, with the
    memory estimate under --model; the text names the fastest and its config."""
    from ds_terapipe.planner.registry import get_schedule, schedule_names

    got = run_json(capsys, "compare", *SMALL, "--microbatches", "4")
    plans, refused = got["plans"], got["refused"]
    assert sorted(p["schedule"] for p in plans) == sorted(schedule_names()) and refused == []
    assert [p["predicted_ms"] for p in plans] == sorted(p["predicted_ms"] for p in plans)
    for p in plans:
        alone = run_json(capsys, "plan", *SMALL, "--microbatches", "4", "--schedule", p["schedule"])
        assert p["virtual_stages"] == get_schedule(p["schedule"]).virtual_stages == alone["virtual_stages"]
        assert (p["slices"], p["predicted_ms"]) == (alone["slices"], alone["predicted_ms"]), p["schedule"]
        assert p["memory_bytes"] is not None and p["memory_bytes"] > 0
    rc, out, err = run(capsys, "compare", *SMALL, "--microbatches", "4")
    assert rc == 0, err
    assert f"fastest: {plans[0]['schedule']} " in out and f'"schedule": "{plans[0]["schedule"]}"' in out
    rows = [line.split()[0] for line in out.splitlines()[3:3 + len(plans)]]
    assert rows == [p["schedule"] for p in plans]


def test_compare_lists_what_a_cap_or_a_cost_file_rules_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A --memory-gb cap that only some schedules meet, and a cost file of 4 stages (one chunk per rank on 4
    ranks): the others are listed as refused with the planner's reason, never planned on another model."""
    from ds_terapipe.planner.registry import schedule_names

    got = run_json(capsys, "compare", *SMALL, "--microbatches", "8", "--memory-gb", "0.4")
    planned = {p["schedule"] for p in got["plans"]}
    refused = {r["schedule"]: r["reason"] for r in got["refused"]}
    assert planned and refused and planned | set(refused) == set(schedule_names())
    assert all("--memory-gb 0.4 cannot be met" in reason for reason in refused.values())
    assert all(p["memory_bytes"] <= 0.4 * 2 ** 30 for p in got["plans"])
    cost = write_json(tmp_path / "cost.json", {"points": linear_cost_points(512, 0.01)})
    by_file = run_json(capsys, "compare", "--cost", cost, "--stages", "4", "--seq-len", "512",
                       "--granularity", "32", "--microbatches", "2")
    assert {p["schedule"] for p in by_file["plans"]} == {"gpipe", "1f1b"}   # v = 1: the file's 4 stages
    assert {r["schedule"] for r in by_file["refused"]} == set(schedule_names()) - {"gpipe", "1f1b"}
    assert all("profile 2 chunk(s) per rank" in r["reason"] for r in by_file["refused"])
    rc, _, err = run(capsys, "compare", *SMALL, "--balance")
    assert rc == 2 and "--balance is not supported by compare" in err


def test_presets(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run(capsys, "presets")
    assert rc == 0, err
    for name in [*MODEL_PRESETS, *DEVICE_PRESETS]:
        assert re.search(rf"^\s+{re.escape(name)}\s", out, flags=re.M), name
    data = run_json(capsys, "presets")
    assert set(data["models"]) == set(MODEL_PRESETS) and set(data["devices"]) == set(DEVICE_PRESETS)
    assert data["models"]["gpt3-175b"]["hidden"] == 12288 and data["models"]["gpt3-175b"]["num_layers"] == 96
    # every field of the device model, the GPU physics included (weight-read bandwidth, launch floor)
    h100 = DEVICE_PRESETS["h100"]
    assert data["devices"]["h100"]["bandwidth_efficiency"] == h100.bandwidth_efficiency
    assert data["devices"]["h100"]["kernel_launch_ms"] == h100.kernel_launch_ms > 0
    assert re.search(rf"^\s+h100\s.*\s{h100.kernel_launch_ms:g}\s", out, flags=re.M), out


# --------------------------------------------------------------------------------------------------------------
# Errors: one line naming the argument and the value, exit status 2, nothing on stdout

def _cost_files(tmp_path: Path) -> dict[str, str]:
    good = linear_cost_points(512, 0.01)
    negative = [dict(p) for p in good]
    negative[1]["forward_ms"] = -1.0
    nan = [dict(p) for p in good]
    nan[2]["backward_ms"] = math.nan  # json.dumps writes NaN, which json.loads accepts
    files = {
        "good": {"points": good},
        "noctx0": {"points": [p for p in good if p["context"] > 0]},
        "empty": {"points": []},
        "nopoints": {"num_stages": 2},
        "negative": {"points": negative},
        "nan": {"points": nan},
        "typo": {"points": good, "comms": {}},
        "three": {"stages": [{"points": good}] * 3},
        "list": [1, 2],
    }
    out = {k: write_json(tmp_path / f"{k}.json", v) for k, v in files.items()}
    (tmp_path / "malformed.json").write_text('{"points": [')
    out["malformed"] = str(tmp_path / "malformed.json")
    out["missing"] = str(tmp_path / "does-not-exist.json")
    return out


BASE = ["--model", "gpt3-1b", "--device", "a100", "--stages", "4"]
ERRORS = {
    # id: (argv, substrings the message must contain: the argument and the value)
    "granularity": (["plan", *BASE, "--seq-len", "512", "--granularity", "24"], ["--granularity 24", "512"]),
    "granularity-default": (["plan", *BASE, "--seq-len", "500"], ["--granularity 8", "--seq-len 500"]),
    "stages-zero": (["plan", "--model", "gpt3-1b", "--device", "a100", "--stages", "0", "--seq-len", "512"],
                    ["--stages", "'0'"]),
    "stages-word": (["plan", "--model", "gpt3-1b", "--device", "a100", "--stages", "four", "--seq-len", "512"],
                    ["--stages", "'four'"]),
    "stages-too-many": (["plan", "--model", "gpt3-1b", "--device", "a100", "--stages", "30", "--seq-len", "512"],
                        ["--stages 30", "24 layers"]),
    "microbatches-negative": (["plan", *BASE, "--seq-len", "512", "--microbatches", "-1"], ["--microbatches", "-1"]),
    # a mistyped count would otherwise overflow (range of ranks) or simulate for hours
    "stages-huge": (["plan", "--model", "gpt3-1b", "--device", "a100", "--stages", "99999999999999999999",
                     "--seq-len", "512"], ["--stages", "99999999999999999999", "<= 100,000"]),
    "microbatches-huge": (["simulate", *BASE, "--seq-len", "512", "--microbatches", "10000000"],
                          ["--microbatches", "10000000", "<= 100,000"]),
    "memory-huge": (["plan", *BASE, "--seq-len", "512", "--memory-gb", "1e308"], ["--memory-gb", "1e308", "too large"]),
    "granularity-too-fine": (["plan", *BASE, "--seq-len", "65536"],
                             ["--seq-len 65536 at --granularity 8", "8192 slice units", "--granularity 32"]),
    "memory-nan": (["plan", *BASE, "--seq-len", "512", "--memory-gb", "nan"], ["--memory-gb", "nan"]),
    "memory-unmet": (["plan", *BASE, "--seq-len", "512", "--memory-gb", "0.001"], ["--memory-gb 0.001", "GiB"]),
    "unknown-model": (["plan", "--model", "gpt4", "--device", "a100", "--stages", "4", "--seq-len", "512"],
                      ["--model", "gpt4", "gpt3-175b"]),
    "unknown-device": (["plan", "--model", "gpt3-1b", "--device", "tpu", "--stages", "4", "--seq-len", "512"],
                       ["--device", "tpu", "v100"]),
    "unknown-schedule": (["plan", *BASE, "--seq-len", "512", "--schedule", "zb"], ["--schedule", "zb", "1f1b"]),
    "missing-seq-len": (["plan", *BASE], ["--seq-len"]),
    "missing-model": (["plan", "--device", "a100", "--stages", "4", "--seq-len", "512"], ["--model", "--cost"]),
    "missing-stages": (["plan", "--model", "gpt3-1b", "--device", "a100", "--seq-len", "512"], ["--stages"]),
    "missing-command": ([], ["plan", "simulate"]),
    "slices-sum": (["simulate", *BASE, "--seq-len", "512", "--slices", "128,256"],
                   ["--slices 128,256", "384", "--seq-len is 512"]),
    "slices-zero": (["simulate", *BASE, "--seq-len", "512", "--slices", "512,0"], ["--slices", "512,0"]),
    "slices-word": (["simulate", *BASE, "--seq-len", "512", "--slices", "256,x"], ["--slices", "256,x"]),
    "slices-with-search-option": (["simulate", *BASE, "--seq-len", "512", "--slices", "512", "--max-slices", "2"],
                                  ["--max-slices", "--slices"]),
    "cost-no-context-0": (["plan", "--cost", "{noctx0}", "--stages", "2", "--seq-len", "512"],
                          ["--cost {noctx0}", "context = 0"]),
    "cost-empty-points": (["plan", "--cost", "{empty}", "--stages", "2", "--seq-len", "512"],
                          ["--cost {empty}", "points"]),
    "cost-no-points": (["plan", "--cost", "{nopoints}", "--seq-len", "512"], ["--cost {nopoints}", "points"]),
    "cost-negative": (["plan", "--cost", "{negative}", "--stages", "2", "--seq-len", "512"],
                      ["--cost {negative}", "forward_ms", "-1"]),
    "cost-nan": (["plan", "--cost", "{nan}", "--stages", "2", "--seq-len", "512"],
                 ["--cost {nan}", "backward_ms", "nan"]),
    "cost-unknown-key": (["plan", "--cost", "{typo}", "--stages", "2", "--seq-len", "512"],
                         ["--cost {typo}", "'comms'"]),
    "cost-malformed": (["plan", "--cost", "{malformed}", "--stages", "2", "--seq-len", "512"],
                       ["--cost {malformed}", "not valid JSON", "line 1"]),
    "cost-not-object": (["plan", "--cost", "{list}", "--stages", "2", "--seq-len", "512"], ["--cost {list}", "list"]),
    "cost-missing-file": (["plan", "--cost", "{missing}", "--stages", "2", "--seq-len", "512"],
                          ["--cost {missing}", "cannot read the file"]),
    "cost-needs-stages": (["plan", "--cost", "{good}", "--seq-len", "512"], ["--stages", "--cost {good}"]),
    "cost-stage-count": (["plan", "--cost", "{three}", "--stages", "4", "--seq-len", "512"],
                         ["--cost {three}", "3 entries", "4"]),
    "cost-memory-needs-model": (["plan", "--cost", "{good}", "--stages", "2", "--seq-len", "512", "--memory-gb", "8"],
                                ["--memory-gb 8", "--model"]),
    "window-zero": (["plan", *BASE, "--seq-len", "512", "--window", "0"], ["--window", "'0'"]),
    "full-every-needs-window": (["plan", *BASE, "--seq-len", "512", "--full-every", "2"],
                                ["--full-every 2", "--window W"]),
    "cost-window": (["plan", "--cost", "{good}", "--stages", "2", "--seq-len", "512", "--window", "64"],
                    ["--window 64", "--cost file"]),
    "trace-unwritable": (["simulate", *BASE, "--seq-len", "512", "--slices", "512", "--trace", "{good}/t.json"],
                         ["--trace {good}/t.json", "cannot write"]),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_user_errors_one_line_exit_2(case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = _cost_files(tmp_path)
    argv, expected = ERRORS[case]
    rc, out, err = run(capsys, *(a.format(**files) for a in argv))
    assert rc == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ds-terapipe: error: ") and "Traceback" not in err
    for text in expected:
        assert text.format(**files) in lines[0], (text, lines[0])
    assert "; " in lines[0], f"no fix given: {lines[0]}"


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0
    assert "--seq-len" in capsys.readouterr().out


def test_sequence_parallel_splits_the_work_and_the_memory(capsys: pytest.CaptureFixture[str]) -> None:
    one = run_json(capsys, "plan", *SMALL, "--memory-gb", "1000")
    two = run_json(capsys, "plan", *SMALL, "--memory-gb", "1000", "--sequence-parallel", "2")
    assert two["cost"]["sequence_parallel"] == 2 and "sequence_parallel" not in one["cost"]
    assert two["predicted_ms"] < one["predicted_ms"]   # half the compute per rank, plus the all-to-alls
    assert two["memory_bytes"] == pytest.approx(one["memory_bytes"] / 2)   # GPipe, one micro-batch: the floor
    floor_gib = one["memory_bytes"] / 2 ** 30
    rc, _, err = run(capsys, "plan", *SMALL, "--memory-gb", f"{floor_gib * 0.9}")
    assert rc == 2 and "raise --sequence-parallel" in err, err
    fits = run_json(capsys, "plan", *SMALL, "--memory-gb", f"{floor_gib * 0.9}", "--sequence-parallel", "2")
    assert fits["memory_bytes"] <= floor_gib * 0.9 * 2 ** 30


@pytest.mark.parametrize("extra, needle", [
    (["--sequence-parallel", "3"], "--sequence-parallel 3 does not divide the 16 key/value heads"),
    (["--sequence-parallel", "2", "--balance"], "--sequence-parallel is not supported with --balance"),
])
def test_sequence_parallel_refusals(capsys: pytest.CaptureFixture[str], extra: list[str], needle: str) -> None:
    rc, out, err = run(capsys, "plan", *SMALL, *extra)
    assert rc == 2 and out == "" and needle in err, err


def test_sequence_parallel_needs_a_model(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cost = write_json(tmp_path / "cost.json", {"points": linear_cost_points(512, 0.01)})
    rc, _, err = run(capsys, "plan", "--cost", cost, "--stages", "2", "--seq-len", "512", "--granularity", "32",
                     "--sequence-parallel", "2")
    assert rc == 2 and "--sequence-parallel 2 needs --model NAME" in err, err


WIDE = ["--model", "gpt3-1b", "--device", "h100", "--stages", "8", "--seq-len", "8192", "--granularity", "128"]


def test_plan_prices_sliding_windows(capsys: pytest.CaptureFixture[str]) -> None:
    """--window W: every layer attends over at most W keys, so the step is faster; --full-every K keeps full
    attention on every K-th layer (in between); a window covering the sequence is full attention. The
    description and the JSON's cost say which."""
    def plan(*extra: str) -> dict:
        return run_json(capsys, "plan", *WIDE, *extra)

    full, covering = plan(), plan("--window", "8192")
    windowed, mixed = plan("--window", "2048"), plan("--window", "2048", "--full-every", "2")
    assert {k: v for k, v in covering.items() if k not in ("cost", "plan_seconds")} == \
        {k: v for k, v in full.items() if k not in ("cost", "plan_seconds")}
    assert windowed["predicted_ms"] < mixed["predicted_ms"] < full["predicted_ms"]
    assert windowed["cost"] == {"kind": "analytic", "model": "gpt3-1b", "device": "h100", "window": 2048,
                                "full_every": None}
    assert mixed["cost"]["full_every"] == 2 and "window" not in full["cost"]
    rc, out, _ = run(capsys, "plan", *WIDE, "--window", "2048", "--full-every", "2")
    assert rc == 0 and "gpt3-1b (window 2048, full attention every 2 layers) on 8 x h100 (analytic cost)" in out
    assert run_json(capsys, "plan", *SMALL, "--window", "64", "--balance")["cost"]["window"] == 64


def test_plan_prices_chunked_attention(capsys: pytest.CaptureFixture[str]) -> None:
    """--attention-chunk C: chunked attention (Llama 4's) on the preset's layers, cheaper than full attention, with
    --full-every K full attention on every K-th layer (in between); a chunk covering the sequence is full attention.
    With --window, without --model, or --full-every alone: refused, naming the fix."""
    def plan(*extra: str) -> dict:
        return run_json(capsys, "plan", *WIDE, *extra)

    full, covering = plan(), plan("--attention-chunk", "8192")
    chunked, mixed = plan("--attention-chunk", "2048"), plan("--attention-chunk", "2048", "--full-every", "4")
    assert covering["predicted_ms"] == pytest.approx(full["predicted_ms"], rel=1e-12)
    assert chunked["predicted_ms"] < mixed["predicted_ms"] < full["predicted_ms"]
    assert chunked["cost"] == {"kind": "analytic", "model": "gpt3-1b", "device": "h100", "attention_chunk": 2048,
                               "full_every": None}
    rc, out, _ = run(capsys, "plan", *WIDE, "--attention-chunk", "2048", "--full-every", "4")
    assert rc == 0 and "gpt3-1b (attention chunks of 2048, full attention every 4 layers) on 8 x h100" in out, out
    for extra, needle in ((["--window", "512"], "--window 512 and --attention-chunk 2048: a layer attends within a "
                                               "sliding window or within chunks; drop one of them"),
                          (["--full-every", "4"], None)):
        rc, _, err = run(capsys, "plan", *WIDE, "--attention-chunk", "2048", *extra)
        assert (rc == 2 and needle in err) if needle else rc == 0, err
    rc, _, err = run(capsys, "plan", *WIDE, "--full-every", "4")
    assert rc == 2 and "add --window W or --attention-chunk C" in err, err

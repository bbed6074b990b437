"""Tier a: benchmarks/gpu_slices.py runs where CI has no GPU: its measuring path on a small CPU shape, and the
re-print of the committed H200 and H100 reports with the current code's predictions (no device needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_slices.py"


def _run(*args: str) -> str:
    done = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT / "benchmarks", capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_a_small_shape_is_measured_with_every_variant_and_predicted(tmp_path) -> None:
    out = tmp_path / "gpu_slices.json"
    _run("--shapes", "tiny-gpt", "--slices", "1,2", "--rounds", "1", "--json", str(out))
    report = json.loads(out.read_text())
    rec = report["shapes"]["tiny-gpt"]
    assert "error" not in rec, rec
    variants = {(r["n"], r["variant"]) for r in rec["rows"]}
    assert variants == {(n, v) for n in (1, 2) for v in ("sliced", "fused", "per-slice W", "unsynced", "in-gemm")}
    sliced = next(r for r in rec["rows"] if r["variant"] == "sliced" and r["n"] == 2)
    assert len(sliced["F"]) == len(sliced["B"]) == 2   # per slice
    assert rec["profile"] and all("weight_ms" in p for p in rec["profile_deferred"])
    assert [(p["slice"], p["context"]) for p in rec["profile_in_gemm"]] == [(p["slice"], p["context"])
                                                                            for p in rec["profile"]]
    kinds = {c["what"] for c in report["checks"]}
    assert kinds == {"profile-predicted micro-batch", "W(n)/W(1)"}, kinds
    predicted = {(c["n"], c["variant"]) for c in report["checks"] if c["what"] == "profile-predicted micro-batch"}
    assert predicted == {(n, v) for n in (1, 2) for v in ("unsynced", "fused", "in-gemm")}, predicted
    assert report["commit"] and report["machine"]["device"] == "cpu"


def test_the_steady_profile_is_measured_on_request_and_predicts_beside_the_profile(tmp_path) -> None:
    out = tmp_path / "gpu_slices.json"
    _run("--shapes", "tiny-gpt", "--slices", "1,2", "--rounds", "1", "--steady", "--json", str(out))
    report = json.loads(out.read_text())
    rec = report["shapes"]["tiny-gpt"]
    assert "error" not in rec, rec
    for key in ("profile", "profile_deferred"):
        assert [(p["slice"], p["context"]) for p in rec[key + "_steady"]] == [(p["slice"], p["context"])
                                                                             for p in rec[key]]
        assert all(p["forward_ms"] > 0 and p["backward_ms"] > 0 for p in rec[key + "_steady"])
    steady = [c for c in report["checks"] if c["what"] == "steady-profile-predicted micro-batch"]
    assert {(c["n"], c["variant"]) for c in steady} == {(n, v) for n in (1, 2) for v in ("unsynced", "fused")}
    # the lead-in points: the same grid, every kind of pass, each with its prediction
    for key in ("profile", "profile_deferred", "profile_in_gemm"):
        assert [(p["slice"], p["context"]) for p in rec[key + "_lead_in"]] == [(p["slice"], p["context"])
                                                                              for p in rec[key]]
        assert all(p["forward_ms"] > 0 and p["backward_ms"] > 0 for p in rec[key + "_lead_in"])
    assert all(p["weight_ms"] > 0 for p in rec["profile_deferred_lead_in"])
    lead = [c for c in report["checks"] if c["what"] == "lead-in-profile-predicted micro-batch"]
    assert {(c["n"], c["variant"]) for c in lead} == {(n, v) for n in (1, 2) for v in ("unsynced", "fused", "in-gemm")}


def test_steady_points_take_the_burst_start_out() -> None:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_slices import steady_points
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    # a burst of k copies costs start + k * per_copy, reported per copy: 3 copies -> (1 + 3 * 2) / 3, 6 -> (1 + 12) / 6
    short = [{"batch": 1, "slice": 64, "context": 0, "forward_ms": 7 / 3, "backward_ms": 10 / 3, "weight_ms": 4 / 3}]
    long = [{"batch": 1, "slice": 64, "context": 0, "forward_ms": 13 / 6, "backward_ms": 19 / 6, "weight_ms": 7 / 6}]
    got = steady_points(short, long)[0]
    assert (got["slice"], got["context"], got["batch"]) == (64, 0, 1)
    assert abs(got["forward_ms"] - 2.0) < 1e-12 and abs(got["backward_ms"] - 3.0) < 1e-12
    assert abs(got["weight_ms"] - 1.0) < 1e-12
    # noise that makes the difference fall under half the long burst's mean is held there
    noisy = steady_points(short, [dict(long[0], forward_ms=1.0)])[0]
    assert noisy["forward_ms"] == 0.5


def test_the_committed_h200_report_reprints_with_every_column() -> None:
    """The latest run (one H200, the two largest shapes) has every column but the lead-in profile's (which it
    did not take): the steady profile, the engine's in-GEMM accumulation and the h200 preset's prediction."""
    report = ROOT / "benchmarks" / "results" / "gpu_slices.json"
    assert json.loads(report.read_text())["device_name"] == "NVIDIA H200"
    text = _run("--report", str(report))
    for shape in ("llama70b-x1", "gpt3-175b-x1"):
        assert f"{shape}:" in text, shape
    header = next(line for line in text.splitlines() if line.startswith("| n |"))
    lead_in = {k for k, cell in enumerate(header.split("|")) if cell.strip() == "lead-in"}
    rows = [line for line in text.splitlines() if line.startswith("| 8 |")]
    assert len(lead_in) == 3 and len(rows) == 2, (header, rows)
    assert all(cell.strip() != "-" for row in rows for k, cell in enumerate(row.split("|")) if k not in lead_in), rows


def test_the_committed_h100_report_reprints_with_the_current_predictions() -> None:
    text = _run("--report", str(ROOT / "benchmarks" / "results" / "gpu_slices_h100.json"))
    for shape in ("trainer-gpt-8x1024", "llama8b-x2", "gpt3-13b-x2", "llama70b-x1", "gpt3-175b-x1"):
        assert f"{shape}:" in text, shape
    header = next(line for line in text.splitlines() if line.startswith("| n |")).split("|")
    row = next(line for line in text.splitlines() if line.startswith("| 8 |") and "|" in line).split("|")
    # the h100 preset's column is filled on a report from an H100 (a missing preset would print "-")
    assert header[8].strip() == "preset" and row[8].strip() != "-", row
    # a report measured without the steady and lead-in profiles prints "-" in their columns
    assert [header[6].strip(), header[7].strip()] == ["steady", "lead-in"] and row[6:8] == [" - ", " - "], row

"""Tier a: benchmarks/gpu_slices.py runs where CI has no GPU: its measuring path on a small CPU shape, and the
re-print of the committed H100 report with the current code's predictions (no device needed)."""

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
    assert variants == {(n, v) for n in (1, 2) for v in ("sliced", "fused", "per-slice W", "unsynced")}
    sliced = next(r for r in rec["rows"] if r["variant"] == "sliced" and r["n"] == 2)
    assert len(sliced["F"]) == len(sliced["B"]) == 2   # per slice
    assert rec["profile"] and all("weight_ms" in p for p in rec["profile_deferred"])
    kinds = {c["what"] for c in report["checks"]}
    assert kinds == {"profile-predicted micro-batch", "W(n)/W(1)"}, kinds
    assert report["commit"] and report["machine"]["device"] == "cpu"


def test_the_committed_report_reprints_with_the_current_predictions() -> None:
    text = _run("--report", str(ROOT / "benchmarks" / "results" / "gpu_slices.json"))
    for shape in ("trainer-gpt-8x1024", "llama8b-x2", "gpt3-13b-x2", "llama70b-x1", "gpt3-175b-x1"):
        assert f"{shape}:" in text, shape
    # the h100 preset's column is filled on a report from an H100 (a missing preset would print "-")
    row = next(line for line in text.splitlines() if line.startswith("| 8 |") and "|" in line)
    assert row.split("|")[6].strip() != "-", row

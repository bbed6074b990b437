"""Tier a: benchmarks/host_overhead.py on a tiny CPU model: every variant runs through the engine and the split of
a step (layers, optimizer, the engine's own time) adds up; the committed report has the rows its docs quote."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_engine_time_per_action_is_measured_for_every_variant(tmp_path) -> None:
    out = tmp_path / "host_overhead.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "host_overhead.py"), "--layers", "2",
                           "--hidden", "32", "--heads", "2", "--seq-len", "64", "--micro-batches", "2",
                           "--slices", "1,2", "--steps", "1", "--dtype", "bf16", "--per-parameter-bf16",
                           "--json", str(out)], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["slices"], r["deferred"], r["flat_bf16_grads"]) for r in rows} == {
        (1, False, True), (2, False, True), (2, True, True), (1, False, False), (2, False, False), (2, True, False)}
    for r in rows:
        assert r["layers_ms"] > 0 and r["optimizer_ms"] > 0, r   # the wrapped calls were reached
        assert abs(r["layers_ms"] + r["optimizer_ms"] + r["engine_ms"] - r["step_ms"]) < 0.05 * r["step_ms"], r
    assert {r["actions"] for r in rows if r["slices"] == 2} == {2 * 2 * 2, 2 * 2 * 3}   # F, B (+ W) per slice
    # kernels counted in the layers and in the engine; a slice of 2 blocks launches a few dozen, and cutting the
    # micro-batch adds the KV cache's writes and reads, never takes kernels away
    per_slice = {(r["slices"], r["deferred"], r["flat_bf16_grads"]): r["layer_kernels_per_slice"] for r in rows}
    assert all(20 < k < 200 for k in per_slice.values()), per_slice
    assert per_slice[(2, False, True)] > per_slice[(1, False, True)], per_slice
    assert all(r["engine_kernels_per_action"] > 0 for r in rows)


def test_the_committed_report_is_the_h100_run() -> None:
    report = json.loads((ROOT / "benchmarks" / "results" / "host_overhead.json").read_text())
    assert "H100" in report["device"]
    assert {(r["slices"], r["deferred"], r["flat_bf16_grads"]) for r in report["rows"]} >= {(4, True, True),
                                                                                           (4, True, False)}

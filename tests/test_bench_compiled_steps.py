"""Tier a: benchmarks/compiled_steps.py on a tiny CPU model: every mode and slice count steps through the engine,
compiled variants give the eager loss, and dynamo breaks the graphs only at the functions kept out of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_mode_steps_and_breaks_its_graphs_only_at_the_attention_and_positions(tmp_path) -> None:
    out = tmp_path / "compiled_steps.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "compiled_steps.py"), "--layers", "1",
                           "--hidden", "16", "--heads", "2", "--seq-len", "32", "--micro-batches", "2",
                           "--slices", "1,2", "--steps", "1", "--warmup", "1", "--modes", "eager,aot_eager",
                           "--json", str(out)], cwd=ROOT / "benchmarks", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert not report["errors"], report["errors"]
    rows = {(r["mode"], r["slices"]): r for r in report["rows"]}
    assert set(rows) == {("eager", 1), ("eager", 2), ("aot_eager", 1), ("aot_eager", 2)}
    assert all(abs(r["first_loss_diff"]) < 1e-5 and r["step_ms"] > 0 for r in rows.values()), rows
    breaks = report["dynamo"]["graph_breaks"]
    assert breaks and all(reason.endswith(("(sliced_causal_attention)", "(slice_positions)")) for reason in breaks), \
        breaks

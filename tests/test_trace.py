"""Tier (a): timelines. Chrome trace JSON round trip and merge, PNG rendering (skipped without matplotlib).

    python -m pytest -q tests/test_trace.py
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from ds_terapipe.planner.schedule import Action, ActionKind, build_1f1b
from ds_terapipe.planner.simulate import TimedAction, simulate
from ds_terapipe.trace import events_to_chrome_trace, load_chrome_trace, merge_traces, plot_timeline


class _Stage:
    def forward_ms(self, slice_len, context, batch=1):
        return 0.5 + 0.01 * np.asarray(slice_len) * (1 + 0.01 * np.asarray(context))

    def backward_ms(self, slice_len, context, batch=1):
        return 2 * self.forward_ms(slice_len, context, batch)

    def comm_ms(self, slice_len, batch=1):
        return 0.05 + 0 * np.asarray(slice_len)


class _Cost:
    def __init__(self, num_stages: int):
        self.num_chunks = num_stages

    def chunk(self, s: int) -> _Stage:
        return _Stage()


@pytest.fixture(scope="module")
def sim_events() -> tuple[TimedAction, ...]:
    return simulate(build_1f1b(3, 2, 3), _Cost(3), [32, 16, 8]).events


def test_chrome_trace_has_one_process_per_stage_and_one_event_per_action(tmp_path, sim_events):
    path = events_to_chrome_trace(sim_events, tmp_path / "sim.json", metadata={"plan": [32, 16, 8]})
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == len(sim_events) == 2 * 3 * 2 * 3
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert names == {0: "stage 0", 1: "stage 1", 2: "stage 2"}
    first = next(e for e in xs if e["name"] == "2B0.2")
    ev = next(e for e in sim_events if str(e.action) == "2B0.2")
    assert first["pid"] == 2 and first["cat"] == "backward" and first["args"] == {"microbatch": 0, "slice": 2}
    assert first["ts"] == pytest.approx(ev.start_ms * 1000) and first["dur"] == pytest.approx(ev.duration_ms * 1000)
    assert doc["otherData"] == {"plan": [32, 16, 8]}


def test_chrome_trace_round_trips(tmp_path, sim_events):
    back = load_chrome_trace(events_to_chrome_trace(sim_events, tmp_path / "t.json"))
    assert [(e.stage, e.action) for e in back] == [(e.stage, e.action) for e in sim_events]
    for got, want in zip(back, sim_events):
        assert got.start_ms == pytest.approx(want.start_ms, rel=1e-12, abs=1e-12)
        assert got.end_ms == pytest.approx(want.end_ms, rel=1e-12, abs=1e-12)


def test_merge_per_rank_traces(tmp_path, sim_events):
    paths = []
    for s in range(3):
        paths.append(events_to_chrome_trace([e for e in sim_events if e.stage == s], tmp_path / f"rank{s}.json",
                                            metadata={"rank": s}))
    doc_extra = json.loads(paths[1].read_text())  # a rank may record other spans into its file
    doc_extra["traceEvents"].append({"name": "optimizer.step", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 5})
    paths[1].write_text(json.dumps(doc_extra))
    merged = merge_traces(paths, tmp_path / "merged.json")
    back = load_chrome_trace(merged)
    assert sorted((e.stage, str(e.action)) for e in back) == sorted((e.stage, str(e.action)) for e in sim_events)
    meta = json.loads(merged.read_text())["otherData"]["merged_from"]
    assert [m["rank"] for m in meta] == [0, 1, 2]
    with pytest.raises(ValueError, match="non-empty list"):
        merge_traces([], tmp_path / "x.json")


def test_trace_accepts_duck_typed_events_and_refuses_bad_ones(tmp_path):
    measured = [SimpleNamespace(stage=1, action="1F0.0", start_ms=0.0, end_ms=1.5),
                SimpleNamespace(stage=1, action=Action(1, ActionKind.RECV_B, 0, 0), start_ms=1.5, end_ms=2.0)]
    back = load_chrome_trace(events_to_chrome_trace(measured, tmp_path / "m.json"))
    assert back == [TimedAction(1, Action(1, ActionKind.FORWARD, 0, 0), 0.0, 1.5),
                    TimedAction(1, Action(1, ActionKind.RECV_B, 0, 0), 1.5, 2.0)]
    assert json.loads((tmp_path / "m.json").read_text())["traceEvents"][-1]["cat"] == "comm"
    with pytest.raises(TypeError, match="event #0"):
        events_to_chrome_trace([object()], tmp_path / "bad.json")
    with pytest.raises(ValueError, match=r"event #0 \(1F0.0\): needs finite start_ms <= end_ms"):
        events_to_chrome_trace([SimpleNamespace(stage=1, action="1F0.0", start_ms=2, end_ms=1)], tmp_path / "b.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_chrome_trace(tmp_path / "junk.json")


def test_plot_timeline_writes_a_png(tmp_path, sim_events):
    pytest.importorskip("matplotlib")
    path = plot_timeline(sim_events, tmp_path / "sub" / "timeline.png", title="1f1b, 3 stages")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    with pytest.raises(ValueError, match="no events"):
        plot_timeline([], tmp_path / "empty.png")


def test_weight_passes_get_their_own_category(tmp_path):
    events = [TimedAction(0, Action(0, ActionKind.BACKWARD, 0, 0), 0.0, 1.0),
              TimedAction(0, Action(0, ActionKind.WEIGHT, 0, 0), 1.0, 3.0)]
    path = events_to_chrome_trace(events, tmp_path / "w.json")
    cats = [e["cat"] for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X"]
    assert cats == ["backward", "weights"]
    assert load_chrome_trace(path) == events

"""Timelines of pipeline runs, simulated or measured: Chrome trace JSON and PNG.

An event is anything with ``stage``, ``action`` (an :class:`~ds_terapipe.planner.schedule.Action` or its short
string form), ``start_ms`` and ``end_ms``: :class:`~ds_terapipe.planner.simulate.TimedAction` from the
simulator, or what a rank records while it runs. Chrome traces put one process per stage (pid = stage), so the
per-rank files of a measured run merge into one picture with :func:`merge_traces`, and a simulated and a
measured trace of the same plan can be opened side by side in https://ui.perfetto.dev or chrome://tracing::

    python -c "from ds_terapipe.trace import *; plot_timeline(load_chrome_trace('run.json'), 'run.png')"

matplotlib is imported only by :func:`plot_timeline` (``pip install matplotlib``); JSON needs nothing.
"""
from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._io import atomic_write_text
from .planner.schedule import Action, ActionKind
from .planner.simulate import TimedAction

logger = logging.getLogger(__name__)

__all__ = ["events_to_chrome_trace", "load_chrome_trace", "merge_traces", "plot_timeline"]

_CATEGORY = {ActionKind.FORWARD: "forward", ActionKind.BACKWARD: "backward", ActionKind.WEIGHT: "weights"}


def _normalise(events: Iterable[Any]) -> list[TimedAction]:
    """Accept TimedAction-like objects; refuse ones a timeline cannot place, naming the event."""
    out = []
    for k, ev in enumerate(events):
        try:
            stage, action, start, end = ev.stage, ev.action, ev.start_ms, ev.end_ms
        except AttributeError:
            raise TypeError(f"event #{k} ({type(ev).__name__}) lacks stage/action/start_ms/end_ms; pass "
                            f"TimedAction-like objects") from None
        if isinstance(action, str):
            action = Action.parse(action)
        if not isinstance(action, Action):
            raise TypeError(f"event #{k}: action must be an Action or its string form, got {type(action).__name__}")
        if isinstance(stage, bool) or not isinstance(stage, int) or stage < 0:
            raise ValueError(f"event #{k} ({action}): stage must be an int >= 0, got {stage!r}")
        start, end = float(start), float(end)
        if not (math.isfinite(start) and math.isfinite(end)) or end < start:
            raise ValueError(f"event #{k} ({action}): needs finite start_ms <= end_ms, got {start}..{end}")
        out.append(TimedAction(stage, action, start, end))
    return out


def _chunked(events: Sequence[TimedAction]) -> bool:
    """Whether the events come from a schedule with several chunks per rank (an action's chunk is not its row):
    rows are then ranks and labels name the chunk."""
    return any(e.action.chunk != e.stage for e in events)


def _write_json(obj: Any, path: str | os.PathLike[str]) -> Path:
    """Write atomically so a reader never sees half a trace (ranks may write concurrently)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(obj, separators=(",", ":")))
    return path


def events_to_chrome_trace(events: Iterable[Any], path: str | os.PathLike[str], *,
                           metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a Chrome trace: one process per stage ("stage N"), one complete ("X") event per action.

    Times are microseconds, as the format requires; ``args`` carry the micro-batch and slice so a trace viewer
    can filter by unit. ``metadata`` (JSON-serialisable) is stored as the trace's ``otherData``.
    """
    evs = _normalise(events)
    stages = sorted({e.stage for e in evs})
    chunked = _chunked(evs)
    row = "rank" if chunked else "stage"
    trace: list[dict[str, Any]] = []
    for s in stages:
        trace.append({"name": "process_name", "ph": "M", "pid": s, "tid": 0, "args": {"name": f"{row} {s}"}})
        trace.append({"name": "process_sort_index", "ph": "M", "pid": s, "tid": 0, "args": {"sort_index": s}})
    for e in evs:
        a = e.action
        trace.append({"name": str(a), "cat": _CATEGORY.get(a.kind, "comm"), "ph": "X", "pid": e.stage, "tid": 0,
                      "ts": e.start_ms * 1e3, "dur": (e.end_ms - e.start_ms) * 1e3,
                      "args": {"microbatch": a.microbatch, "slice": a.slice,
                               **({"chunk": a.chunk} if chunked else {})}})
    doc: dict[str, Any] = {"traceEvents": trace, "displayTimeUnit": "ms"}
    if metadata:
        doc["otherData"] = dict(metadata)
    out = _write_json(doc, path)
    logger.info("wrote Chrome trace %s: %d events on %d stages", out, len(evs), len(stages))
    return out


def _read(path: str | os.PathLike[str]) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON ({exc}); expected a Chrome trace written by "
                         f"events_to_chrome_trace") from None
    if isinstance(doc, list):  # the format also allows a bare event array
        doc = {"traceEvents": doc}
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError(f"{path} has no 'traceEvents' list; expected a Chrome trace")
    return doc


def load_chrome_trace(path: str | os.PathLike[str]) -> list[TimedAction]:
    """Read the action events of a Chrome trace back (the inverse of :func:`events_to_chrome_trace`).

    Complete events whose name is not an action (e.g. a profiler's own spans) are skipped, so a rank may
    record other things into the same file. The stage is the event's pid.
    """
    out, skipped = [], 0
    for ev in _read(path)["traceEvents"]:
        if not isinstance(ev, dict) or ev.get("ph") != "X":
            continue
        try:
            action = Action.parse(ev.get("name"))
        except (TypeError, ValueError):
            skipped += 1
            continue
        start = float(ev["ts"]) / 1e3
        out.append(TimedAction(int(ev["pid"]), action, start, start + float(ev.get("dur", 0.0)) / 1e3))
    if skipped:
        logger.debug("%s: skipped %d complete events that are not actions", path, skipped)
    return out


def merge_traces(paths: Sequence[str | os.PathLike[str]], out_path: str | os.PathLike[str]) -> Path:
    """Merge per-rank traces of one run into one file (one process per stage), keeping each file's metadata.

    Ranks should record times against a common origin (e.g. a barrier at step start); merging does not shift.
    """
    if isinstance(paths, (str, os.PathLike)) or not paths:
        raise ValueError(f"merge_traces needs a non-empty list of trace paths, got {paths!r}")
    events: list[TimedAction] = []
    sources = []
    for p in paths:
        events.extend(load_chrome_trace(p))
        sources.append({"path": str(p), **_read(p).get("otherData", {})})
    return events_to_chrome_trace(events, out_path, metadata={"merged_from": sources})


def _px_per_char(fontsize: float, dpi: float) -> float:
    return 0.6 * fontsize * dpi / 72  # average glyph width of the default sans font, in pixels


def plot_timeline(events: Iterable[Any], path: str | os.PathLike[str], *, title: str | None = None) -> Path:
    """Draw a PNG Gantt chart: stages as rows (stage 0 on top), time on x.

    With several chunks per rank (virtual stages) rows are ranks and labels read "c<chunk>:microbatch.slice".
    Forward boxes are blue, backward boxes orange and deferred weight-gradient passes (W) green, a shade per
    micro-batch (cycling every 4) so consecutive micro-batches are told apart; boxes wide enough carry their
    "microbatch.slice" label. Uses matplotlib's object API (no pyplot), so it never touches a caller's interactive
    backend.
    """
    try:
        from matplotlib import colormaps
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - exercised only where matplotlib is missing
        raise ImportError("plot_timeline needs matplotlib: pip install matplotlib (or ds-terapipe[plot])") from exc
    evs = _normalise(events)
    if not evs:
        raise ValueError("plot_timeline got no events; simulate or record a run first")
    num_rows = max(e.stage for e in evs) + 1
    t0 = min(e.start_ms for e in evs)
    span = max(max(e.end_ms for e in evs) - t0, 1e-9)
    width_in, dpi, fontsize = 14.0, 100, 7
    height_in = min(1.3 + 0.45 * num_rows, 40.0)
    fig = Figure(figsize=(width_in, height_in), dpi=dpi)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0.07, 0.55 / height_in, 0.9, 1 - 1.0 / height_in))  # fixed margins in inches
    maps = {"forward": colormaps["Blues"], "backward": colormaps["Oranges"], "weights": colormaps["Greens"]}
    groups: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    for e in evs:
        cat = _CATEGORY.get(e.action.kind, "other")
        groups.setdefault((e.stage, cat, e.action.microbatch % 4), []).append((e.start_ms - t0, e.duration_ms))
    for (stage, cat, shade), boxes in groups.items():
        colour = maps[cat](0.45 + 0.15 * shade) if cat in maps else "0.6"
        ax.broken_barh(boxes, (stage - 0.4, 0.8), facecolors=colour, edgecolors="white", linewidth=0.3)
    px_per_ms = width_in * 0.9 * dpi / span
    drawn = 0
    chunked = _chunked(evs)
    for e in evs:
        text = f"{e.action.microbatch}.{e.action.slice}"
        if chunked:
            text = f"c{e.action.chunk}:{text}"
        if drawn < 3000 and e.duration_ms * px_per_ms > _px_per_char(fontsize, dpi) * len(text) + 2:
            ax.text(e.start_ms - t0 + e.duration_ms / 2, e.stage, text, ha="center", va="center",
                    fontsize=fontsize, clip_on=True)
            drawn += 1  # beyond a few thousand labels the chart is unreadable anyway
    ax.set_ylim(num_rows - 0.5, -0.5)  # stage 0 on top
    ax.set_yticks(range(num_rows), [f"{'rank' if chunked else 'stage'} {s}" for s in range(num_rows)])
    ax.set_xlim(0, span)
    ax.set_xlabel("time (ms)")
    kinds = {_CATEGORY.get(e.action.kind, "other") for e in evs}
    handles = [Patch(color=maps[c](0.7), label=c) for c in ("forward", "backward", "weights") if c in kinds]
    handles += [Patch(color="0.6", label="other")] if "other" in kinds else []
    fig.legend(handles=handles, loc="upper right", ncol=len(handles), frameon=False, fontsize=8)
    ax.set_title(title or f"{num_rows} stages, makespan {span:.3g} ms", fontsize=10, loc="left")
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format="png")
    logger.info("wrote timeline %s: %d events on %d stages", out, len(evs), num_rows)
    return out

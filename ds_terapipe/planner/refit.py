"""Fitting the cost model to measured times: what online re-planning and the plan cache's re-timing compute.

Why in the planner: these are pure functions of a cost file and measurements (no process group, no engine), so
the tests call them directly and the runtime's re-planner (runtime/planning/replan.py) and profiler only gather the
samples and hand them in. The rules: each chunk's cost points scaled by measured / predicted, per kind (F, B, W;
the median over the measured steps, :func:`refit_cost`); the whole-step terms replaced by the measured medians
(:func:`refit_step`); the engine's time between actions fitted as a fixed cost per action
(:func:`calibrate_action_gap`).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import replace
from typing import Any, Iterable, Mapping, Optional

from .cost import PipelineCost, scaled_cost
from .schedule import ActionKind
from .simulate import TimedAction, simulate
from .step_cost import StepCost

__all__ = ["calibrate_action_gap", "measured_over_predicted", "measured_sums", "refit_cost", "refit_step"]

_KINDS = {ActionKind.FORWARD: "F", ActionKind.BACKWARD: "B", ActionKind.WEIGHT: "W"}


def measured_sums(timeline: Iterable[TimedAction], slices: tuple[int, ...], seq_len: int,
                  weights_per_slice: bool) -> list[tuple[int, str, int, int, int, float]]:
    """A step's measured compute, as ``(chunk, kind, slice_len, context, count, ms)`` sums per distinct action
    shape: what the cost model predicts per action. A ``W`` covers its slice (per-slice W) or the whole
    sequence (one W per micro-batch, written with slice 0)."""
    starts = [sum(slices[:i]) for i in range(len(slices))]
    sums: dict[tuple[int, str, int, int], list[float]] = defaultdict(lambda: [0, 0.0])
    for event in timeline:
        action = event.action
        kind = _KINDS.get(action.kind)
        if kind is None:
            continue
        length, context = slices[action.slice], starts[action.slice]
        if kind == "W" and not weights_per_slice:
            length, context = seq_len, 0
        entry = sums[(action.chunk, kind, length, context)]
        entry[0] += 1
        entry[1] += event.end_ms - event.start_ms
    return [(c, k, s, ctx, int(n), ms) for (c, k, s, ctx), (n, ms) in sorted(sums.items())]


def _action_ms(cost: PipelineCost, chunk: int, kind: str) -> float:
    """The cost model's fixed cost per action (``cost.step``), which the refit leaves alone."""
    if cost.step is None:
        return 0.0
    return cost.step.action_ms({"F": "forward", "B": "backward", "W": "weight"}[kind], chunk, cost.num_chunks)


def _predicted_ms(cost: PipelineCost, chunk: int, kind: str, slice_len: int, context: int, batch: int,
                  slices: Optional[tuple[int, ...]]) -> float:
    stage = cost.chunk(chunk)
    if kind == "F":
        return float(stage.forward_ms(slice_len, context, batch))
    if kind == "B":
        return float(stage.backward_ms(slice_len, context, batch))
    if slices is not None and slice_len == sum(slices):   # one W for the micro-batch: every slice's W work
        return float(sum(float(stage.weight_ms(s, batch)) for s in slices))
    return float(stage.weight_ms(slice_len, batch))


def refit_cost(cost: Mapping[str, Any], steps: Iterable[Iterable[tuple[int, str, int, int, int, float]]],
               batch: int, slices: Optional[tuple[int, ...]] = None
               ) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
    """Scale each chunk's cost points by what the measured steps took over what ``cost`` predicts for them.

    ``steps``: each measured step's samples (:func:`measured_sums` of that step's timeline, every rank's).
    Each step gives its own measured / predicted per chunk and kind, and the median over the steps is kept: a
    stall of the host inside one action lands whole in its step's sum (40 ms among 48 forwards of 0.7 ms doubles
    it), so one step of three must not decide the refit. ``slices``: the plan the samples ran (a ``W`` sample
    covering ``sum(slices)`` tokens is one W per micro-batch, predicted as the sum of its slices' W work).
    Returns the refit cost (the cost-file dict, as plans and the plan cache store it) and the ratios per chunk
    and kind. A kind without samples, or whose prediction is zero, keeps its scale (ratio 1).
    """
    model = PipelineCost.from_dict(cost)
    per_step = [_ratios(model, samples, batch, slices, per_action=True) for samples in steps]
    ratios = {chunk: {k: statistics.median(seen) if (seen := [r[(chunk, k)] for r in per_step if (chunk, k) in r])
                      else 1.0 for k in ("F", "B", "W")} for chunk in range(model.num_chunks)}
    return scaled_cost(cost, ratios), ratios


def measured_over_predicted(cost: Mapping[str, Any], samples: Iterable[tuple[int, str, int, int, int, float]],
                            batch: int, slices: Optional[tuple[int, ...]] = None, *, per_action: bool = True
                            ) -> dict[int, dict[str, float]]:
    """Per chunk and kind (F, B, W): the samples' summed milliseconds over what ``cost`` predicts for them (1.0
    for a kind without samples or with a zero prediction). ``per_action``: the samples are a step's actions, so
    the model's fixed cost per action (``cost.step``) comes off them first; a profile's points (the plan cache's
    re-timing, ``runtime/planning/profile.recheck_costs``) contain none."""
    model = PipelineCost.from_dict(cost)
    ratios = _ratios(model, samples, batch, slices, per_action)
    return {chunk: {k: ratios.get((chunk, k), 1.0) for k in ("F", "B", "W")} for chunk in range(model.num_chunks)}


def _ratios(model: PipelineCost, samples: Iterable[tuple[int, str, int, int, int, float]], batch: int,
            slices: Optional[tuple[int, ...]], per_action: bool) -> dict[tuple[int, str], float]:
    """Measured / predicted for each (chunk, kind) the samples hold and the model predicts above zero."""
    measured: dict[tuple[int, str], float] = defaultdict(float)
    predicted: dict[tuple[int, str], float] = defaultdict(float)
    for chunk, kind, length, context, count, ms in samples:
        fixed = count * _action_ms(model, chunk, kind) if per_action else 0.0
        measured[(chunk, kind)] += max(0.0, ms - fixed)   # the points' share
        predicted[(chunk, kind)] += count * _predicted_ms(model, chunk, kind, length, context, batch, slices)
    return {key: measured[key] / p for key, p in predicted.items() if p > 0}


def refit_step(step: Optional[Mapping[str, Any]], terms: Iterable[tuple[int, Mapping[str, float]]],
               num_ranks: int) -> tuple[Optional[dict[str, Any]], dict[str, float]]:
    """The whole-step part of the cost model (``cost.step``) refit to measured steps.

    ``terms``: ``(pipeline rank, {term: ms})`` per rank and measured step, as the engine records them with its
    timeline (``engine.last_step_terms``): ``step`` (``train_batch``), ``loop`` (its instruction loop), and the
    tail instructions ``tied_reduce``, ``grad_reduce``, ``optimizer``. Per rank the median over steps (and
    replicas) is taken. A collective waits for its slowest member, so a rank's span also holds the others' lag;
    the model adds that lag itself (the makespan, then the slowest rank's tail), so the refit takes:

    * ``tied_reduce_ms``: the smallest median over the tied ranks (the one that arrived last waited least); on a
      rank outside the tied group that instruction only hands the deferred weight gradients over, local work that
      joins its ``grad_reduce_ms``;
    * ``optimizer_ms`` and ``grad_reduce_ms``: each rank's own median;
    * ``sync_ms``: the smallest over ranks of the median over steps of ``step - loop``: what ``train_batch`` does
      around the loop (reading and agreeing on the next batch's length, the loss broadcast, DeepSpeed's
      bookkeeping); per step, not the difference of the two medians, which can come from different steps and
      carry their spread (5-10 ms on a shared host) into a term of a few ms.

    The fixed costs per action (``action_ms``) are kept. Returns the refit ``"step"`` dict (``step`` unchanged,
    possibly None, when a rank has no terms) and what was measured: ``step_ms`` (median over ranks of each rank's
    median step), ``schedule_ms`` (the slowest rank's loop without its tail) and ``tail_ms`` (the rest).
    """
    per_rank: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rank, values in terms:
        for key, ms in values.items():
            per_rank[rank][key].append(float(ms))
        if "step" in values and "loop" in values:
            per_rank[rank]["outside"].append(float(values["step"]) - float(values["loop"]))
    med = {r: {k: statistics.median(v) for k, v in d.items()} for r, d in per_rank.items()}
    if any(r not in med or "step" not in med[r] or "loop" not in med[r] for r in range(num_ranks)):
        return (dict(step) if step is not None else None), {}
    old = StepCost.from_dict(step) if step is not None else StepCost()
    tied_ranks = [r for r in old.tied_ranks if r < num_ranks]
    tied = min(med[r].get("tied_reduce", 0.0) for r in tied_ranks) if tied_ranks else 0.0
    grad = [med[r].get("grad_reduce", 0.0) + (0.0 if r in tied_ranks else med[r].get("tied_reduce", 0.0))
            for r in range(num_ranks)]
    optimizer = [med[r].get("optimizer", 0.0) for r in range(num_ranks)]
    sync = max(0.0, min(med[r].get("outside", med[r]["step"] - med[r]["loop"]) for r in range(num_ranks)))
    refit = StepCost(forward_ms=old.forward_ms, backward_ms=old.backward_ms, weight_ms=old.weight_ms,
                     optimizer_ms=tuple(optimizer), grad_reduce_ms=tuple(grad), tied_reduce_ms=tied,
                     tied_ranks=old.tied_ranks, sync_ms=sync)
    tails = [sum(med[r].get(k, 0.0) for k in ("tied_reduce", "grad_reduce", "optimizer")) for r in range(num_ranks)]
    step_ms = statistics.median(med[r]["step"] for r in range(num_ranks))
    schedule_ms = max(med[r]["loop"] - tails[r] for r in range(num_ranks))
    return refit.to_dict(), {"step_ms": step_ms, "schedule_ms": schedule_ms, "tail_ms": step_ms - schedule_ms}


def calibrate_action_gap(cost: Mapping[str, Any], schedule: Any, slices: tuple[int, ...], batch: int,
                         schedule_ms: float) -> tuple[dict[str, Any], float]:
    """The refit cost with a fixed time added to every forward and backward action (``action_ms``) so that the
    simulated schedule takes what the measured steps' schedule took (``schedule_ms``), and that time in ms (0, and
    ``cost`` unchanged, when the simulation already takes at least as long).

    Why: the refit scales each action's compute to its measured span, but the engine also works between actions,
    where no span sees it: issuing and completing sends and receives, the instruction loop, the Python around each
    slice. On the README's example (GPT 4 x 128, seq 256, m = 4) the refit predicted the step 10% short (349
    against 389 ms measured); fitted, 1.86 ms per action there, 0-10 ms on the benchmark's GPT 8 x 512 (where the
    refit had been up to 4% short, or already long: 0). Charged per action, a plan with more slices pays it more
    often, as the engine does. Solved by bisection on the simulator (the makespan grows monotonically with it);
    about 30 simulations, once per re-plan.
    """
    fitted = PipelineCost.from_dict(cost)   # the stages' fits once; each trial only changes the step terms
    base_step = fitted.step if fitted.step is not None else StepCost()

    def step_with(gap: float) -> StepCost:
        return replace(base_step, forward_ms=tuple(v + gap for v in base_step.forward_ms),
                       backward_ms=tuple(v + gap for v in base_step.backward_ms))

    def makespan(gap: float) -> float:
        trial = PipelineCost(fitted.stages, meta=fitted.meta, step=step_with(gap), vocab=fitted.vocab)
        return float(simulate(schedule, trial, list(slices), batch).makespan_ms)

    base = makespan(0.0)
    if not schedule_ms > base * (1.0 + 1e-6):
        return dict(cost), 0.0
    actions = max(1, max(sum(1 for a in rank if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD))
                         for rank in schedule.stages))
    lo, hi = 0.0, (schedule_ms - base) / actions   # a rank's actions run one after another: the least it can take
    for _ in range(30):
        if makespan(hi) >= schedule_ms:
            break
        lo, hi = hi, 2.0 * hi
    for _ in range(24):
        mid = 0.5 * (lo + hi)
        if makespan(mid) < schedule_ms:
            lo = mid
        else:
            hi = mid
    return {**cost, "step": step_with(hi).to_dict()}, hi

"""Online re-planning: refit the cost model to what the steps measure, and switch plans when it pays.

Why: ``slices: "auto"`` plans once, at init, from a profile of each chunk's layers run alone. During training
the same layers run differently: the other ranks compute at the same time (shared cores, memory bandwidth),
allocator and cache state differ, and on a shared host the machine itself speeds up and slows down. A plan
chosen on a model that is off by a fifth is not the best plan. No peer re-plans from measurements; TeraPipe's
planner runs offline.

How (``terapipe.replan``; every rank takes the same steps, so every rank switches at the same step):

1. After ``warmup_steps`` training steps, the engine records its timeline for ``measure_steps`` steps (the
   accelerator-synchronised spans ``trace_dir`` writes; nothing is recorded otherwise).
2. Each rank sums, per chunk and kind (F, B, W), what its actions took, and keeps what the rest of each step took
   (the tail instructions: tied and data-parallel gradient reduction, optimizer step; and the step outside the
   instruction loop); one ``all_gather_object`` brings both to global rank 0, which also predicts the same
   actions from the cost model the plan was made from.
3. Rank 0 scales each chunk's measured cost points by measured / predicted (forward, backward and the deferred
   weight-gradient rate separately), replaces the whole-step terms (``cost.step``: optimizer, reductions, sync)
   by the measured ones (:func:`refit_step`), fits the time the engine spends between actions
   (:func:`calibrate_action_gap`), re-solves the slicing under the refit model, predicts the current
   slicing under the same model, and switches when the new plan's predicted step is at least ``min_gain``
   faster. The log shows the refit prediction of the current plan beside the measured step, split into the
   schedule and what follows it, so what the model still misses is visible.
4. The decision is broadcast; every rank installs the plan before the next step, and the refit costs are kept
   for sequence lengths planned later. Then the re-planner is idle: one integer comparison per step.

Slicing is exact, so a switch changes the speed, never the results (the tests compare losses and gradients
across a switch with the unsliced reference).
"""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Optional

import torch.distributed as dist

from ..planner.cost import PipelineCost, scaled_cost
from ..planner.step_cost import StepCost
from ..planner.schedule import ActionKind, build_schedule
from ..planner.simulate import TimedAction, simulate

if TYPE_CHECKING:  # pragma: no cover - annotations only
    from .engine import TokenPipelineEngine
    from .plan import ResolvedPlan

__all__ = ["Replanner", "calibrate_action_gap", "measured_sums", "refit_cost", "refit_step"]

logger = logging.getLogger(__name__)

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
        entry = sums[(action.stage, kind, length, context)]
        entry[0] += 1
        entry[1] += event.end_ms - event.start_ms
    return [(c, k, s, ctx, int(n), ms) for (c, k, s, ctx), (n, ms) in sorted(sums.items())]


def _action_ms(cost: PipelineCost, chunk: int, kind: str) -> float:
    """The cost model's fixed cost per action (``cost.step``), which the refit leaves alone."""
    if cost.step is None:
        return 0.0
    return cost.step.action_ms({"F": "forward", "B": "backward", "W": "weight"}[kind], chunk, cost.num_stages)


def _predicted_ms(cost: PipelineCost, chunk: int, kind: str, slice_len: int, context: int, batch: int,
                  slices: Optional[tuple[int, ...]]) -> float:
    stage = cost.stage(chunk)
    if kind == "F":
        return float(stage.forward_ms(slice_len, context, batch))
    if kind == "B":
        return float(stage.backward_ms(slice_len, context, batch))
    if slices is not None and slice_len == sum(slices):   # one W for the micro-batch: every slice's W work
        return float(sum(float(stage.weight_ms(s, batch)) for s in slices))
    return float(stage.weight_ms(slice_len, batch))


def refit_cost(cost: Mapping[str, Any], samples: Iterable[tuple[int, str, int, int, int, float]],
               batch: int, slices: Optional[tuple[int, ...]] = None
               ) -> tuple[dict[str, Any], dict[int, dict[str, float]]]:
    """Scale each chunk's cost points by what the samples measured over what ``cost`` predicts for them.

    ``slices``: the plan the samples ran (a ``W`` sample covering ``sum(slices)`` tokens is one W per micro-batch,
    predicted as the sum of its slices' W work). Returns the refit cost (the cost-file dict, as plans and the
    plan cache store it) and the ratios per chunk and kind. A kind without samples, or whose prediction is zero,
    keeps its scale (ratio 1).
    """
    ratios = measured_over_predicted(cost, samples, batch, slices)
    return scaled_cost(cost, ratios), ratios


def measured_over_predicted(cost: Mapping[str, Any], samples: Iterable[tuple[int, str, int, int, int, float]],
                            batch: int, slices: Optional[tuple[int, ...]] = None, *, per_action: bool = True
                            ) -> dict[int, dict[str, float]]:
    """Per chunk and kind (F, B, W): the samples' summed milliseconds over what ``cost`` predicts for them (1.0
    for a kind without samples or with a zero prediction). ``per_action``: the samples are a step's actions, so
    the model's fixed cost per action (``cost.step``) comes off them first; a profile's points (the plan cache's
    re-timing, ``runtime/profile.recheck_costs``) contain none."""
    model = PipelineCost.from_dict(cost)
    measured: dict[tuple[int, str], float] = defaultdict(float)
    predicted: dict[tuple[int, str], float] = defaultdict(float)
    for chunk, kind, length, context, count, ms in samples:
        fixed = count * _action_ms(model, chunk, kind) if per_action else 0.0
        measured[(chunk, kind)] += max(0.0, ms - fixed)   # the points' share
        predicted[(chunk, kind)] += count * _predicted_ms(model, chunk, kind, length, context, batch, slices)
    return {chunk: {k: measured[(chunk, k)] / predicted[(chunk, k)] if predicted.get((chunk, k), 0.0) > 0
                    else 1.0 for k in ("F", "B", "W")} for chunk in range(len(cost["stages"]))}


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
    * ``sync_ms``: the smallest median over ranks of ``step - loop``: what ``train_batch`` does around the loop
      (reading and agreeing on the next batch's length, the loss broadcast, DeepSpeed's bookkeeping).

    The fixed costs per action (``action_ms``) are kept. Returns the refit ``"step"`` dict (``step`` unchanged,
    possibly None, when a rank has no terms) and what was measured: ``step_ms`` (median over ranks of each rank's
    median step), ``schedule_ms`` (the slowest rank's loop without its tail) and ``tail_ms`` (the rest).
    """
    per_rank: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for rank, values in terms:
        for key, ms in values.items():
            per_rank[rank][key].append(float(ms))
    med = {r: {k: statistics.median(v) for k, v in d.items()} for r, d in per_rank.items()}
    if any(r not in med or "step" not in med[r] or "loop" not in med[r] for r in range(num_ranks)):
        return (dict(step) if step is not None else None), {}
    old = StepCost.from_dict(step) if step is not None else StepCost()
    tied_ranks = [r for r in old.tied_ranks if r < num_ranks]
    tied = min(med[r].get("tied_reduce", 0.0) for r in tied_ranks) if tied_ranks else 0.0
    grad = [med[r].get("grad_reduce", 0.0) + (0.0 if r in tied_ranks else med[r].get("tied_reduce", 0.0))
            for r in range(num_ranks)]
    optimizer = [med[r].get("optimizer", 0.0) for r in range(num_ranks)]
    sync = max(0.0, min(med[r]["step"] - med[r]["loop"] for r in range(num_ranks)))
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
        trial = PipelineCost(fitted.stages, meta=fitted.meta, step=step_with(gap))
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


class Replanner:
    """The engine's online re-planner (``terapipe.replan``): measures, then decides once, then stays idle."""

    def __init__(self, engine: "TokenPipelineEngine") -> None:
        cfg = engine.terapipe.replan
        self.warmup_steps = cfg.warmup_steps
        self.measure_steps = cfg.measure_steps
        self.min_gain = cfg.min_gain
        self.steps = 0
        self.samples: list[tuple[int, str, int, int, int, float]] = []
        self.step_terms: list[tuple[int, dict[str, float]]] = []   # (pipeline rank, engine.last_step_terms)
        self.done = False
        self._recording_was = engine.record_timeline
        self.decision: Optional[dict[str, Any]] = None  # what was decided, for logs and tests

    def before_step(self, engine: "TokenPipelineEngine") -> None:
        """Record this step's timeline if it is in the measuring window."""
        if not self.done and self.steps >= self.warmup_steps:
            engine.record_timeline = True

    def after_step(self, engine: "TokenPipelineEngine") -> None:
        """Count the step; at the end of the window, decide (collective) and go idle."""
        if self.done:
            return
        self.steps += 1
        if self.steps <= self.warmup_steps:
            return
        plan = engine.plan
        self.samples.extend(measured_sums(engine.last_timeline, plan.slices, plan.seq_len,
                                          engine._running.schedule.weights_per_slice))
        self.step_terms.append((engine.stage_id, dict(engine.last_step_terms)))
        if self.steps < self.warmup_steps + self.measure_steps:
            return
        engine.record_timeline = self._recording_was
        self.done = True
        self._decide(engine)

    def _decide(self, engine: "TokenPipelineEngine") -> None:
        from .plan import _decided_on_rank0, _solve

        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.samples, self.step_terms))
        self.samples, self.step_terms = [], []
        plan = engine.plan
        batch = engine.micro_batch_size

        def decide() -> Optional[dict[str, Any]]:
            if plan.cost is None:  # slices from the config: nothing to re-plan
                return None
            cost, ratios = refit_cost(plan.cost, [s for samples, _ in gathered for s in samples], batch,
                                      plan.slices)
            step, measured = refit_step(plan.cost.get("step"), [t for _, terms in gathered for t in terms],
                                        engine.num_stages)
            cfg = engine.terapipe
            schedule = build_schedule(cfg.schedule, engine.num_stages, engine.micro_batches, len(plan.slices),
                                      cfg.deferred_weight_grads, virtual_stages=cfg.virtual_stages)
            gap = 0.0
            if measured:   # else a rank measured nothing: the step terms stay the init's
                cost["step"] = step
                cost, gap = calibrate_action_gap(cost, schedule, plan.slices, batch, measured["schedule_ms"])
            model = PipelineCost.from_dict(cost)
            sim = simulate(schedule, model, plan.slices, batch)
            before = simulate(schedule, PipelineCost.from_dict(plan.cost), plan.slices, batch)  # the init model
            current = sim.step_ms
            best = _solve(engine, model, plan.stage_meta, plan.seq_len)
            gain = current / best.predicted_ms - 1.0 if best.predicted_ms > 0 else 0.0
            switch = tuple(best.slices) != tuple(plan.slices) and gain >= self.min_gain
            return {"cost": cost, "ratios": {str(c): r for c, r in ratios.items()}, "current_ms": current,
                    "current_schedule_ms": sim.makespan_ms, "current_tail_ms": sim.tail_ms, "measured": measured,
                    "gap_ms": gap,
                    "step_cost": cost.get("step"), "before_schedule_ms": before.makespan_ms,
                    "before_tail_ms": before.tail_ms,
                    "best": best.to_dict(), "gain": gain, "switch": switch}

        decision = _decided_on_rank0(decide)
        self.decision = decision and {k: v for k, v in decision.items() if k != "cost"}
        if decision is None:
            return
        if engine.global_rank == 0:
            logger.info("terapipe: re-plan after %d measured step(s): measured/predicted per chunk %s; current "
                        "slices %s predicted %.1f ms under the refit costs, best %s %.1f ms (%+.1f%%): %s",
                        self.measure_steps, {c: {k: round(v, 2) for k, v in r.items()}
                                             for c, r in decision["ratios"].items()},
                        list(plan.slices), decision["current_ms"], decision["best"]["slices"],
                        decision["best"]["predicted_ms"], 100 * decision["gain"],
                        "switching" if decision["switch"] else f"keeping the plan (gain < {self.min_gain:.0%})")
            measured = decision["measured"]
            if measured:
                logger.info("terapipe: re-plan: the measured step %.1f ms = schedule %.1f + after it %.1f; the plan "
                            "that ran, predicted by the refit model (%.2f ms between actions) %.1f ms = %.1f + %.1f "
                            "(%+.1f%%), by the model it was planned with %.1f ms = %.1f + %.1f (%+.1f%%)",
                            measured["step_ms"], measured["schedule_ms"], measured["tail_ms"], decision["gap_ms"],
                            decision["current_ms"],
                            decision["current_schedule_ms"], decision["current_tail_ms"],
                            100 * (decision["current_ms"] / measured["step_ms"] - 1.0),
                            decision["before_schedule_ms"] + decision["before_tail_ms"], decision["before_schedule_ms"],
                            decision["before_tail_ms"],
                            100 * ((decision["before_schedule_ms"] + decision["before_tail_ms"]) / measured["step_ms"]
                                   - 1.0))
        engine.install_plan(_replanned(plan, decision))


def _replanned(plan: "ResolvedPlan", decision: Mapping[str, Any]) -> "ResolvedPlan":
    """The plan to run from now on: the new slicing if switching, else the old one; the refit costs either way
    (sequence lengths planned later start from them). A kept plan's prediction becomes the refit model's (its
    step and unsliced times; the bubble fraction stays as planned), so ``engine.predicted_step_ms``, which the
    example trainer prints beside the measured step, reports what the measured actions imply."""
    from ..planner.slicing import SlicingPlan

    if not decision["switch"]:
        planner = plan.planner
        if planner is not None:
            unsliced = float(decision["best"]["unsliced_ms"])
            planner = replace(planner, predicted_ms=float(decision["current_ms"]), unsliced_ms=unsliced,
                              speedup=unsliced / float(decision["current_ms"]))
        return replace(plan, planner=planner, cost=decision["cost"] if plan.cost is not None else None)
    best = SlicingPlan.from_dict(decision["best"])
    return replace(plan, slices=tuple(best.slices), source="replanned", planner=best,
                   cost=decision["cost"] if plan.cost is not None else None)

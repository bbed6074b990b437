"""Online re-planning: refit the cost model to what the steps measure, and switch plans when it pays.

Why: ``slices: "auto"`` plans once, at init, from a profile of each chunk's layers run alone. During training
the same layers run differently: the other ranks compute at the same time (shared cores, memory bandwidth),
allocator and cache state differ, and on a shared host the machine itself speeds up and slows down. A plan
chosen on a model that is off by a fifth is not the best plan. No peer re-plans from measurements; TeraPipe's
planner runs offline.

How (``terapipe.replan``; every rank takes the same steps, so every rank switches at the same step):

1. After ``warmup_steps`` training steps, the engine records its timeline for ``measure_steps`` steps (the
   accelerator-synchronised spans ``trace_dir`` writes; nothing is recorded otherwise).
2. Each rank sums, per step, chunk and kind (F, B, W), what its actions took, and keeps what the rest of each
   step took (the tail instructions: tied and data-parallel gradient reduction, optimizer step; and the step
   outside the instruction loop); one ``all_gather_object`` brings both to global rank 0, which also predicts the
   same actions from the cost model the plan was made from.
3. Rank 0 scales each chunk's measured cost points by measured / predicted (forward, backward and the deferred
   weight-gradient rate separately; the median over the measured steps, so one step a stall fell into is
   outvoted), replaces the whole-step terms (``cost.step``: optimizer, reductions, sync) by the measured ones
   (:func:`refit_step`), fits the time the engine spends between actions (:func:`calibrate_action_gap`),
   re-solves the slicing under the refit model, predicts the current slicing under the same model, and switches
   when the new plan's predicted step is at least ``min_gain`` faster. The log shows the refit prediction of the
   current plan beside the measured step, split into the schedule and what follows it, so what the model still
   misses is visible.
4. The decision is broadcast; every rank installs the plan before the next step, and the refit costs are kept
   for sequence lengths planned later. Then the re-planner is idle: one integer comparison per step.

Slicing is exact, so a switch changes the speed, never the results (the tests compare losses and gradients
across a switch with the unsliced reference).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Mapping, Optional

import torch.distributed as dist

from ...planner.cost import PipelineCost
from ...planner.refit import calibrate_action_gap, measured_sums, refit_cost, refit_step
from ...planner.simulate import simulate
from ..execution.collective import decided_on_rank0
from ..execution.stage import PipelineStage
from .plan import ResolvedPlan, solve_slicing

__all__ = ["Replanner"]

logger = logging.getLogger(__name__)

class Replanner:
    """The engine's online re-planner (``terapipe.replan``): measures, then decides once, then stays idle."""

    def __init__(self, engine: "PipelineStage") -> None:
        cfg = engine.terapipe.replan
        self.warmup_steps = cfg.warmup_steps
        self.measure_steps = cfg.measure_steps
        self.min_gain = cfg.min_gain
        self.steps = 0
        self.samples: list[list[tuple[int, str, int, int, int, float]]] = []   # one list per measured step
        self.step_terms: list[tuple[int, dict[str, float]]] = []   # (pipeline rank, engine.last_step_terms)
        self.done = False
        self._recording_was = engine.record_timeline
        self.decision: Optional[dict[str, Any]] = None  # what was decided, for logs and tests

    def before_step(self, engine: "PipelineStage") -> None:
        """Record this step's timeline if it is in the measuring window."""
        if not self.done and self.steps >= self.warmup_steps:
            engine.record_timeline = True

    def after_step(self, engine: "PipelineStage") -> None:
        """Count the step; at the end of the window, decide (collective) and go idle."""
        if self.done:
            return
        self.steps += 1
        if self.steps <= self.warmup_steps:
            return
        plan = engine.plan
        if engine.uniform_step:   # a step of micro-batches of other lengths times other slices: not this plan's
            self.samples.append(measured_sums(engine.last_timeline, plan.slices, plan.seq_len,
                                              engine.running.schedule.weights_per_slice))
            self.step_terms.append((engine.stage_id, dict(engine.last_step_terms)))
        if self.steps < self.warmup_steps + self.measure_steps:
            return
        engine.record_timeline = self._recording_was
        self.done = True
        self._decide(engine)

    def _decide(self, engine: "PipelineStage") -> None:
        # the gather below blocks without a deadline, and a rank may have failed after its last step's barrier (in
        # DeepSpeed's logging at the end of train_batch): meet first in a barrier that watches the abort flag
        engine.barrier("the re-planner's measured steps")
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.samples, self.step_terms))
        self.samples, self.step_terms = [], []
        plan = engine.plan
        batch = engine.micro_batch_size

        def decide() -> Optional[dict[str, Any]]:
            if plan.cost is None:  # slices from the config: nothing to re-plan
                return None
            # the k-th recorded step of every rank as one step (replicas whose micro-batches differ in length may
            # record different steps; as many as the rank that recorded fewest)
            steps = [[s for rank_step in ranks for s in rank_step] for ranks in zip(*(st for st, _ in gathered))]
            cost, ratios = refit_cost(plan.cost, steps, batch, plan.slices)
            step, measured = refit_step(plan.cost.get("step"), [t for _, terms in gathered for t in terms],
                                        engine.num_stages)
            schedule = engine.lowered_schedule(len(plan.slices))
            gap = 0.0
            if measured:   # else a rank measured nothing: the step terms stay the init's
                cost["step"] = step
                cost, gap = calibrate_action_gap(cost, schedule, plan.slices, batch, measured["schedule_ms"])
            model = PipelineCost.from_dict(cost)
            sim = simulate(schedule, model, plan.slices, batch)
            before = simulate(schedule, PipelineCost.from_dict(plan.cost), plan.slices, batch)  # the init model
            current = sim.step_ms
            best = solve_slicing(engine, model, plan.stage_meta, plan.seq_len)
            gain = current / best.predicted_ms - 1.0 if best.predicted_ms > 0 else 0.0
            switch = tuple(best.slices) != tuple(plan.slices) and gain >= self.min_gain
            return {"cost": cost, "ratios": {str(c): r for c, r in ratios.items()}, "steps": len(steps),
                    "current_ms": current,
                    "current_schedule_ms": sim.makespan_ms, "current_tail_ms": sim.tail_ms, "measured": measured,
                    "gap_ms": gap,
                    "step_cost": cost.get("step"), "before_schedule_ms": before.makespan_ms,
                    "before_tail_ms": before.tail_ms,
                    "best": best.to_dict(), "gain": gain, "switch": switch}

        decision = decided_on_rank0(decide)
        self.decision = decision and {k: v for k, v in decision.items() if k != "cost"}
        if decision is None:
            return
        if engine.global_rank == 0:
            logger.info("terapipe: re-plan after %d measured step(s): measured/predicted per chunk %s; current "
                        "slices %s predicted %.1f ms under the refit costs, best %s %.1f ms (%+.1f%%): %s",
                        decision["steps"], {c: {k: round(v, 2) for k, v in r.items()}
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
    from ...planner.slicing import SlicingPlan

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

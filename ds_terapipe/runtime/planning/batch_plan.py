"""Per-batch plans for packed rows (``terapipe.plan_per_batch``): the slicing of each step cut for its documents.

A slice of a packed row attends over the keys of its own document only, so what a slice costs depends on where
the documents of the step's rows end, and so does the best slicing (``planner/documents.py``). Before every
training step:

1. the first stage of every pipeline replica, having peeked the step's micro-batches, reduces the position ids of
   those of one length (replica 0's first micro-batch's, the same on every rank, so every replica's profile has
   one size) to the document context at each grid start (:func:`~ds_terapipe.planner.documents.document_context`);
2. every rank joins one all-reduce (MAX over the replicas: the slowest replica paces the step) of that profile;
3. global rank 0 plans the step's slicing from the costs the length's plan was made from, memoised by document
   layout (:class:`~ds_terapipe.planner.documents.DocumentPlanner`), and broadcasts the slice lengths in one
   fixed-size tensor, so a rank that cannot plan makes every rank raise with its message.

A plan per batch must cost little next to the step: it is solved on a grid of at most ``PLAN_GRID`` cut points
(the config's granularity, coarsened by a whole factor when the row is longer; the planner's work grows with the
square of the grid). At 2048 tokens that is 32-token cuts, 20-50 ms of planning on one core, against 40-150 ms on
the 8-token grid, for plans within 0.5% of the fine grid's in the simulator (``docs/models.md``).

Both collectives run under the p2p deadline, as the sequence-length agreement does. The plan of the row length
(``engine.plans``) stays what checkpoints, evaluation and new lengths build on; the per-batch plan lives for one
step. Without measured costs on rank 0 (a length planned from a config slicing) the length's plan is run.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Optional, Sequence

import numpy as np
import torch
import torch.distributed as dist

from ...planner._checks import fitting_granularity
from ...planner.cost import PipelineCost
from ...planner.documents import DocumentPlanner, document_context
from ..execution.collective import mark_collective
from ..execution.stage import PipelineStage
from ..slicing.documents import positions_of
from .plan import ResolvedPlan, solve_slicing

__all__ = ["BatchPlanner", "PLAN_GRID"]

#: The most cut points a per-batch plan is solved over.
PLAN_GRID = 64

logger = logging.getLogger(__name__)

# Slot 0 of the broadcast plan when rank 0 could not plan (its message follows in the log and the error).
_FAILED = -1


class BatchPlanner:
    """One per engine: agrees each training step's slicing from the documents of its micro-batches."""

    def __init__(self, engine: PipelineStage) -> None:
        self.granularity = engine.terapipe.granularity
        self._planners: dict[int, tuple[Any, DocumentPlanner]] = {}   # seq_len -> (the costs' owner, planner)
        self.last_context: Optional[np.ndarray] = None

    def local_context(self, batches: Sequence[Any], seq_len: int) -> Optional[np.ndarray]:
        """The document context of this replica's micro-batches of length ``seq_len`` (their inputs), None when
        none of them has position ids this planner reads."""
        positions = [p for p in (positions_of(b) for b in batches) if p is not None and p.shape[1] == seq_len]
        if not positions:
            return None
        return document_context([p.cpu().numpy() for p in positions], self.granularity)

    def plan_step(self, engine: PipelineStage, base: ResolvedPlan, local: Optional[np.ndarray]) -> ResolvedPlan:
        """This step's plan (collective: every rank calls it, the first stages with their ``local`` context)."""
        n = base.seq_len // self.granularity
        profile = torch.zeros(n, dtype=torch.float64, device=engine.device)
        if local is not None:
            profile.copy_(torch.from_numpy(np.asarray(local, dtype=np.float64)))
        engine.p2p.wait(dist.all_reduce(profile, op=dist.ReduceOp.MAX, async_op=True),
                        "the document agreement at the start of a batch")
        context = profile.cpu().numpy()
        self.last_context = context
        slices = torch.zeros(n + 1, dtype=torch.int64, device=engine.device)
        message = None
        if dist.get_rank() == 0:
            try:
                planned = self._solve(engine, base, context)
                slices[:len(planned)] = torch.tensor(planned, dtype=torch.int64)
            except Exception as err:  # noqa: BLE001 - every rank raises below, none waits in the broadcast
                message = f"{type(err).__name__}: {err}"
                logger.exception("terapipe.plan_per_batch: planning the step on rank 0 failed")
                slices[0] = _FAILED
        engine.p2p.wait(dist.broadcast(slices, src=0, async_op=True), "the per-batch plan at the start of a batch")
        got = slices.tolist()
        if got[0] == _FAILED:
            raise mark_collective(RuntimeError("terapipe.plan_per_batch: planning this step on global rank 0 failed"
                                               + (f": {message}" if message else "; its log says why")))
        planned = tuple(x for x in got if x > 0)
        if sum(planned) != base.seq_len:   # a plan without costs: the length's own
            return base
        return replace(base, slices=planned, source="documents")

    def _solve(self, engine: PipelineStage, base: ResolvedPlan, context: np.ndarray) -> tuple[int, ...]:
        """Rank 0: the slicing for ``context``, memoised; the length's slicing when it has no measured costs."""
        if base.cost is None:
            return (0,)
        owner, planner = self._planners.get(base.seq_len, (None, None))
        if owner is not base.cost or planner is None:   # new costs (a re-plan, a freeze): a new memo
            cost = PipelineCost.from_dict(base.cost, num_stages=engine.num_chunks)
            stage_meta, coarse = base.stage_meta, self.plan_granularity(base.seq_len)
            planner = DocumentPlanner(cost, self.granularity, lambda seq_len, c: solve_slicing(
                engine, c, stage_meta, seq_len, quiet=True, granularity=coarse), quantum=coarse)
            self._planners[base.seq_len] = (base.cost, planner)
        plan = planner.plan(base.seq_len, context)
        return tuple(plan.slices)

    def plan_granularity(self, seq_len: int) -> int:
        """The grid a per-batch plan of ``seq_len`` is solved on: the config's granularity times the smallest
        factor dividing the row's grid that leaves at most ``PLAN_GRID`` cut points."""
        return fitting_granularity(seq_len, self.granularity, PLAN_GRID)

    @property
    def planning_ms(self) -> list[float]:
        """Rank 0's wall time per step in the planner (memo hits included), over every length."""
        return [ms for _, planner in self._planners.values() for ms in planner.planning_ms]

"""PlanSelection: which plan and which schedule each step of the TokenPipelineEngine runs.

What it owns: the plan in use and its views (``slices``, ``slice_bounds``, ``token_bounds``, and per micro-batch
slicings when a step's micro-batches differ in length); the read-ahead before every batch, in which the first and
last stages peek at the step's micro-batches and every rank agrees on their sequence lengths, so a new length is
planned once by all ranks and a batch that cannot run is refused by all of them together; the slice check on a
real batch for a model that cannot sample an input; ``install_plan``, through which the re-planner and the
freezer switch plans; and the lowered schedules a step runs (DeepSpeed's ``_train_schedule`` and
``_inference_schedule``).

Why apart from the engine's core: all of it decides what runs before the first instruction of a step does, from
the plans of ``runtime/planning/``; the core (``engine.py``) then executes the instructions. A mixin of
:class:`~ds_terapipe.runtime.execution.engine.TokenPipelineEngine` rather than free functions, because DeepSpeed
asks the engine itself for its schedules and the rest of the runtime reads the plan from the engine
(``runtime/execution/stage.py``).
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any, Iterator, Optional

import torch

from ...planner.lowering import lower
from ...planner.schedule import Schedule
from ..planning.plan import ResolvedPlan, plan_for_length
from ..planning.slice_check import check_stage_slicing
from .batch_loading import _first_tensor, put_back
from .collective import mark_collective
from .schedule import TokenPipeSchedule

__all__ = ["PlanSelection"]

# the engine's logger: these records are the engine's, under the name its users filter on
logger = logging.getLogger(f"{__package__}.engine")

# Slots of the per-batch sequence-length agreement that are not lengths.
_UNSET, _BAD_SIZE, _BAD_IDS, _BAD_DOCUMENTS, _NO_SEQ_DIM, _EXHAUSTED, _NOT_READING = -100, -6, -5, -4, -3, -2, -1
# What the ranks that did not read it say of a batch a reading stage refused, in the order they are checked.
_REFUSED_BY_A_READER = (
    (_BAD_DOCUMENTS, "(a first stage) refused the position ids of the next batch"),
    (_BAD_SIZE, "refused a micro-batch of the next batch with another number of sequences than "
                "train_micro_batch_size_per_gpu"),
    (_BAD_IDS, "refused the token ids or labels of the next batch"))


class PlanSelection:
    """Which plan and schedule each step runs: a mixin of ``TokenPipelineEngine`` (see the module docstring)."""

    #: Per micro-batch, the slicing of the running step (None before the first step: ``slices`` for all).
    step_slices: Optional[tuple[tuple[int, ...], ...]] = None
    _last_mixed: Optional[list[int]] = None

    # -- plan ------------------------------------------------------------------------------------------------
    @property
    def slices(self) -> tuple[int, ...]:
        """Token counts of the plan in use (summing to the current batches' sequence length)."""
        return self.plan.slices

    @property
    def slicing_plan(self) -> Any:
        """The planner's :class:`~ds_terapipe.planner.slicing.SlicingPlan` when ``slices`` was ``"auto"``
        (predicted time, speedup), else None."""
        return self.plan.planner

    @property
    def predicted_step_ms(self) -> Optional[float]:
        """The planner's predicted step time of the plan in use (after freezes and repacks: the latest re-plan's),
        or None when the slices came from the config."""
        freezer = getattr(self, "freezer", None)
        latest = freezer.predicted_ms() if freezer is not None else None
        if latest is not None:
            return latest
        return self.slicing_plan.predicted_ms if self.slicing_plan is not None else None

    @property
    def plan_source(self) -> str:
        """Where the plan in use came from: "config", "profiled", "cache", "planned", "replanned" or
        "checkpoint" (:class:`~ds_terapipe.runtime.planning.plan.ResolvedPlan`)."""
        return self.plan.source

    @property
    def seq_len(self) -> int:
        return self.plan.seq_len

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def slices_of(self, microbatch: int) -> tuple[int, ...]:
        """The slicing micro-batch ``microbatch`` of the running step runs (each micro-batch its own length's
        plan when their lengths differ; ``slices`` otherwise)."""
        step = self.step_slices
        return step[microbatch] if step is not None and microbatch < len(step) else self.slices

    def seq_len_of(self, microbatch: int) -> int:
        return sum(self.slices_of(microbatch))

    def slice_bounds(self, slice_index: int, microbatch: Optional[int] = None) -> tuple[int, int]:
        slices = self.slices if microbatch is None else self.slices_of(microbatch)
        start = sum(slices[:slice_index])
        return start, start + slices[slice_index]

    def token_bounds(self, slice_index: int, microbatch: Optional[int] = None) -> tuple[int, int]:
        """This rank's tokens of the slice: all of them, or its share under sequence parallelism."""
        start, end = self.slice_bounds(slice_index, microbatch)
        return (start, end) if self.sequence is None else self.sequence.bounds(start, end)

    @property
    def uniform_step(self) -> bool:
        """Whether every micro-batch of the running step runs ``slices`` (what the re-planner can measure)."""
        return self.step_slices is None or all(s == self.slices for s in self.step_slices)

    def _slice_counts(self, micro_batches: int) -> Optional[tuple[int, ...]]:
        """Per micro-batch slice counts for the step's schedule, None when they are all ``num_slices``."""
        if self.uniform_step or self.step_slices is None or len(self.step_slices) != micro_batches:
            return None
        return tuple(len(s) for s in self.step_slices)

    def _check_model_supports_slicing(self) -> None:
        """Refused on every rank together: the module's ``loss_fn`` is the same on every rank (a constructor
        argument), so each rank checks it itself; only the last stage uses it, but a refusal there alone would
        leave the others in the collectives that follow init."""
        if self.num_slices == 1:
            return
        if self.module.loss_fn is None:
            raise mark_collective(ValueError(
                "terapipe: the PipelineModule needs a loss_fn with more than one slice, so the engine can weight "
                "each slice's loss; pass loss_fn= to the PipelineModule"))

    # -- variable sequence lengths ---------------------------------------------------------------------------
    def _use_plan_for_next_batch(self, iterator: Optional[Iterator], train: bool = False,
                                 count: Optional[int] = None) -> Optional[Iterator]:
        """Look at the sequence lengths of the step's micro-batches and switch to their plans (collective over
        all ranks).

        The first and last stages read ahead the ``count`` micro-batches the step will run (default: the
        gradient accumulation steps) and all ranks gather everyone's lengths, so a new length is planned once by
        all ranks together, a length that cannot be run fails on every rank at once instead of hanging the
        others, and micro-batches of different lengths each run their own length's slicing (``step_slices``; the
        schedule drops the units a shorter micro-batch does not have: planner/lowering.py). With
        ``terapipe.plan_per_batch`` a training step's micro-batches of the first one's length run the slicing
        planned for their documents (runtime/planning/batch_plan.py).
        Returns the iterator with the peeked micro-batches put back in front.
        """
        count = count or self.micro_batches
        local, batch, refused = [_NOT_READING] * count, None, None
        per_batch = train and self.batch_planner is not None
        peeked: list[Any] = []
        if self.is_first_stage() or self.is_last_stage():
            for _ in range(count):
                try:
                    peeked.append(next(iterator))
                except StopIteration:
                    break
            local = [_EXHAUSTED] * count
            for index, item in enumerate(peeked):
                first = _first_tensor(item[0] if self.is_first_stage() else item[1])
                local[index] = first.shape[1] if first is not None and first.dim() >= 2 else _NO_SEQ_DIM
                problem = self._documents_problem(item[0]) if self.is_first_stage() else None
                size = self._batch_size_problem(first, index)
                if size is not None:   # found here, not as the micro-batch loads mid-step: a sharded or sequence-
                    refused, local[index] = refused or size, _BAD_SIZE   # parallel peer would wait in a collective
                elif problem is not None:
                    refused, local[index] = refused or problem, _BAD_DOCUMENTS
                else:
                    problem = self._token_ids_problem(item)
                    if problem is not None:
                        refused, local[index] = refused or problem, _BAD_IDS
            batch = peeked[0] if peeked else None
            for item in reversed(peeked):   # put back last first: they come out in their order
                iterator = put_back(item, iterator)
        world = torch.distributed.get_world_size()
        lengths = torch.full((world, count), _UNSET, dtype=torch.int64, device=self.device)
        lengths[self.global_rank] = torch.tensor(local, dtype=torch.int64)  # own row; MAX merges the rows
        work = torch.distributed.all_reduce(lengths, op=torch.distributed.ReduceOp.MAX, async_op=True)
        self.p2p.wait(work, "the sequence-length agreement at the start of a batch")
        rows = lengths.tolist()
        values = [v for row in rows for v in row]
        # Every rank sees every pipeline's first and last stage, so every rank reaches the same verdict.
        if _EXHAUSTED in values:
            raise mark_collective(StopIteration(f"token pipeline: a data iterator ran out at the start of a batch "
                                                f"(it had fewer than the {count} micro-batches of the step)"))
        for marker, what in _REFUSED_BY_A_READER:   # the reading stage's message on it, a pointer to it on the others
            if marker in values:
                origin = next(r for r, row in enumerate(rows) if marker in row)
                raise mark_collective(ValueError(refused if refused is not None else
                                                 f"token pipeline: rank {origin} {what}; its error says why"))
        if _NO_SEQ_DIM in values:
            raise mark_collective(ValueError("token pipeline: batch inputs/labels must be (batch, seq_len, ...) "
                                             "tensors; a stage got a tensor without a sequence dimension"))
        replicas = range(self.grid.data_parallel_size)
        stage0 = [rows[self.grid.stage_to_global(0, data=d)] for d in replicas]
        last = [rows[self.grid.stage_to_global(self.placement[-1], data=d)] for d in replicas]
        if stage0 != last:
            raise mark_collective(ValueError(f"token pipeline: first-stage inputs have lengths {stage0} but last-stage "
                                             f"labels {last} (per data-parallel replica, per micro-batch); both "
                                             "stages must read the same batches"))
        mine = rows[self.grid.stage_to_global(0)]
        for length in sorted({n for row in stage0 for n in row}):
            if length not in self.plans:
                latest = next(reversed(self.plans.values()))  # carries the costs known so far
                resolved = plan_for_length(self, latest, length)
                self.plans[length] = resolved
                if self.global_rank == 0:
                    logger.info("terapipe: sequence length %d -> %d slice(s) %s", length, len(resolved.slices),
                                list(resolved.slices))
        self.plan = self.plans[mine[0]]
        planned = None
        if per_batch:   # one length on every rank (replica 0's first): the replicas' profiles have one size
            length = stage0[0][0]
            context = None
            if self.is_first_stage():
                context = self.batch_planner.local_context([b[0] for b in peeked], length)
            planned = self.batch_planner.plan_step(self, self.plans[length], context)
            self.plan = planned if length == mine[0] else self.plan
        self.step_slices = tuple(planned.slices if planned is not None and n == planned.seq_len
                                 else self.plans[n].slices for n in mine)
        if len(set(mine)) > 1 and self.global_rank == 0 and mine != self._last_mixed:
            logger.debug("terapipe: a step of micro-batches of lengths %s", mine)
            self._last_mixed = mine
        first_input = batch[0] if self.is_first_stage() and batch is not None else None
        if self.terapipe.packed and isinstance(first_input, (tuple, list)):
            first_input = first_input[0]  # the ids: the check probes causality, documents aside
        self._check_slicing_on_batch({row[0] for row in stage0}, first_input)
        return iterator

    def _check_slicing_on_batch(self, lengths: set[int], first_input: Any) -> None:
        """The slice check on a real batch, for a model that cannot sample an input (collective: every rank
        decides from the same lengths). Before the first step of each sequence length that is sliced; the rank
        holding the first chunk probes with the batch's inputs (``first_input``)."""
        module = self.module
        if (hasattr(module, "has_sampler") and module.has_sampler()) or lengths <= self._checked_on_batch:
            return
        if all(len(self.plans[length].slices) == 1 for length in lengths):
            return
        with self.sharded.whole() if self.sharded is not None else nullcontext():   # runs the layers unscheduled
            check_stage_slicing(self, self.plan.seq_len, self.plan.slices, first_input, on_batch=True)
        self._checked_on_batch |= lengths

    def install_plan(self, plan: ResolvedPlan) -> None:
        """Run ``plan`` for its sequence length from the next batch on (collective: every rank installs the same
        plan at the same step, as the re-planner does). The newest plan's costs plan lengths seen later."""
        self.plans.pop(plan.seq_len, None)
        self.plans[plan.seq_len] = plan
        if plan.seq_len == self.plan.seq_len:
            self.plan = plan

    # -- the schedules a step runs ---------------------------------------------------------------------------
    def lowered_schedule(self, num_slices: int, num_frozen_chunks: Optional[int] = None,
                         train: bool = True) -> Schedule:
        """This run's executed schedule for ``num_slices`` slices (every rank's streams; planner/lowering.py),
        with the frozen chunks now in effect unless ``num_frozen_chunks`` says otherwise: what the re-planner
        and the freezer simulate."""
        cfg = self.terapipe
        frozen = self._frozen_chunks() if num_frozen_chunks is None else num_frozen_chunks
        return lower(cfg.schedule, self.num_stages, self.micro_batches, num_slices, train=train,
                     deferred_weight_grads=cfg.deferred_weight_grads, virtual_stages=cfg.virtual_stages,
                     num_frozen_chunks=frozen, vocab_parallel=cfg.vocab_parallel,
                     vocab_embedding=self._vocab_embedding, **self._shard_kwargs)

    def _train_schedule(self) -> TokenPipeSchedule:
        counts = self._slice_counts(self.micro_batches)
        return TokenPipeSchedule(self.terapipe.schedule, self.micro_batches, self.num_stages, self.stage_id,
                                 max(counts) if counts else self.num_slices, train=True,
                                 deferred_weight_grads=self.terapipe.deferred_weight_grads,
                                 virtual_stages=self.terapipe.virtual_stages, num_frozen_chunks=self._frozen_chunks(),
                                 vocab_parallel=self.terapipe.vocab_parallel, vocab_embedding=self._vocab_embedding,
                                 slice_counts=counts, **self._shard_kwargs)

    def _inference_schedule(self, micro_batches: int) -> TokenPipeSchedule:
        counts = self._slice_counts(micro_batches)
        return TokenPipeSchedule(self.terapipe.schedule, micro_batches, self.num_stages, self.stage_id,
                                 max(counts) if counts else self.num_slices, train=False,
                                 virtual_stages=self.terapipe.virtual_stages,
                                 vocab_parallel=self.terapipe.vocab_parallel, vocab_embedding=self._vocab_embedding,
                                 slice_counts=counts, **self._shard_kwargs)

    @property
    def _shard_kwargs(self) -> dict[str, Any]:
        cfg = self.terapipe
        return {"shard_params": cfg.shard_params, "shard_prefetch": cfg.shard_prefetch,
                "shard_release": cfg.shard_release}

    @property
    def _vocab_embedding(self) -> bool:
        """Whether the tied input embedding is split with the head (the schedule has EF/EB)."""
        return getattr(self, "_vocab", None) is not None and self._vocab.embedding is not None

    def plan_summary(self) -> dict[str, Any]:
        """What this engine runs, for logs and checkpoints."""
        summary: dict[str, Any] = {"slices": list(self.slices), "seq_len": self.seq_len,
                                   "schedule": self.terapipe.schedule, "num_stages": self.num_stages,
                                   "virtual_stages": self.terapipe.virtual_stages,
                                   "micro_batches": self.micro_batches, "micro_batch_size": self.micro_batch_size}
        if self.slicing_plan is not None:
            summary["planner"] = self.slicing_plan.to_dict()
        return summary

"""TokenPipelineEngine: DeepSpeed's PipelineEngine, running token slices instead of whole micro-batches.

How one training step flows (``train_batch``), on every stage:

1. :class:`~ds_terapipe.runtime.execution.schedule.TokenPipeSchedule` yields DeepSpeed instructions for this stage's
   actions of the planner schedule; each carries ``microbatch`` and ``slice_index``.
2. ``LoadMicroBatch`` (first/last stage, before a micro-batch's slice 0) reads the whole micro-batch once.
   ``ForwardPass`` cuts the slice's tokens out of it (first stage: inputs; last stage: labels) or takes the
   activations received from the previous stage, opens the slice context (token offset, the micro-batch's
   KV buffers) and runs DeepSpeed's own forward. The last stage's loss is weighted by the slice's share of the
   tokens, so the per-slice losses add up to the unsliced loss.
3. ``BackwardPass`` runs DeepSpeed's own backward of that one slice. Backwards go later slices first within a
   micro-batch; attention routes the gradients of earlier slices' keys/values into the KV gradient buffers
   (:mod:`ds_terapipe.runtime.slicing.attention`), where those slices' backwards pick them up. With
   ``deferred_weight_grads``, ``nn.Linear`` weight gradients wait for ``WeightGradPass`` after the
   micro-batch's last backward (:mod:`ds_terapipe.runtime.slicing.deferred`).
4. Gradient reduction across data-parallel replicas, tied weights and the optimizer step are DeepSpeed's.

Transfers go through :class:`~ds_terapipe.runtime.execution.p2p.SliceP2P` (per-transfer shapes, non-blocking sends,
deadlines), because slices have different lengths.

Virtual stages (``terapipe.virtual_stages`` v > 1, a :class:`~ds_terapipe.runtime.execution.module.TokenPipelineModule`
built with the same v and schedule): a rank holds several chunks, and every instruction names the chunk it runs
on. While an instruction runs, its chunk is *active* (``on_chunk``): the module's forward is that chunk's layers,
and ``is_first_stage()``/``is_last_stage()`` answer for the chunk (chunk 0 / the last chunk), so DeepSpeed's own
forward and backward compute the loss exactly where the last chunk runs (under the V placement: rank 0). Between
instructions they answer for the rank (holds chunk 0 / the last chunk: loads inputs / labels, owns the loss). KV
buffers, slice buffers and deferred weight gradients are per (chunk, micro-batch). A hand-off between two chunks
of one rank is no message: the forward of chunk c leaves its outputs, detached, as the inputs of chunk c + 1, and
the backward of chunk c + 1 leaves their gradients for chunk c (DeepSpeed's DualPipeV turn-around, generalised).

Failing fast: an exception on any rank inside ``train_batch``, ``eval_batch``, engine init or checkpointing
raises the job's abort flag (:class:`~ds_terapipe.runtime.execution.p2p.AbortFlag`, on the process group's store) with
this rank and its error, and every other rank's waits turn it into a ``PeerFailedError`` naming both within
about a second. Errors that every rank raises together (a collective verdict) do not raise the flag. So that
no rank sits in one of DeepSpeed's own blocking collectives (tied and data-parallel gradient reduction, the
loss broadcast) while a peer fails behind it, the end of every schedule is one abort-aware all-reduce.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import os
import time
from collections import defaultdict, deque
from contextlib import contextmanager, nullcontext
from types import MethodType
from typing import Any, Iterator, Optional

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.config import DeepSpeedConfig, get_wall_clock_breakdown
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from ...config import TeraPipeConfig
from ...planner.lowering import lower
from ...planner.registry import get_schedule
from ...planner.schedule import Action, Schedule, ScheduleError
from ...planner.simulate import TimedAction
from ...trace import events_to_chrome_trace
from ..features.freeze import Freezer
from ..features.partition import check_replicated_only
from ..features.recompute import install_sliced_checkpointing
from ..features.sharding import ShardedChunks, sharding_problem
from ..features.vocab import VocabParallel
from ..planning.batch_plan import BatchPlanner
from ..planning.plan import ResolvedPlan, plan_for_length, resolve_plan, restore_checkpoint_plan
from ..planning.replan import Replanner
from ..planning.slice_check import check_stage_slicing
from ..slicing.context import MicroBatchState, SliceContext, cut_tokens, slice_scope
from ..slicing.deferred import (WeightGradAccumulator, WeightGradStash, enable_deferred_weight_grads,
                                enable_fused_grad_accumulation, fused_parameters)
from ..slicing.devices import synchronized_ms
from ..slicing.documents import Documents, check_position_ids, positions_of
from ..slicing.sequence import SequenceShare
from . import checkpoint as ckpt
from .batch_checks import IGNORE_INDEX, out_of_range_ids
from .bf16_grads import FlatBf16Grads, count_norm_once_per_sequence_group
from .clip import clip_by_global_norm, clipping_problem
from .collective import agree_or_raise, mark_collective
from .ds_internals import check_deepspeed_internals
from .grad_sink import GradSink
from .loss_scale import reports_scaled_norm, scale_moved_after_step
from .module import chunk_layout, loss_fn_problem, loss_fn_replaced
from .optimizer_init import undo_construction_step
from .p2p import AbortFlag, PeerFailedError, SliceP2P, as_tuple
from .schedule import DISPATCH, TokenPipeSchedule

__all__ = ["TokenPipelineEngine"]

logger = logging.getLogger(__name__)


def _unusable_directory(path: str, writes: bool) -> Optional[str]:
    """Why ``path`` cannot serve as a directory this rank uses (created if missing; ``writes``: also writable), as
    the end of a sentence naming it, or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        return f"cannot be created ({type(err).__name__}: {err.strerror or err})"
    return "is not writable" if writes and not os.access(path, os.W_OK) else None


def _set_scheduled_lr(scheduler: Any) -> None:
    """The learning rate a just-loaded lr scheduler stands at, written into its optimizer's param groups.

    Why: a scheduler's ``load_state_dict`` restores its counters only, and DeepSpeed steps it after the optimizer:
    with a fresh optimizer (a load without its state) the next step would run at the lr the scheduler set at init
    (DeepSpeed's warm-up minimum, or a torch scheduler's base lr) instead of the checkpoint's. torch's schedulers
    keep the last lr they set (``get_last_lr``); DeepSpeed's compute it from their step (``get_lr``)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        lrs = scheduler.get_last_lr()
    else:
        lrs = scheduler.get_lr()
    groups = scheduler.optimizer.param_groups
    if len(lrs) != len(groups):
        raise ValueError(f"the scheduler has {len(lrs)} learning rates for {len(groups)} param groups")
    for group, lr in zip(groups, lrs):
        group["lr"] = lr


def _wall_clock_problem(config: DeepSpeedConfig) -> Optional[str]:
    """Why DeepSpeed's wall-clock timers cannot run in this pipeline (rule, value, fix), or None.

    Why: DeepSpeed 0.19.8's PipelineEngine starts its backward timers around a stage's backward, and its engine's
    backward hook starts the same timers again inside it: an AssertionError at the first backward of every stage
    but the last, in DeepSpeed's own pipeline too. ``flops_profiler.enabled`` turns the timers on as well."""
    if not config.wall_clock_breakdown:
        return None
    flops = bool(config.flops_profiler_config.enabled)
    keys = [key for key, on in (("wall_clock_breakdown", get_wall_clock_breakdown(config._param_dict)),
                                ("flops_profiler.enabled", flops)) if on]
    return (f"terapipe: {' and '.join(f'{key}=true' for key in keys)} is not supported: it turns on DeepSpeed's "
            "wall-clock timers, which its pipeline starts twice on every stage but the last (AssertionError "
            "'bwd_microstep timer has already been started' at the first step, in DeepSpeed's own PipelineEngine "
            f"too); set {' and '.join(f'{key} to false' for key in keys)}, and terapipe.trace_dir for a timeline of "
            "every forward, backward and transfer per rank")


class _PutBack:
    """An iterator with items put back in front of another iterator (see :func:`put_back`)."""

    def __init__(self, rest: Iterator) -> None:
        self.pending: list[Any] = []
        self.rest = rest

    def __iter__(self) -> "_PutBack":
        return self

    def __next__(self) -> Any:
        return self.pending.pop() if self.pending else next(self.rest)


def put_back(item: Any, iterator: Iterator) -> Iterator:
    """``iterator`` with ``item`` in front. Putting back into an iterator this returned reuses it: the engine's
    stored data iterator is peeked and put back every step, and a new ``itertools.chain`` around the last one
    each time nests one level deeper per step (each read walks every level; CPython crashes past ~200k steps)."""
    if not isinstance(iterator, _PutBack):
        iterator = _PutBack(iterator)
    iterator.pending.append(item)
    return iterator


def _first_tensor(value: Any) -> Optional[torch.Tensor]:
    if torch.is_tensor(value):
        return value
    if isinstance(value, (tuple, list)) and value:
        return _first_tensor(value[0])
    return None


# eval_batch's parameters, as DeepSpeed's PipelineEngine takes them (bound to read compute_loss, num_micro_batches)
_EVAL_SIGNATURE = inspect.signature(PipelineEngine.eval_batch)

# Slots of the per-batch sequence-length agreement that are not lengths.
_UNSET, _BAD_IDS, _BAD_DOCUMENTS, _NO_SEQ_DIM, _EXHAUSTED, _NOT_READING = -100, -5, -4, -3, -2, -1

# The active chunk while DeepSpeed's PipelineEngine.__init__ runs: stage roles are the rank's topological ones
# then (its p2p warm-up pairs stage s with s + 1), as DeepSpeed's DualPipeVEngine does.
_INIT = object()

# Engines numbered in creation order, the same on every rank (creation is collective): each gets its own
# abort flag, so an engine built after a failure starts clean.
_ENGINE_SERIAL = itertools.count()

#: The instructions whose spans the timeline records, as the action kinds they run (DISPATCH, schedule.py).
_TIMED = {d.instruction: kind for kind, d in DISPATCH.items() if d.timed}
#: The instructions after the schedule, timed with the timeline under the names of the step model's terms
#: (``planner/step_cost.py``): what re-planning refits the whole-step part of the cost model from.
_TAIL = {ds_schedule.ReduceTiedGrads: "tied_reduce", ds_schedule.ReduceGrads: "grad_reduce",
         ds_schedule.OptimizerStep: "optimizer"}


class TokenPipelineEngine(PipelineEngine):
    """A DeepSpeed ``PipelineEngine`` that pipelines token slices of each micro-batch (TeraPipe).

    Created by :func:`ds_terapipe.initialize` when the DeepSpeed config has ``"terapipe": {"enabled": true}``.
    ``train_batch()``, ``eval_batch()`` and checkpointing work as with DeepSpeed's engine.

    Attributes:
        plan: the :class:`~ds_terapipe.runtime.planning.plan.ResolvedPlan` in use (for the current batches' sequence
            length); ``slices``, ``slicing_plan`` and ``plan_source`` read it.
    """

    #: Per micro-batch, the slicing of the running step (None before the first step: ``slices`` for all).
    step_slices: Optional[tuple[tuple[int, ...], ...]] = None
    _last_mixed: Optional[list[int]] = None

    @classmethod
    def build(cls, model: Any, ds_config: dict, terapipe: TeraPipeConfig, **kwargs: Any) -> "TokenPipelineEngine":
        """An engine built the way ``deepspeed.initialize`` builds its ``PipelineEngine`` (process group up;
        collective): what ``ds_terapipe.initialize`` runs, and how a repack builds the engine of its new layout."""
        pipe_mpu = model.mpu()
        if terapipe.sequence_parallel > 1:
            # the sequence ranks are DeepSpeed's model axis, whose activation partitioning (Megatron's tensor
            # parallelism) does not apply: every sequence rank sends its own share
            pipeline = dict(ds_config.get("pipeline") or {})
            pipeline.setdefault("pipe_partitioned", False)
            pipeline.setdefault("grad_partitioned", False)
            ds_config = dict(ds_config, pipeline=pipeline)
        bf16_shards = bool(terapipe.shard_params and (ds_config.get("bf16") or {}).get("enabled"))
        if bf16_shards:
            # bf16 compute over fp32 shards is FSDP2's mixed precision: DeepSpeed builds an fp32 engine (its bf16
            # optimizer keeps flat fp32 copies of whole parameters, which shards replace)
            ds_config = dict(ds_config, bf16=dict(ds_config["bf16"], enabled=False))
        config_class = DeepSpeedConfig(ds_config, pipe_mpu)
        problem = sharding_problem(config_class) if terapipe.shard_params else None
        if problem:
            raise ValueError(problem)
        stage = config_class.zero_optimization_stage
        if stage >= 2:
            raise ValueError(f"terapipe: zero_optimization.stage={stage} is not supported with pipeline parallelism "
                             "(DeepSpeed partitions gradients across a pipeline it does not own); use stage 0 or 1")
        deepspeed.set_optimizer_flags(config_class, model)
        engine = cls(model=model, mpu=pipe_mpu, config=ds_config, config_class=config_class, terapipe_config=terapipe,
                     bf16_shards=bf16_shards, **kwargs)
        engine._configure_python_gc()
        return engine

    def __init__(self, *args, terapipe_config: TeraPipeConfig, preset_plan: Optional[ResolvedPlan] = None,
                 bf16_shards: bool = False, **kwargs) -> None:
        self.terapipe = terapipe_config
        # terapipe.shard_params (runtime/features/sharding.py): the chunks' FSDP2 shards, made last in init
        self.sharded: Optional[ShardedChunks] = None
        self.terapipe_bf16 = bf16_shards  # bf16 compute over fp32 shards (DeepSpeed's engine itself is fp32)
        self.preset_plan = preset_plan  # a repack's plan for the layers it moved (runtime/features/repack.py)
        self.repack_share: Any = None   # after a repack: this replica's share of each step's micro-batches
        self._chunk: Any = _INIT
        super().__init__(*args, **kwargs)
        self._chunk = None  # the chunk an instruction runs on, while it runs (see on_chunk)
        check_deepspeed_internals(self)  # a DeepSpeed that moved what we rely on fails here, naming it
        undo_construction_step(self.optimizer)   # fp16 at ZeRO 0: the step DeepSpeed took on zero gradients
        VocabParallel.check_engine(self)
        problem = clipping_problem(self)  # a clipping DeepSpeed's optimizer would get wrong (runtime/execution/clip.py)
        problem = problem or loss_fn_problem(self.module)   # trained loss parameters no checkpoint would hold
        if problem:
            raise ValueError(problem)
        problem = _wall_clock_problem(self._config)
        if problem:
            raise ValueError(problem)
        if self.is_pipe_partitioned or self.is_grad_partitioned:
            raise ValueError("terapipe: pipeline.pipe_partitioned / grad_partitioned are not supported by the "
                             "token pipeline; set both to false in the DeepSpeed config")
        # chunk -> rank, and this rank's chunks (one chunk per rank: (0, ..., p-1) and (stage_id, ))
        self.placement, self.local_chunks = self._check_chunk_layout()
        self.num_chunks = len(self.placement)
        self.p2p = SliceP2P([self.grid.stage_to_global(s) for s in range(self.num_stages)], self.device,
                             self.terapipe.p2p_timeout_s,
                             abort=AbortFlag.on_default_group(f"ds_terapipe/abort/{next(_ENGINE_SERIAL)}"))
        self._states: dict[tuple[int, int], MicroBatchState] = {}  # (chunk, micro-batch) ->
        self.loaded: dict[int, Any] = {}
        # Packed rows (terapipe.packed): each micro-batch's documents on this rank (runtime/slicing/documents.py)
        self.documents: dict[int, Documents] = {}
        # sequence parallelism (runtime/slicing/sequence.py): this rank's share of every slice, else None
        self.sequence = self._sequence_share()
        self.unit_losses: dict[int, torch.Tensor] = {}
        self._unit_grads: dict[int, Any] = {}
        self._logits: list[torch.Tensor] = []
        self._trail: deque[str] = deque(maxlen=8)
        # Activation shapes per (sending chunk, seq_len, slice_len) already exchanged: a header once per boundary.
        self._shapes_sent: set[tuple[int, int, int]] = set()
        self._shapes_known: dict[tuple[int, int, int], list[tuple[tuple[int, ...], torch.dtype]]] = {}
        # Measured timeline of the last batch: compute actions with host-clock start/end (ms since the epoch).
        self.record_timeline = self.terapipe.trace_dir is not None
        self.last_timeline: list[TimedAction] = []
        # With the timeline, the last training step's whole-step terms on this rank (ms): "step" (train_batch),
        # "loop" (the instruction loop), and the tail instructions' spans (_TAIL); runtime/planning/replan.py refits
        # from them.
        self.last_step_terms: dict[str, float] = {}
        self._batches_traced = 0
        # Deferred weight gradients: per (chunk, micro-batch), the (input, output-gradient) pairs until its W.
        self._stashes: dict[tuple[int, int], WeightGradStash] = {}
        self._weight_grads = WeightGradAccumulator()   # the step's W passes, summed; to .grad before reductions
        # Vocabulary parallelism: the output layer's shard on this rank and its passes (runtime/features/vocab.py).
        # Gradients computed by hand (vocabulary passes, freezing's zero gradients) go where the optimizer reads them
        self.grad_sink = GradSink(self)
        self._vocab = VocabParallel(self) if self.terapipe.vocab_parallel else None
        self._dp_identity_by_config = self._dp_reduce_identity_by_config()
        with self._failing_fast("engine init"):
            agree_or_raise(self._directories_problem(), ValueError, self.p2p, "the check of terapipe's directories")
            check_replicated_only(self)  # bf16: a stage of tied copies only cannot step (features/partition.py)
            if self.terapipe.deferred_weight_grads:  # before profiling, which measures the split backward
                count = enable_deferred_weight_grads(self.module)
                logger.info("terapipe: stage %d defers the weight gradients of %d nn.Linear module(s)",
                            self.stage_id, count)
            self.fused_grad_accumulation = self._fuse_grad_accumulation()   # before profiling too: it times it
            install_sliced_checkpointing(self.module, self.terapipe)  # before profiling: it times the recompute
            self.plan: ResolvedPlan = resolve_plan(self)
            # One plan per sequence length seen, planned once (variable-length training), in the order resolved.
            self.plans: dict[int, ResolvedPlan] = {self.plan.seq_len: self.plan}
            # Without an input sampler init could not probe the slice check: each length is checked on its first
            # batch instead (_check_slicing_on_batch); the lengths done so far
            self._checked_on_batch: set[int] = set()
            self._check_model_supports_slicing()
            self._train_schedule()  # a micro-batch count the schedule cannot run fails here, on every rank
            self.replanner = Replanner(self) if self.terapipe.replan.enabled else None
            self.freezer = Freezer(self) if self.terapipe.freeze is not None else None
            # Packed rows planned per step (terapipe.plan_per_batch: runtime/planning/batch_plan.py)
            self.batch_planner = BatchPlanner(self) if self.terapipe.plan_per_batch else None
            if self.terapipe.shard_params:   # last: profiling and the slice check ran on whole parameters
                self.sharded = ShardedChunks(self)
                self.sharded.wrap_optimizer_state()

    def _directories_problem(self) -> Optional[str]:
        """Why a directory the config names cannot be used (rule, value, fix), or None: ``trace_dir`` (every rank
        writes its trace there after a batch) must be writable; ``plan_cache`` (rank 0 reads plans there and writes
        new ones) must exist or be creatable: a read-only cache of plans made elsewhere is used, and a plan that
        cannot be stored there is logged and skipped (``runtime/planning/plan_cache.py``). Checked at init, so a
        typo fails before profiling and training, not after the first batch or the plan."""
        wanted = [("trace_dir", self.terapipe.trace_dir, True)]
        if self.global_rank == 0:
            wanted.append(("plan_cache", self.terapipe.plan_cache, False))
        for key, path, writes in wanted:
            why = None if path is None else _unusable_directory(path, writes)
            if why is not None:
                return (f"terapipe.{key}={path!r} {why} on global rank {self.global_rank}; point it at a writable "
                        "directory, or drop the key")
        return None

    def _check_chunk_layout(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The module's chunk placement, refused (on every rank: same config, same model) unless it is the one
        the configured schedule and ``virtual_stages`` place."""
        name, v = self.terapipe.schedule, self.terapipe.virtual_stages
        expected = tuple(get_schedule(name).placement(self.num_stages, v))
        placement, chunks = chunk_layout(self.module)
        if placement != expected:
            built_v = getattr(self.module, "virtual_stages", 1)
            raise ValueError(f"terapipe: schedule {name!r} with virtual_stages={v} places chunks on ranks as "
                             f"{list(expected)} (chunk -> rank), but the model was built with virtual_stages="
                             f"{built_v} ({list(placement)}); build it as ds_terapipe.TokenPipelineModule(..., "
                             f"num_stages={self.num_stages}, virtual_stages={v}, schedule={name!r})")
        return placement, chunks

    # -- chunks and stage roles ------------------------------------------------------------------------------
    def is_first_stage(self) -> bool:
        """While a chunk runs: whether it is chunk 0 (reads the inputs). Otherwise: whether this rank holds it."""
        if self._chunk is _INIT:
            return super().is_first_stage()
        if self._chunk is None:
            return self.placement[0] == self.stage_id
        return self._chunk == 0

    def is_last_stage(self) -> bool:
        """While a chunk runs: whether it is the last chunk (computes the loss). Otherwise: whether this rank holds
        it (reads labels, owns the loss DeepSpeed aggregates and broadcasts)."""
        if self._chunk is _INIT:
            return super().is_last_stage()
        if self._chunk is None:
            return self.placement[-1] == self.stage_id
        return self._chunk == self.num_chunks - 1

    def _loss_stage_global_rank(self) -> int:
        return self.last_chunk_global_rank()

    def last_chunk_global_rank(self) -> int:
        """The global rank holding the last chunk (where the loss is computed)."""
        return self.grid.stage_to_global(self.placement[-1])

    @contextmanager
    def on_chunk(self, chunk: int) -> Iterator[None]:
        """Run a block as chunk ``chunk``: its layers are the module's forward, stage roles are the chunk's."""
        self._chunk = chunk
        if len(self.local_chunks) > 1:
            self.module.activate_chunk(self.local_chunks.index(chunk))
        if self.sharded is not None:
            self.sharded.ready(chunk)
        try:
            yield
        finally:
            self._chunk = None

    def _is_local(self, chunk: int) -> bool:
        return 0 <= chunk < self.num_chunks and self.placement[chunk] == self.stage_id

    # -- failing fast -----------------------------------------------------------------------------------------
    @contextmanager
    def _failing_fast(self, what: str) -> Iterator[None]:
        """Raise the job's abort flag when the block raises on this rank alone, so peers stop within seconds."""
        try:
            yield
        except Exception as err:
            if not isinstance(err, PeerFailedError) and not getattr(err, "terapipe_collective", False) and \
                    self.p2p.abort is not None:
                self.p2p.abort.set(self.global_rank, self.stage_id, what, f"{type(err).__name__}: {err}")
            raise

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
        if self.num_slices == 1:
            return
        if self.is_last_stage() and self.module.loss_fn is None:
            raise ValueError("terapipe: the PipelineModule needs a loss_fn with more than one slice, so the engine "
                             "can weight each slice's loss; pass loss_fn= to the PipelineModule")

    # -- variable sequence lengths ----------------------------------------------------------------------------
    def train_batch(self, data_iter: Optional[Iterator] = None) -> torch.Tensor:
        with self._failing_fast("train_batch"):
            if self.optimizer is None:   # the same on every rank: one config, the same initialize arguments
                raise mark_collective(ValueError(
                    "train_batch needs an optimizer, and this engine was built without one: the DeepSpeed config "
                    "has no \"optimizer\" section and ds_terapipe.initialize got no optimizer=. Add one of them "
                    "(e.g. \"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 3e-4}}), or call only "
                    "eval_batch on this engine."))
            # What the step costs as the caller sees it, from here (the data peek and the length agreement
            # included); not synchronised: device work the last step left queued is this step's wait
            entered = time.time() * 1e3
            source = data_iter if data_iter is not None else getattr(self, "data_iterator", None)
            if self.freezer is not None:
                self.freezer.before_step(self)  # a repack (runtime/features/repack.py) turns self into the new engine
            if self.repack_share is not None:   # this replica's share of the step's micro-batches
                data_iter = self.repack_share.take(self, source, self.micro_batches)
            if data_iter is not None:
                self.set_dataiterator(data_iter)
            peeked = self._use_plan_for_next_batch(self.data_iterator, train=True)
            if self.is_first_stage() or self.is_last_stage():
                self.data_iterator = peeked
            if self.replanner is not None:
                self.replanner.before_step(self)
            loss = super().train_batch()
            if self.record_timeline:
                self.last_step_terms["step"] = synchronized_ms() - entered
            if self.replanner is not None:
                self.replanner.after_step(self)
            return loss

    def eval_batch(self, data_iter: Iterator, *args: Any, **kwargs: Any) -> Any:
        with self._failing_fast("eval_batch"):
            bound = _EVAL_SIGNATURE.bind(self, data_iter, *args, **kwargs)
            bound.apply_defaults()
            self._check_eval_arguments(bound.arguments)
            count = bound.arguments["num_micro_batches"] or self.micro_batches
            if self.repack_share is not None:
                data_iter = self.repack_share.take(self, data_iter, count, "eval_batch")
            return super().eval_batch(self._use_plan_for_next_batch(data_iter, count=count), *args, **kwargs)

    def _check_eval_arguments(self, arguments: dict[str, Any]) -> None:
        """``eval_batch``'s arguments the token pipeline cannot honour, refused on every rank (the same arguments
        everywhere) before any batch is read: ``return_logits=True`` and ``compute_loss=False`` return the model's
        outputs, which no rank holds whole under vocabulary parallelism (each holds a vocabulary shard's logits) or
        sequence parallelism (a share of the tokens); a ``reduce_output`` other than 'avg' or None (DeepSpeed's
        last stage raises, alone); ``compute_loss=False`` with the monitor (rank 0 logs a loss it does not have);
        ``reduce_output=None`` with the loss broadcast (or the monitor, which broadcasts it too) hands DeepSpeed's
        scalar broadcast a list: the last stage raised and the others waited in the broadcast until the process
        group's timeout."""
        tp = self.terapipe
        split = [f"terapipe.{key}={value}" for key, value, on in (
            ("vocab_parallel", tp.vocab_parallel, tp.vocab_parallel),
            ("sequence_parallel", tp.sequence_parallel, tp.sequence_parallel > 1)) if on]
        for asked, what, fix in (
                (arguments["return_logits"], "eval_batch(return_logits=True) returns the last micro-batch's logits",
                 "call eval_batch with return_logits=False (the loss)"),
                (not arguments["compute_loss"], "eval_batch(compute_loss=False) returns the last stage's outputs",
                 "call eval_batch with compute_loss=True (the loss)")):
            if asked and split:
                raise mark_collective(ValueError(
                    f"token pipeline: {what}, but with {' and '.join(split)} no rank holds them whole (each holds "
                    f"a share); {fix}, or take the outputs from a model built without it"))
        reduce = arguments["reduce_output"]
        if reduce is not None and not (isinstance(reduce, str) and reduce.lower() == "avg"):
            raise mark_collective(ValueError(
                f"token pipeline: eval_batch(reduce_output={reduce!r}) is not supported: DeepSpeed's pipeline "
                "averages the micro-batches' losses or returns them as they are; pass reduce_output='avg' or None"))
        if not arguments["compute_loss"] and self.monitor.enabled:
            raise mark_collective(ValueError(
                "token pipeline: eval_batch(compute_loss=False) with the DeepSpeed monitor enabled: the monitor "
                "logs the evaluation loss from global rank 0, which holds no loss then (DeepSpeed's own fails "
                "there); call eval_batch with compute_loss=True, or disable the monitor"))
        if arguments["compute_loss"] and reduce is None and (
                arguments["bcast_loss"] or self.monitor.enabled):
            why, fix = (("the monitor (which broadcasts the loss)", "disable the DeepSpeed monitor for this call's "
                         "engine") if self.monitor.enabled else
                        ("bcast_loss=True", "pass bcast_loss=False (the other stages get None)"))
            raise mark_collective(ValueError(
                f"token pipeline: eval_batch(reduce_output=None) gives one loss per micro-batch on the last "
                f"stage, which {why} cannot send to the other stages (DeepSpeed broadcasts one scalar); "
                f"{fix}, or keep reduce_output='avg'"))

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
                if problem is not None:
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
        if _BAD_DOCUMENTS in values:   # the first stage's message on it, a pointer to it on the others
            origin = next(r for r, row in enumerate(rows) if _BAD_DOCUMENTS in row)
            raise mark_collective(ValueError(refused if refused is not None else
                                             f"token pipeline: rank {origin} (a first stage) refused the position "
                                             "ids of the next batch; its error says why"))
        if _BAD_IDS in values:   # the reading stage's message on it, a pointer to it on the others
            origin = next(r for r, row in enumerate(rows) if _BAD_IDS in row)
            raise mark_collective(ValueError(refused if refused is not None else
                                             f"token pipeline: rank {origin} refused the token ids or labels of "
                                             "the next batch; its error says why"))
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
        if per_batch:
            context = None
            if self.is_first_stage():
                context = self.batch_planner.local_context([b[0] for b in peeked], mine[0])
            self.plan = self.batch_planner.plan_step(self, self.plan, context)
        self.step_slices = tuple(self.plan.slices if n == mine[0] else self.plans[n].slices for n in mine)
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

    @property
    def _shard_kwargs(self) -> dict[str, Any]:
        cfg = self.terapipe
        return {"shard_params": cfg.shard_params, "shard_prefetch": cfg.shard_prefetch,
                "shard_release": cfg.shard_release}

    # -- frozen layers (runtime/features/freeze.py) ----------------------------------------------------------------
    def _frozen_chunks(self) -> int:
        """Leading chunks whose layers are all frozen: forward only, no gradient into them."""
        freezer = getattr(self, "freezer", None)
        return freezer.num_frozen_chunks if freezer is not None else 0

    def _chunk_frozen(self, chunk: int) -> bool:
        return 0 <= chunk < self._frozen_chunks()

    @contextmanager
    def _frozen_scope(self, chunk: int) -> Iterator[None]:
        """A frozen chunk's forward keeps no graph (and so drops its buffers as an inference forward does)."""
        if self._chunk_frozen(chunk):
            with torch.no_grad():
                yield
        else:
            yield

    def _exec_optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        self._hand_over_weight_grads()
        if getattr(self, "freezer", None) is not None:
            self.freezer.observe_gradients(self)
            self.freezer.before_optimizer_step(self)
        super()._exec_optimizer_step(*args, **kwargs)
        if getattr(self, "freezer", None) is not None:   # the auto policy's check, unless DeepSpeed skipped the step
            self.freezer.after_optimizer_step(self)

    def _take_model_step(self, *args: Any, **kwargs: Any) -> None:
        """DeepSpeed's step, with the fp16 scale moved once the step has divided the gradients by it and before
        DeepSpeed's ``_exec_optimizer_step`` logs it (the monitor's ``loss_scale`` is the next step's, as in
        DeepSpeed)."""
        scale = self._loss_scale_deepspeed_leaves_out()   # the scale of this step's backward (fp16 without ZeRO)
        with scale_moved_after_step(self.optimizer):   # fp16: divided by the scale of the backward
            super()._take_model_step(*args, **kwargs)
        if scale is not None and self._global_grad_norm is not None and reports_scaled_norm(self.optimizer):
            self._global_grad_norm = self._global_grad_norm / scale   # get_global_grad_norm(): unscaled

    def clip_fp32_gradients(self) -> None:
        """DeepSpeed's fp32 clipping without ZeRO (its ``_take_model_step`` calls this), by the norm of the whole
        model's gradient, summed over the pipeline (``runtime/execution/clip.py``); DeepSpeed's own counts stage 0's
        gradients alone. The norm is what ``get_global_grad_norm()`` reports for the step."""
        self._global_grad_norm = clip_by_global_norm(self)

    def _inference_schedule(self, micro_batches: int) -> TokenPipeSchedule:
        counts = self._slice_counts(micro_batches)
        return TokenPipeSchedule(self.terapipe.schedule, micro_batches, self.num_stages, self.stage_id,
                                 max(counts) if counts else self.num_slices, train=False,
                                 virtual_stages=self.terapipe.virtual_stages,
                                 vocab_parallel=self.terapipe.vocab_parallel, vocab_embedding=self._vocab_embedding,
                                 slice_counts=counts, **self._shard_kwargs)

    @property
    def _vocab_embedding(self) -> bool:
        """Whether the tied input embedding is split with the head (the schedule has EF/EB)."""
        return getattr(self, "_vocab", None) is not None and self._vocab.embedding is not None

    # -- execution -------------------------------------------------------------------------------------------
    def _exec_schedule(self, pipe_schedule: TokenPipeSchedule) -> None:
        """DeepSpeed's loop, plus: per-batch state reset, and errors that say where this rank was."""
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.running = pipe_schedule
        self.fwd_outputs = []
        self._states.clear()
        self.loaded.clear()
        self.documents.clear()
        self.unit_losses.clear()
        self._unit_grads.clear()
        self._stashes.clear()
        self._weight_grads = WeightGradAccumulator()
        self._logits = []
        self._slice_outputs: dict[int, list[Any]] = {}   # the last stage's outputs of each micro-batch's slices
        self._trail.clear()
        if pipe_schedule.train and self.using_bf16_optimizer \
                and not self._config.bfloat16_config.immediate_grad_update:
            # bf16 gradients as views of flat buffers: the fp32 move after each backward is one add per group
            FlatBf16Grads.attach(self.optimizer).begin_step()
        if pipe_schedule.train and self.sharded is not None:
            self.sharded.begin_step()
        timeline: list[TimedAction] = []
        terms: dict[str, float] = defaultdict(float)
        start = synchronized_ms() if self.record_timeline else 0.0
        with self._vocab.running() if self._vocab is not None else nullcontext():
            self._run_steps(pipe_schedule, timeline, terms)
        self.fwd_outputs = self._merged_outputs()
        if self.record_timeline and pipe_schedule.train:
            self.last_step_terms = {"loop": synchronized_ms() - start, **terms}
        if len(self._weight_grads):
            raise RuntimeError(f"token pipeline: {len(self._weight_grads)} deferred weight gradients were computed "
                               "but never reached .grad (the schedule has no ReduceTiedGrads/ReduceGrads/"
                               "OptimizerStep after its last W); this is a bug in the schedule, please report it")
        if self.record_timeline:
            self.last_timeline = timeline
            if pipe_schedule.train and self.terapipe.trace_dir is not None:
                self._write_trace(timeline)

    def _run_steps(self, pipe_schedule: TokenPipeSchedule, timeline: list[TimedAction],
                   terms: dict[str, float]) -> None:
        for step_id, step_cmds in enumerate(pipe_schedule):
            for cmd in step_cmds:
                handler = self._INSTRUCTION_MAP.get(type(cmd))
                if handler is None:
                    raise RuntimeError(f"{type(self).__name__} does not understand instruction {cmd!r}")
                self._trail.append(repr(cmd))
                kind = _TIMED.get(type(cmd)) if self.record_timeline else None
                term = _TAIL.get(type(cmd)) if self.record_timeline else None
                try:
                    # device work queued before is not this action's
                    start = synchronized_ms() if kind or term else 0.0
                    MethodType(handler, self)(**cmd.kwargs)
                    if kind:
                        action = Action(cmd.chunk, kind, cmd.microbatch, cmd.slice_index)
                        timeline.append(TimedAction(self.stage_id, action, start, synchronized_ms()))
                    elif term:
                        terms[term] += synchronized_ms() - start
                except Exception as err:
                    note = (f"[ds_terapipe] rank {self.global_rank} (stage {self.stage_id}) failed in step {step_id} "
                            f"of the {pipe_schedule.schedule.name} schedule; last instructions: "
                            f"{' ; '.join(self._trail)}")
                    logger.error(note)
                    if hasattr(err, "add_note"):
                        err.add_note(note)
                    raise

    def _write_trace(self, timeline: list[TimedAction]) -> None:
        path = os.path.join(self.terapipe.trace_dir, f"batch{self._batches_traced:05d}-rank{self.global_rank}.json")
        events_to_chrome_trace(timeline, path, metadata={"rank": self.global_rank, "stage": self.stage_id,
                                                         "plan": self.plan_summary()})
        self._batches_traced += 1

    def _exec_load_micro_batch(self, buffer_id: int, microbatch: int) -> None:
        batch = self._next_batch()
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError("token pipeline: each batch from the data iterator must be (inputs, labels), got "
                            f"{type(batch).__name__}")
        inputs, labels = batch
        loaded: dict[str, Any] = {}
        if self.is_first_stage():
            if self.terapipe.packed:
                inputs = self._load_documents(inputs, microbatch)
            loaded["inputs"] = self._to_device(inputs, "inputs", microbatch)
        if self.is_last_stage():
            loaded["labels"] = self._to_device(labels, "labels", microbatch)
        self.loaded[microbatch] = loaded

    def _token_ids_problem(self, item: Any) -> Optional[str]:
        """Why a peeked micro-batch's token ids cannot be run, or None (``runtime/execution/batch_checks.py``): on
        the first stage input ids outside the model's vocabulary, on the last stage labels outside it that are not
        -100 (with the project's ``causal_lm_loss`` or vocabulary parallelism, where labels are token ids)."""
        if self._vocab is not None:
            vocab = self._vocab.head.vocab_size
        else:
            vocab = getattr(self.module, "vocab_size", None)
        if vocab is None:
            return None
        if self.is_first_stage():
            ids = item[0][0] if self.terapipe.packed and isinstance(item[0], (tuple, list)) else item[0]
            problem = out_of_range_ids(ids, vocab, "input id")
            if problem is not None:
                return (f"token pipeline: {problem} (the module's vocab_size); fix the data, or build the module "
                        "with the tokenizer's vocabulary size")
        if self.is_last_stage():
            if self._vocab is not None:
                return self._vocab.labels_problem(item[1])
            from ...models.gpt import causal_lm_loss  # models build on runtime: imported when needed

            if self.module.loss_fn is causal_lm_loss:
                problem = out_of_range_ids(item[1], vocab, "label", ignore_index=IGNORE_INDEX)
                if problem is not None:
                    return (f"token pipeline: {problem}; causal_lm_loss would refuse it in the middle of the step: "
                            "fix the labels (-100 for a position that counts for nothing)")
        return None

    def _load_documents(self, inputs: Any, microbatch: int) -> Any:
        """Packed rows: ``(input_ids, position_ids)`` -> the ids, with the micro-batch's documents kept; plain
        ids are one document per row. The position ids were checked before the step (``_documents_problem``)."""
        positions = positions_of(inputs)
        if positions is None:
            got = type(inputs).__name__ if not torch.is_tensor(inputs) else f"a tensor {tuple(inputs.shape)}"
            raise ValueError(f"terapipe.packed: the inputs of micro-batch {microbatch} must be input_ids (batch, "
                             f"seq_len) or (input_ids, position_ids), got {got}; pass ((input_ids, position_ids), "
                             "labels) or set terapipe.packed to false")
        self.documents[microbatch] = Documents(positions.to(self.device, torch.int64).clone())
        return inputs[0] if isinstance(inputs, (tuple, list)) else inputs

    def _documents_problem(self, inputs: Any) -> Optional[str]:
        """Why a micro-batch's position ids cannot be run (None if they can, or rows are not packed):
        checked before the step, so every rank refuses together."""
        if not (isinstance(inputs, (tuple, list)) and len(inputs) == 2):
            return None
        try:
            check_position_ids(inputs[0], inputs[1], "the next batch")
        except ValueError as err:
            return str(err) if self.terapipe.packed else None
        if not self.terapipe.packed and int((inputs[1] == 0).sum()) > inputs[1].shape[0]:
            # position ids that restart: packed rows given to an engine that would hand them to the first layer
            return ("token pipeline: the next batch's inputs are (input_ids, position_ids) of packed documents (the "
                    "position ids restart at 0 inside rows); set \"packed\": true in the terapipe config so "
                    "attention stays within each document, or pass input_ids alone")
        return None

    def _documents_of(self, microbatch: int) -> Documents:
        """The micro-batch's documents on a rank that learns them slice by slice (from received activations)."""
        docs = self.documents.get(microbatch)
        if docs is None:
            docs = Documents.empty(self.micro_batch_size, self.seq_len_of(microbatch), self.device)
            self.documents[microbatch] = docs
        return docs

    def _to_device(self, value: Any, what: str, microbatch: int = 0) -> Any:
        first = _first_tensor(value)
        if first is None or first.dim() < 2:
            got = None if first is None else tuple(first.shape)
            raise ValueError(f"token pipeline: batch {what} must be (batch, seq_len, ...) tensors; got shape {got} in "
                             f"micro-batch {microbatch}")
        if first.shape[1] != self.seq_len_of(microbatch):
            # Every micro-batch's length was agreed before the step started (read ahead from the iterator).
            raise ValueError(f"token pipeline: micro-batch {microbatch} has {what} of sequence length "
                             f"{first.shape[1]}, but it had {self.seq_len_of(microbatch)} when the step started; "
                             "the data iterator must yield the same batches when read again (no batch may change "
                             "after it is yielded)")
        if first.shape[0] != self.micro_batch_size:
            # Stages exchange activation shapes once per slice length: a micro-batch of another size must stop here.
            raise ValueError(f"token pipeline: a micro-batch of {what} has {first.shape[0]} sequences, but "
                             f"train_micro_batch_size_per_gpu = {self.micro_batch_size}; drop or pad the last "
                             "incomplete batch (e.g. DataLoader(drop_last=True))")
        if torch.is_tensor(value):
            return value.to(self.device).detach()
        return tuple(v.to(self.device).detach() if torch.is_tensor(v) else v for v in value)

    def _state(self, chunk: int, microbatch: int) -> MicroBatchState:
        """The (chunk, micro-batch)'s KV buffers, backward progress and weight-gradient stash."""
        state = self._states.get((chunk, microbatch))
        if state is None:
            state = MicroBatchState(microbatch, self.seq_len_of(microbatch), len(self.slices_of(microbatch)))
            if self.terapipe.deferred_weight_grads and torch.is_grad_enabled():
                state.weight_stash = self._stashes.setdefault((chunk, microbatch), WeightGradStash())
            state.fuse_grad_accumulation = self.fused_grad_accumulation and torch.is_grad_enabled()
            self._states[(chunk, microbatch)] = state
        return state

    def _unit_buffer(self, chunk: int, microbatch: int, slice_index: int) -> int:
        return self.running.unit_buffer(chunk, microbatch, slice_index)

    @contextmanager
    def _weighted_loss(self, weight: float) -> Iterator[None]:
        """Scale the module's loss by the slice's share of tokens while DeepSpeed's forward computes it."""
        if self._vocab is not None:  # the loss is the vocabulary passes' (VF computes it, weighted)
            with loss_fn_replaced(self.module, self._vocab.placeholder_loss()):
                yield
            return
        loss_fn = self.module.loss_fn
        if loss_fn is None or weight == 1.0:
            yield
            return
        with loss_fn_replaced(self.module, lambda outputs, labels: loss_fn(outputs, labels) * weight):
            yield

    def _exec_forward_pass(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        with self.on_chunk(chunk), self._frozen_scope(chunk):
            self._forward_unit(buffer_id, microbatch, slice_index, chunk)

    def _forward_unit(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        start, end = self.slice_bounds(slice_index, microbatch)
        seq_len, num_slices = self.seq_len_of(microbatch), len(self.slices_of(microbatch))
        loaded = self.loaded.get(microbatch, {})
        first, last = self.is_first_stage(), self.is_last_stage()
        lo, hi = self.token_bounds(slice_index, microbatch)
        if first:
            self.pipe_buffers["inputs"][buffer_id] = cut_tokens(loaded["inputs"], lo, hi, seq_len)
        if last:
            self.pipe_buffers["labels"][buffer_id] = cut_tokens(loaded["labels"], lo, hi, seq_len)
        ctx = SliceContext(microbatch, slice_index, start, end, self._state(chunk, microbatch),
                           documents=self.documents.get(microbatch), sequence=self.sequence)
        # without a loss DeepSpeed adds each output into total_loss: slices of other lengths cannot be added
        keep_total = last and not self._compute_loss
        if keep_total:
            total_loss, self.total_loss = self.total_loss, None
        with slice_scope(ctx), self._weighted_loss((hi - lo) / seq_len):
            super()._exec_forward_pass(buffer_id)
        last_slice = slice_index == num_slices - 1
        if keep_total:
            self.total_loss = total_loss
        if last:
            self._slice_outputs.setdefault(microbatch, []).append(self.fwd_outputs.pop())
        if last_slice:
            for key, used in (("inputs", first), ("labels", last)):
                if used:
                    loaded.pop(key, None)
            if not loaded:
                self.loaded.pop(microbatch, None)
        if last:
            self.unit_losses[buffer_id] = self.loss
            if self.eval_return_logits:
                self._collect_logits(slice_index, num_slices)
        handed_on = self._is_local(chunk + 1)
        if handed_on:
            # The next chunk is on this rank: its input is this output, cut from the graph as a received one
            # would be; its backward leaves the gradient on it for ours (see _exec_backward_pass).
            outputs = self.pipe_buffers["outputs"][buffer_id]
            detached = [t.detach().requires_grad_(t.is_floating_point() and torch.is_grad_enabled())
                        for t in as_tuple(outputs)]
            self.pipe_buffers["inputs"][self._unit_buffer(chunk + 1, microbatch, slice_index)] = \
                detached[0] if torch.is_tensor(outputs) else tuple(detached)
        if not torch.is_grad_enabled():
            # No backward will run: nothing needs the inputs, and the KV cache only lives until the last slice.
            self.pipe_buffers["inputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            self.unit_losses.pop(buffer_id, None)
            if last or handed_on:
                self.pipe_buffers["outputs"][buffer_id] = None
            if last_slice:
                self._states.pop((chunk, microbatch), None)

    def _merged_outputs(self) -> list[Any]:
        """The last stage's ``fwd_outputs`` as DeepSpeed's engine has them, one entry per micro-batch in order (for
        ``eval_batch`` to reduce, or return with ``reduce_output=None``): DeepSpeed's forward appended one per
        slice; each micro-batch's slices give the sum of their weighted losses (its loss) or, with
        ``compute_loss=False``, their outputs joined along the sequence. Merged when the schedule has ended: a
        vocabulary pass fills a slice's loss after its forward."""
        merged = []
        for microbatch in sorted(self._slice_outputs):
            parts = self._slice_outputs[microbatch]
            if len(parts) == 1:
                merged.append(parts[0])
            elif self._compute_loss:
                merged.append(sum(parts) if torch.is_tensor(parts[0]) else [sum(items) for items in zip(*parts)])
            elif torch.is_tensor(parts[0]):
                merged.append(torch.cat(parts, dim=1))
            else:
                merged.append([torch.cat(items, dim=1) for items in zip(*parts)])
        return merged

    def _collect_logits(self, slice_index: int, num_slices: int) -> None:
        if slice_index == 0:
            self._logits = []
        self._logits.append(self.outputs)
        if slice_index == num_slices - 1:
            self.outputs = torch.cat(self._logits, dim=1) if len(self._logits) > 1 else self._logits[0]
            self._logits = []

    def _exec_backward_pass(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        state = self._states[(chunk, microbatch)]
        num_slices = state.num_slices   # this micro-batch's
        pending = [j for j in range(slice_index + 1, num_slices) if j not in state.backward_done]
        if pending:   # a schedule's order, not an internal state: checked under python -O too
            raise ScheduleError(
                f"token pipeline: schedule {self.running.schedule.name!r} runs the backward of slice {slice_index} "
                f"of micro-batch {microbatch} on chunk {chunk} before its later slices {pending}; a slice's "
                "backward needs the gradient its later slices leave on its keys and values, so the backwards of a "
                f"micro-batch run last slice first ({num_slices - 1} down to 0): fix the schedule's order "
                "(ds_terapipe.planner.schedule.validate(schedule) names every such action)",
                violations=[f"{chunk}B{microbatch}.{slice_index} before {chunk}B{microbatch}.{j}" for j in pending])
        with self.on_chunk(chunk):
            if self.is_last_stage():
                self.loss = self.unit_losses.pop(buffer_id)
                scale = self._loss_scale_deepspeed_leaves_out()
                if scale is not None:
                    self.loss = self.loss.float() * scale
            else:
                self.grad_layer = self._unit_grads.pop(buffer_id)
            super()._exec_backward_pass(buffer_id)
            self.grad_layer = None
            state.backward_done.add(slice_index)
            # DeepSpeed relies on cyclic buffer reuse to drop these; units are not reused, so drop them here.
            self.pipe_buffers["outputs"][buffer_id] = None
            self.pipe_buffers["labels"][buffer_id] = None
            if self._is_local(chunk - 1) and not self._chunk_frozen(chunk - 1):
                # The previous chunk is on this rank: hand it the gradient of its output (our input).
                inputs = as_tuple(self.pipe_buffers["inputs"][buffer_id])
                self._unit_grads[self._unit_buffer(chunk - 1, microbatch, slice_index)] = \
                    self._input_grads(inputs, self.pipe_buffers["inputs"][buffer_id])
                self.pipe_buffers["inputs"][buffer_id] = None
            elif self.is_first_stage() or self._chunk_frozen(chunk - 1):
                self.pipe_buffers["inputs"][buffer_id] = None
        if slice_index == 0:
            del self._states[(chunk, microbatch)]

    def _loss_scale_deepspeed_leaves_out(self) -> Optional[float]:
        """The fp16 loss scale the last stage's backward must apply itself, or None.

        Why: DeepSpeed 0.19.8's ``backward`` scales the loss only for its ZeRO optimizers. Without ZeRO, fp16 runs
        through FP16_Optimizer or FP16_UnfusedOptimizer, whose ``step`` divides the gradients by the loss scale
        all the same, so every step moved the weights 1/scale as far as it should (measured: one SGD step moved
        them 7.1e-5 against 1.8e-2 in fp32 at scale 256, in this engine and in DeepSpeed's own PipelineEngine).
        The other stages' backwards start from the gradients the last stage sends, so they carry the scale.
        """
        if not self.fp16_enabled() or isinstance(self.optimizer, ZeROOptimizer):
            return None
        scale = getattr(self.optimizer, "loss_scale", None)
        return float(scale) if scale else None

    @staticmethod
    def _input_grads(inputs: tuple[torch.Tensor, ...], like: Any) -> Any:
        """The gradients of a unit's floating inputs (zeros where none arrived), shaped as DeepSpeed's
        ``grad_layer``: a tensor for a tensor input, else a list."""
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]
        return grads[0] if torch.is_tensor(like) else grads

    def _exec_weight_grad_pass(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        """Deferred weight gradients (``runtime/slicing/deferred.py``) of the micro-batch's backwards on ``chunk``: all
        its slices (a W per micro-batch, ``W<b>.0`` after the last backward) or slice ``slice_index`` alone (a W per
        slice, wherever the schedule put it: right after its backward, or later, in a bubble)."""
        key = (chunk, microbatch)
        per_slice = self.running.schedule.weights_per_slice
        stash = self._stashes.get(key)
        if stash is None:
            return
        params, grads = stash.compute(into=self._weight_grads, slice_index=slice_index if per_slice else None)
        if not len(stash) and key not in self._states:   # every slice's backward ran (B of slice 0 ends them)
            del self._stashes[key]
        if params:   # fp32 ones went into the step's sums (handed over once); bf16/fp16 ones reach .grad now
            if self.using_bf16_optimizer:
                self.optimizer.clear_lp_grads()  # as DeepSpeed's own backward does around each backward pass
            torch.autograd.backward(params, grads)
            if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
                self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _hand_over_weight_grads(self) -> None:
        """The step's deferred weight gradients into ``.grad``: once, before anything reads or reduces gradients
        (tied-weight and data-parallel reductions, clipping, the optimizer, the freezer's statistics)."""
        left = {key: sorted(stash.slices()) for key, stash in self._stashes.items() if len(stash)}
        if left:   # a schedule without a W for a recorded backward: those weight gradients would be lost
            raise RuntimeError(f"token pipeline: schedule {self.running.schedule.name!r} left deferred weight "
                               f"gradients uncomputed at the end of the step ((chunk, micro-batch): slices {left}); "
                               "every backward needs a W of its slice (or one W per micro-batch at slice 0): "
                               "a schedule bug, please report it; set terapipe.deferred_weight_grads to false "
                               "to train without deferral meanwhile")
        if not len(self._weight_grads):
            return
        if self.using_bf16_optimizer:
            self.optimizer.clear_lp_grads()
        self._weight_grads.hand_over()
        if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
            self.optimizer.update_hp_grads(clear_lp_grads=False)

    def _exec_send_activations(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        outputs = as_tuple(self.pipe_buffers["outputs"][buffer_id])
        if self.terapipe.packed:   # the slice's position ids travel with it: the next stage's documents
            start, end = self.slice_bounds(slice_index, microbatch)
            outputs = (*outputs, self.documents[microbatch].positions[:, start:end].contiguous())
        key = (chunk, self.seq_len_of(microbatch), self.slices_of(microbatch)[slice_index])
        self.p2p.send(outputs, self.placement[chunk + 1],
                       f"activations of micro-batch {microbatch} slice {slice_index}{self._chunk_note(chunk)}",
                       header=key not in self._shapes_sent)
        self._shapes_sent.add(key)
        if not torch.is_grad_enabled() or self._chunk_frozen(chunk):
            self.pipe_buffers["outputs"][buffer_id] = None

    def _exec_recv_activations(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        # the boundary into this chunk, as sent
        key = (chunk - 1, self.seq_len_of(microbatch), self.slices_of(microbatch)[slice_index])
        what = f"activations of micro-batch {microbatch} slice {slice_index}{self._chunk_note(chunk)}"
        source = self.placement[chunk - 1]
        if key in self._shapes_known:
            received = self.p2p.recv_specs(self._shapes_known[key], source, what)
        else:
            received = self.p2p.recv(source, what)
            self._shapes_known[key] = [(tuple(t.shape), t.dtype) for t in received]
        if self.terapipe.packed:   # the last tensor is the slice's position ids (see _exec_send_activations)
            received, positions = received[:-1], received[-1]
            self._documents_of(microbatch).write(self.slice_bounds(slice_index, microbatch)[0], positions)
        if torch.is_grad_enabled() and not self._chunk_frozen(chunk - 1):  # no gradient goes back into a frozen chunk
            for tensor in received:
                tensor.requires_grad_(tensor.is_floating_point())
        self.pipe_buffers["inputs"][buffer_id] = received[0] if len(received) == 1 else received

    def _exec_send_grads(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        inputs = as_tuple(self.pipe_buffers["inputs"][buffer_id])
        grads = [t.grad if t.grad is not None else torch.zeros_like(t) for t in inputs if t.is_floating_point()]
        self.p2p.send(grads, self.placement[chunk - 1],
                       f"gradients of micro-batch {microbatch} slice {slice_index}{self._chunk_note(chunk - 1)}",
                       header=False)
        self.pipe_buffers["inputs"][buffer_id] = None

    def _exec_recv_grads(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        outputs = self.pipe_buffers["outputs"][buffer_id]
        floats = [t for t in as_tuple(outputs) if t.is_floating_point()]
        grads = self.p2p.recv_like(floats, self.placement[chunk + 1],
                                    f"gradients of micro-batch {microbatch} slice {slice_index}"
                                    f"{self._chunk_note(chunk)}")
        self._unit_grads[buffer_id] = grads[0] if torch.is_tensor(outputs) else list(grads)

    def _exec_vocab_forward(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self._vocab.forward_pass(buffer_id, microbatch, slice_index)

    def _exec_vocab_backward(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self._vocab.backward_pass(buffer_id, microbatch, slice_index)

    def _exec_vocab_embed_forward(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self._vocab.embedding.forward_pass(microbatch, slice_index)

    def _exec_vocab_embed_backward(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self._vocab.embedding.backward_pass(microbatch, slice_index)

    def _exec_reduce_grads(self) -> None:
        self._hand_over_weight_grads()
        if self.sharded is not None:   # the shards' gradients were reduce-scattered by the schedule's RS actions
            self.sharded.finish_step()
            return
        self._reduce_sequence_grads()
        if self._dp_reduce_is_identity():
            return
        super()._exec_reduce_grads()

    # -- sequence parallelism ----------------------------------------------------------------------------------
    def _sequence_share(self) -> Optional[SequenceShare]:
        """This rank's :class:`SequenceShare` under ``terapipe.sequence_parallel`` (None without), after checking
        the module was built for it (which made its parameters equal on the sequence ranks)."""
        degree = self.terapipe.sequence_parallel
        built = getattr(self.module, "sequence_parallel", 1)
        if degree != built or self.grid.get_slice_parallel_world_size() != degree:
            raise ValueError(f"terapipe.sequence_parallel={degree} but the model was built with "
                             f"sequence_parallel={built} (its topology has {self.grid.get_slice_parallel_world_size()} "
                             "ranks on its model axis); build it as ds_terapipe.TokenPipelineModule(..., "
                             f"sequence_parallel={degree}) (or **ds_terapipe.module_chunk_kwargs(terapipe))")
        if degree == 1:
            return None
        if self.using_bf16_optimizer:   # its norm treats the sequence ranks as tensor-parallel ones
            count_norm_once_per_sequence_group(self.optimizer)
        return SequenceShare(self.grid.get_slice_parallel_group(), self.grid.get_slice_parallel_rank(), degree)

    def _reduce_sequence_grads(self) -> None:
        """Sum the weight gradients over the stage's sequence ranks: each computed its tokens' share of them
        (replicated parameters, as DeepSpeed's Ulysses sums them); before clipping and the data-parallel mean."""
        if self.sequence is None:
            return
        # where each optimizer keeps them (bf16: its fp32 master gradients; fp16: .grad, loss-scaled, which a sum
        # keeps), zeros where a parameter has none yet, so every sequence rank sends the same layout
        grads = [self.grad_sink.buffer(p) for p in self.module.parameters() if p.requires_grad]
        self.sum_gradients_over(grads, self.sequence.group, "the sequence-parallel gradient sum")

    def sum_gradients_over(self, grads: list[torch.Tensor], group: Any, what: str, divide: int = 1) -> None:
        """Sum ``grads`` in place over ``group`` (then divide by ``divide``) as one fp32 buffer, one all-reduce
        waited with the p2p deadline and abort flag (``what`` names it in a failure). Collective: every rank of
        the group passes the same layout."""
        if not grads:
            return
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self.p2p.wait(dist.all_reduce(flat, group=group, async_op=True), what, group)
        if divide != 1:
            flat.div_(divide)
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def _aggregate_total_loss(self) -> Any:
        if self.sequence is not None and self.is_last_stage() and self.total_loss is not None:
            # each sequence rank's loss is its tokens' share of the micro-batches' losses
            self.p2p.wait(dist.all_reduce(self.total_loss, group=self.sequence.group, async_op=True),
                          "the sequence-parallel loss sum", self.sequence.group)
        with self._deepspeed_collectives_watched("the step's loss (its data-parallel mean and broadcast)"):
            return super()._aggregate_total_loss()

    @contextmanager
    def _deepspeed_collectives_watched(self, what: str) -> Iterator[None]:
        """Inside the block, DeepSpeed's blocking ``broadcast`` and ``all_reduce`` (``deepspeed.comm``) are issued
        asynchronously and waited for as every wait of the engine is: at most ``p2p_timeout_s``, and stopped by a
        peer's abort flag. Why: DeepSpeed's loss aggregation after every step waits for the last stage's broadcast
        with no deadline, so a peer that hangs (not one that dies: its closed connection ends the wait) would hold
        every other rank there for good."""
        import deepspeed.comm as ds_comm

        originals = {name: getattr(ds_comm, name) for name in ("broadcast", "all_reduce")}

        def watched(name: str) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("async_op"):
                    return originals[name](*args, **kwargs)
                self.p2p.wait(originals[name](*args, **dict(kwargs, async_op=True)), f"{what}: {name}",
                              kwargs.get("group"))
                return None
            return call

        for name in originals:
            setattr(ds_comm, name, watched(name))
        try:
            yield
        finally:
            for name, original in originals.items():
                setattr(ds_comm, name, original)

    def _reduce_outputs(self, outputs: Any, *args: Any, **kwargs: Any) -> Any:
        reduced = super()._reduce_outputs(outputs, *args, **kwargs)
        if self.sequence is None:
            return reduced
        # eval: the shares' losses summed (the average, or each micro-batch's loss with reduce_output=None)
        losses = [reduced] if torch.is_tensor(reduced) else list(reduced)
        summed = []
        for loss in losses:
            loss = loss.clone()
            self.p2p.wait(dist.all_reduce(loss, group=self.sequence.group, async_op=True),
                          "the sequence-parallel evaluation loss sum", self.sequence.group)
            summed.append(loss)
        return summed[0] if torch.is_tensor(reduced) else summed

    def _dp_reduce_is_identity(self) -> bool:
        """Whether DeepSpeed's data-parallel reduction would leave every gradient as it is (skipped then).

        Why: with one replica DeepSpeed's fallback still flattens the stage's gradients into a fresh buffer,
        scales it by 1, all-reduces it over a group of one and copies it back: 50-65 ms per step for a 4 x 512
        stage on one CPU core (about 3% of a 2-stage m = 1 step), which the step model (a zero data-parallel
        term for one replica) does not contain. It is an exact identity only on that path: fp32/fp16 without
        ZeRO or the bf16 optimizer (they reduce through their own buffers), dense gradients in the
        communication dtype (another dtype would round them on the way), no MoE expert groups, and no
        pre-divide factor (scaling by f then by 1/f can round).
        """
        if not self._dp_identity_by_config:
            return False
        wire = self.communication_data_type
        return all(p.grad is None or (p.grad.dtype == wire and not p.grad.is_sparse)
                   for p in self.module.parameters() if p.requires_grad)

    def dp_reduce_will_be_identity(self) -> bool:
        """:meth:`_dp_reduce_is_identity` before any gradient exists (the step cost model asks at init,
        ``runtime/planning/step_profile.py``): the gradients will have their parameters' dtype."""
        wire = self.communication_data_type
        return self._dp_identity_by_config and all(p.dtype == wire for p in self.module.parameters()
                                                   if p.requires_grad)

    def _fuse_grad_accumulation(self) -> bool:
        """Whether the stage's ``nn.Linear`` weight (and, on an accelerator, fp32 bias) gradients are added into
        ``.grad`` inside their GEMM during training (``terapipe.fuse_grad_accumulation``;
        ``runtime/slicing/deferred.py``): on unless the config turns it off or something must see every
        accumulation through autograd: DeepSpeed's ZeRO and bf16 optimizers when they hook it (their
        ``_grad_acc_hooks``: ZeRO with contiguous gradients or overlapped reduction, bf16 with
        ``immediate_grad_update``), and FSDP2 under ``shard_params``, which owns the gradients."""
        why = None
        if not self.terapipe.fuse_grad_accumulation:
            why = "terapipe.fuse_grad_accumulation is false"
        elif self.terapipe.shard_params:
            why = "shard_params reduce-scatters the gradients through FSDP2"
        elif getattr(self.optimizer, "_grad_acc_hooks", None):
            why = f"{type(self.optimizer).__name__} hooks every accumulation into .grad"
        if why is not None:
            logger.info("terapipe: stage %d accumulates the Linears' gradients through autograd (%s)", self.stage_id,
                        why)
            return False
        count = enable_fused_grad_accumulation(self.module)
        logger.info("terapipe: stage %d adds the gradients of %d nn.Linear module(s) into .grad inside their GEMMs "
                    "(%d tensors)", self.stage_id, count, len(fused_parameters(self.module)))
        return True

    def fused_parameters(self) -> list[torch.nn.Parameter]:
        """The Linears' weights and biases whose gradients training adds into ``.grad`` inside their GEMMs (none when
        it does not)."""
        return fused_parameters(self.module) if self.fused_grad_accumulation else []

    def _dp_reduce_identity_by_config(self) -> bool:
        """The configuration's part of :meth:`_dp_reduce_is_identity`, decided once at init (it cannot change
        while the engine lives: a repack builds a new engine)."""
        if self.grid.data_parallel_size != 1 or self.zero_optimization_stage() != 0 or self.using_bf16_optimizer:
            return False
        if self.has_moe_layers or not self.pipeline_enable_backward_allreduce:
            return False
        return not (self.gradient_average and self.postscale_gradients() and self.gradient_predivide_factor() != 1.0)

    # -- sharded data parallelism (runtime/features/sharding.py) ----------------------------------------------
    def _exec_shard_gather(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self.sharded.gather(chunk)

    def _exec_shard_release(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self.sharded.release(chunk)

    def _exec_shard_reduce_scatter(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self.sharded.reduce_scatter(chunk)

    def _exec_reduce_tied_grads(self) -> None:
        self._hand_over_weight_grads()
        if self.sharded is not None:
            self.sharded.reduce_tied_grads()
            return
        if getattr(self, "freezer", None) is not None:   # a zero gradient where only frozen layers use the weight
            self.freezer.fill_tied_grads(self)
        super()._exec_reduce_tied_grads()
        if self._vocab is not None:
            self._vocab.reduce_tied_grads()

    def _chunk_note(self, chunk: int) -> str:
        return f" of chunk {chunk}" if self.num_chunks != self.num_stages else ""

    def _exec_commit_p2p(self) -> None:
        self.p2p.drain()
        if self.p2p.abort is not None:
            # Every rank finished its schedule before any enters DeepSpeed's blocking collectives, which cannot
            # watch the abort flag: a rank failing in its last backward stops its peers here, not there.
            self.barrier("the schedule of this batch")

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.LoadMicroBatch: _exec_load_micro_batch,
        ds_schedule.CommitP2P: _exec_commit_p2p,
        ds_schedule.ReduceTiedGrads: _exec_reduce_tied_grads,
        ds_schedule.ReduceGrads: _exec_reduce_grads,
        ds_schedule.OptimizerStep: _exec_optimizer_step,
    }  # and every action kind's instruction, from DISPATCH (below the class)

    def module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with self.sharded.whole_layer_state() if self.sharded is not None else nullcontext():
            return super().module_state_dict(*args, **kwargs)

    def load_module_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        with self.sharded.loading_whole_layers() if self.sharded is not None else nullcontext():
            return super().load_module_state_dict(*args, **kwargs)

    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: Optional[dict] = None,
                        save_latest: bool = True, **kwargs: Any) -> Any:
        """DeepSpeed's checkpoint, plus the slicing plan and terapipe config, made crash-safe.

        ``latest`` moves to the new tag only after every rank wrote its files and rank 0 wrote the manifest
        (sizes and SHA-256 of every file), so an interrupted save never hides the previous checkpoint.
        """
        tag = str(tag) if tag is not None else f"global_step{self.global_steps}"
        tag_dir = os.path.join(save_dir, tag)
        with self._failing_fast("save_checkpoint"):
            state = dict(client_state or {})
            state.setdefault("terapipe", {"plan": self.plan_summary(), "config": self.terapipe.model_dump()})
            if self.freezer is not None and isinstance(state["terapipe"], dict):  # a resumed run re-freezes it
                state["terapipe"] = {**state["terapipe"], "freeze": self.freezer.state_dict()}
            # every rank writes files there: a directory one of them cannot write fails all of them, now
            problem = _unusable_directory(tag_dir, writes=True)
            agree_or_raise(None if problem is None else
                           f"save_checkpoint: {tag_dir} {problem} on global rank {self.global_rank}; save to a "
                           "writable directory", ckpt.CheckpointError, self.p2p,
                           "the check of the checkpoint directory")
            if self.global_rank == 0 and os.path.exists(os.path.join(tag_dir, ckpt.MANIFEST)):
                os.remove(os.path.join(tag_dir, ckpt.MANIFEST))  # being rewritten: incomplete until the end
            self.barrier("starting a checkpoint")  # DeepSpeed's own barriers in the save cannot watch the flag
            with self.sharded.saving() if self.sharded is not None else nullcontext():
                result = super().save_checkpoint(save_dir, tag=tag, client_state=state, save_latest=False,
                                                 **kwargs)
            self.barrier("saving a checkpoint")
            if self.global_rank == 0:
                ckpt.write_manifest(tag_dir, {"num_stages": self.num_stages, "dp": self.dp_world_size,
                                              "sequence_parallel": self.terapipe.sequence_parallel,
                                              "virtual_stages": self.terapipe.virtual_stages,
                                              "placement": list(self.placement),
                                              "optimizer_format": self.optimizer_format(),
                                              "repacked": self.freezer.repacked if self.freezer else None,
                                              "plan": self.plan_summary(), "terapipe": self.terapipe.model_dump(),
                                              # every sequence length's slicing, for a resumed run to run again
                                              "plans": {str(n): list(p.slices) for n, p in self.plans.items()}})
                if save_latest:
                    ckpt.write_latest(save_dir, tag)
                logger.info("terapipe: checkpoint %s complete (manifest written)", tag_dir)
            self.barrier("finishing a checkpoint")
            return result

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin", *args: Any,
                         **kwargs: Any) -> bool:
        """Refused on every rank (DeepSpeed 0.19.8's pipeline engine fails in it with an AttributeError: its
        module's state dict is written per layer by ``save_checkpoint``), naming the way to one state dict."""
        raise mark_collective(ValueError(
            f"token pipeline: save_16bit_model({save_dir!r}, {save_filename!r}) is not supported by a pipeline engine "
            "(DeepSpeed's own fails in it: a pipeline's weights are written per layer); save with "
            "engine.save_checkpoint(dir), then ds_terapipe.export_state_dict(dir) returns one "
            "{'<layer>.<param>': tensor} dict of the whole model, no process group needed"))

    def load_checkpoint(self, load_dir: str, tag: Any = None, **kwargs: Any) -> Any:
        """DeepSpeed's load, after checking the checkpoint is complete and fits this model (nothing is touched
        otherwise). A checkpoint from another number of stages loads its weights (per-layer files) but not the
        optimizer state, which DeepSpeed stores per stage."""
        with self._failing_fast("load_checkpoint"):
            self._repack_like(load_dir, tag)
            result, manifest = self._checked_load(load_dir, tag, **kwargs)
            client = result[1] if isinstance(result, tuple) and len(result) > 1 else None
            # the checkpoint's slicing first, so a re-applied freeze keeps it (it re-plans only without one); from
            # the manifest, which the engine writes itself (a caller's client_state may hold its own "terapipe");
            # nothing loaded (no `latest`: the same files on every rank) restores nothing
            restored = None if manifest is None else restore_checkpoint_plan(
                self, {"plan": manifest.get("plan"), "plans": manifest.get("plans"),
                       "config": manifest.get("terapipe")})
            if self.freezer is not None and isinstance(client, dict):
                self.freezer.load_state_dict(self, client.get("terapipe", {}).get("freeze") or {},
                                             keep_slices=self.plan.seq_len in (restored or {}))
            return result

    def _repack_like(self, load_dir: str, tag: Any) -> None:
        """A checkpoint written after a repack (runtime/features/repack.py) holds the repacked layout: an engine still
        in
        the layout the run started with freezes and repacks the same way first (collective: every rank reads the
        same manifest), so the optimizer state DeepSpeed stores per stage loads into the stages it was saved from."""
        if self.freezer is None or self.freezer.repacked is not None or not self.freezer.cfg.repack:
            return
        tag = str(tag) if tag is not None else ckpt.read_latest(load_dir)
        try:
            manifest = ckpt.read_manifest(os.path.join(load_dir, tag)) if tag is not None else {}
        except ckpt.CheckpointError:
            return  # _checked_load reports it, on every rank
        done = manifest.get("repacked")
        if not done or list(done["stages"]) != [self.num_stages, manifest.get("num_stages")]:
            return
        from ..features.repack import repack

        if int(done["num_frozen_layers"]) > self.freezer.num_frozen_layers:
            self.freezer.apply(self, int(done["num_frozen_layers"]))
        repack(self, self.num_stages // int(manifest["num_stages"]))

    def _checked_load(self, load_dir: str, tag: Any, **kwargs: Any) -> tuple[Any, Optional[dict]]:
        """DeepSpeed's load result and the checkpoint's manifest (None when nothing was loaded)."""
        tag = str(tag) if tag is not None else ckpt.read_latest(load_dir)
        if tag is None:
            logger.warning("terapipe: no 'latest' file in %s: nothing loaded", load_dir)
            return (None, None), None
        tag_dir = os.path.join(load_dir, tag)
        manifest, problem = None, None
        try:
            manifest = ckpt.verify_manifest(tag_dir)
            problem = ckpt.check_layer_shapes(self.module, tag_dir)
            if problem:
                problem = (f"checkpoint {tag_dir} was written for a model with different dimensions: {problem}; "
                           "build the model with the checkpoint's dimensions")
        except ckpt.CheckpointError as err:
            problem = str(err)
        agree_or_raise(problem, ckpt.CheckpointError, self.p2p, f"the check of checkpoint {tag_dir}")
        assert manifest is not None
        written = (manifest.get("num_stages", self.num_stages), manifest.get("virtual_stages", 1),
                   tuple(manifest.get("placement", range(manifest.get("num_stages", self.num_stages)))))
        restaged = written != (self.num_stages, self.terapipe.virtual_stages, self.placement)
        scheduler_wanted = kwargs.get("load_lr_scheduler_states", True)
        if restaged:
            if self.global_rank == 0:
                logger.warning("terapipe: checkpoint %s has %s stages x %s virtual stages (chunk -> rank %s), this run "
                               "%d x %d (%s): loading the weights, step count and lr scheduler, not the optimizer "
                               "state (it is per stage)", tag_dir, written[0], written[1], list(written[2]),
                               self.num_stages, self.terapipe.virtual_stages, list(self.placement))
            kwargs.update(load_optimizer_states=False, load_lr_scheduler_states=False, load_module_only=True)
        saved_format, own_format = manifest.get("optimizer_format"), self.optimizer_format()
        # every rank reaches these verdicts (the same manifest and config everywhere): no agreement needed
        wants_state = kwargs.get("load_optimizer_states", True) and not kwargs.get("load_module_only")
        weights_only = ("load the weights, step count and lr scheduler with a fresh optimizer: "
                        "load_checkpoint(..., load_optimizer_states=False)")
        if saved_format not in (None, own_format) and wants_state:
            saved, own = _OPTIMIZER_FORMATS.get(saved_format, saved_format), _OPTIMIZER_FORMATS[own_format]
            raise mark_collective(ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds its optimizer state as {saved}, this run keeps it as {own}: resume with "
                f"the checkpoint's zero_optimization.stage, bf16/fp16 and terapipe.shard_params, or {weights_only}"))
        saved_dp = manifest.get("dp")
        if own_format == "zero" and saved_format in (None, "zero") and saved_dp not in (None, self.dp_world_size) \
                and wants_state and not self.load_universal_checkpoint():
            # DeepSpeed would refuse it only after loading the weights, without the way out
            raise mark_collective(ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds ZeRO's optimizer state partitioned over {saved_dp} data-parallel "
                f"replicas, this run has {self.dp_world_size}, and DeepSpeed cannot partition it anew: resume with "
                f"{saved_dp} replicas, or {weights_only}"))
        # without ZeRO, DeepSpeed cannot load the bf16 optimizer, and loading weights only leaves the fp32 master
        # weights of the bf16/fp16 optimizers at their initial values (runtime/execution/checkpoint.py)
        no_zero = not self.zero_optimization() and not kwargs.get("load_module_only")
        own_bf16 = no_zero and self.using_bf16_optimizer
        load_optimizer_states = kwargs.pop("load_optimizer_states", True)
        with self._saved_mp_rank(manifest.get("sequence_parallel", 1)):
            if own_bf16:
                dp_group = self.optimizer.dp_process_group
                dp_rank = torch.distributed.get_rank(group=dp_group)
                dp_size = torch.distributed.get_world_size(dp_group)
                bf16_file = None if not load_optimizer_states else ckpt.bf16_optimizer_file(
                    tag_dir, dp_rank=dp_rank, dp_world_size=dp_size, mp_rank=self.checkpoint_mp_rank,
                    saved_dp_world_size=manifest.get("dp"))
            result = super().load_checkpoint(load_dir, tag=tag,
                                             load_optimizer_states=load_optimizer_states and not own_bf16, **kwargs)
        if result[0] is not None and restaged:
            self._restore_step_state(result[1], tag_dir, scheduler_wanted)
        if result[0] is not None and own_bf16:
            ckpt.load_bf16_optimizer_state(self.optimizer, bf16_file, dp_rank=dp_rank, dp_world_size=dp_size,
                                           load_from_fp32_weights=self.zero_load_from_fp32_weights())
        elif result[0] is not None and no_zero and not load_optimizer_states:
            refresh = getattr(self.optimizer, "refresh_fp32_params", None)   # fp16's optimizers; fp32 has no masters
            if refresh is not None:
                refresh()
        return result, manifest

    def _restore_step_state(self, state: Optional[dict], tag_dir: str, scheduler: bool) -> None:
        """After a weights-only load into another stage layout: the step count (and samples, skipped steps) and the
        lr scheduler from the checkpoint's state, which DeepSpeed's module-only load leaves in the client state
        it returns. Why: without them the run would save ``global_step2`` after a checkpoint of step 3 (moving
        ``latest`` back) and restart its lr schedule and freezing schedule from step 0. The values are the same in
        every rank's file; the optimizer state is not (it is per stage) and starts fresh."""
        state = state or {}
        if "global_steps" not in state:
            raise mark_collective(ckpt.CheckpointError(
                f"checkpoint {tag_dir} holds no step count (global_steps) in its model states; it was not written "
                "by DeepSpeed's save_checkpoint: load it into the layout it was saved in"))
        self.global_steps = int(state["global_steps"])
        self.global_samples = int(state.get("global_samples", self.global_steps * self.train_batch_size()))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        for key in ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
                    "data_sampler", "random_ltd"):   # what a full load takes out of the client state
            state.pop(key, None)
        saved = state.get("lr_scheduler")
        if scheduler and self.lr_scheduler is not None and saved is not None:
            try:
                self.lr_scheduler.load_state_dict(saved)
                _set_scheduled_lr(self.lr_scheduler)
            except (KeyError, ValueError, TypeError, RuntimeError) as err:
                if self.global_rank == 0:
                    logger.warning("terapipe: the lr scheduler of checkpoint %s does not load into this layout "
                                   "(%s: %s); it starts afresh at step %d", tag_dir, type(err).__name__, err,
                                   self.global_steps)

    def optimizer_format(self) -> str:
        """How this run's checkpoints hold the optimizer state (a key of ``_OPTIMIZER_FORMATS``). Runs that agree
        load each other's state; across formats a load that asks for the optimizer state is refused before anything
        is read (DeepSpeed would fail looking for files the other format does not write, or hand one optimizer the
        other's state dict), and one with ``load_optimizer_states=False`` takes the rest."""
        if self.zero_optimization():
            return "zero"
        if self.terapipe.shard_params:   # the torch optimizer over fp32 shards, saved and loaded as whole tensors
            return "torch"
        if self.using_bf16_optimizer:
            return "bf16"
        return "fp16" if self.fp16_enabled() else "torch"

    @contextmanager
    def _saved_mp_rank(self, saved_degree: int) -> Iterator[None]:
        """While loading: DeepSpeed's per-rank file names (``mp_rank_XX``: the rank among the stages x sequence
        ranks of one replica, stage-major) as the checkpoint wrote them. At the same sequence degree each rank reads
        its own; at another, the first sequence rank's copy of its stage (every sequence rank's state is the same)."""
        own = self.checkpoint_mp_rank, self.mp_world_size
        if saved_degree != self.terapipe.sequence_parallel:
            # DeepSpeed picks its file from all ``mp_rank_*`` ones by this rank and their count (more files than
            # model ranks would be merged as tensor-parallel pieces): both as the checkpoint's layout had them
            self.checkpoint_mp_rank = self.stage_id * saved_degree
            self.mp_world_size = self.num_stages * saved_degree
        try:
            yield
        finally:
            self.checkpoint_mp_rank, self.mp_world_size = own

    def barrier(self, what: str) -> None:
        """An all-reduce of one number that waits with the p2p deadline and watches the abort flag."""
        flag = torch.zeros(1, device=self.device)
        self.p2p.wait(torch.distributed.all_reduce(flag, async_op=True), f"the barrier after {what}")

    def plan_summary(self) -> dict[str, Any]:
        """What this engine runs, for logs and checkpoints."""
        summary: dict[str, Any] = {"slices": list(self.slices), "seq_len": self.seq_len,
                                   "schedule": self.terapipe.schedule, "num_stages": self.num_stages,
                                   "virtual_stages": self.terapipe.virtual_stages,
                                   "micro_batches": self.micro_batches, "micro_batch_size": self.micro_batch_size}
        if self.slicing_plan is not None:
            summary["planner"] = self.slicing_plan.to_dict()
        return summary


# optimizer_format's values, as a refused load names them
_OPTIMIZER_FORMATS = {
    "zero": "ZeRO's partitioned files (zero_optimization.stage 1 or 2)",
    "torch": "the torch optimizer's state dict of whole tensors (fp32 at stage 0, or shard_params)",
    "bf16": "DeepSpeed's bf16 optimizer files per data-parallel rank (bf16, stage 0)",
    "fp16": "DeepSpeed's fp16 optimizer state (fp16, stage 0)",
}


# The actions' instructions and their handlers, from the one table of runtime/execution/schedule.py.
TokenPipelineEngine._INSTRUCTION_MAP.update(
    {d.instruction: getattr(TokenPipelineEngine, d.handler) for d in DISPATCH.values()})

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
loss broadcast) while a peer fails behind it, the end of every schedule is one abort-aware all-reduce; a rank that
fails inside those collectives stops its peers through a thread that watches the flag meanwhile
(``collective_watch.py``).

The engine is one class in five parts, so that this module holds its core: construction, ``train_batch`` and
``eval_batch``, the instruction map, and the handlers of the schedule's actions (forward, backward, W, transfers,
vocabulary and shard passes). The rest are mixins, a module each, each saying in its docstring what it owns:
``plan_selection.py`` (which plan and schedule a step runs: the read-ahead that agrees the micro-batches' lengths,
``install_plan``, ``lowered_schedule``), ``batch_loading.py`` (the micro-batches loaded and checked),
``grad_reduction.py`` (a step's gradients and loss from the end of its schedule to the optimizer step) and
``engine_checkpoint.py`` (save and load). The method resolution order is the bases' order::

    TokenPipelineEngine -> PlanSelection -> BatchLoading -> GradReduction -> Checkpointing -> PipelineEngine -> ...

The mixins are plain classes that define no name in common with each other or with the engine's own body (a test
keeps it so, ``tests/test_layout.py``), so the order decides no lookup: each name has one definition above
DeepSpeed's, and a ``super()`` call in a mixin reaches DeepSpeed's ``PipelineEngine`` as it would from here.
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
from deepspeed.runtime.base_optimizer import ZeROOptimizer
from deepspeed.runtime.config import DeepSpeedConfig, get_wall_clock_breakdown
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.engine import PipelineEngine

from ...config import TeraPipeConfig
from ...planner.registry import get_schedule
from ...planner.schedule import Action, ScheduleError
from ...planner.simulate import TimedAction
from ...trace import events_to_chrome_trace
from ..features.freeze import Freezer
from ..features.recompute import install_sliced_checkpointing
from ..features.sharding import ShardedChunks, sharding_problem
from ..features.vocab import VocabParallel
from ..planning.batch_plan import BatchPlanner
from ..planning.plan import ResolvedPlan, resolve_plan
from ..planning.replan import Replanner
from ..slicing.context import MicroBatchState, SliceContext, cut_tokens, slice_scope
from ..slicing.deferred import WeightGradAccumulator, WeightGradStash, enable_deferred_weight_grads
from ..slicing.devices import synchronized_ms
from ..slicing.documents import Documents
from ..slicing.sequence import SequenceShare
from .batch_loading import BatchLoading, put_back
from .bf16_grads import FlatBf16Grads, norm_of_no_gradient_is_zero
from .clip import mark_replicated_grads
from .collective import agree_or_raise, mark_collective
from .collective_watch import CollectiveWatch
from .ds_config_checks import unhonoured_config_problem
from .ds_internals import check_deepspeed_internals
from .engine_checkpoint import Checkpointing, _set_scheduled_lr, _unusable_directory
from .grad_reduction import GradReduction
from .grad_sink import GradSink
from .lifetime import hold_engine_weakly
from .module import chunk_layout, loss_fn_problem, loss_fn_replaced
from .optimizer_init import undo_construction_step
from .p2p import AbortFlag, PeerFailedError, SliceP2P, as_tuple
from .plan_selection import PlanSelection
from .schedule import DISPATCH, TokenPipeSchedule

# the engine, and two helpers of its mixins that tests import from this module
__all__ = ["TokenPipelineEngine", "put_back", "_set_scheduled_lr"]

logger = logging.getLogger(__name__)


def _detached(value: Any) -> Any:
    """``value`` (a tensor, or a list or tuple of them, as a loss may be) without its autograd graph."""
    if torch.is_tensor(value):
        return value.detach()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(item) for item in value)
    return value


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


# eval_batch's parameters, as DeepSpeed's PipelineEngine takes them (bound to read compute_loss, num_micro_batches)
_EVAL_SIGNATURE = inspect.signature(PipelineEngine.eval_batch)

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


class TokenPipelineEngine(PlanSelection, BatchLoading, GradReduction, Checkpointing, PipelineEngine):
    """A DeepSpeed ``PipelineEngine`` that pipelines token slices of each micro-batch (TeraPipe).

    Created by :func:`ds_terapipe.initialize` when the DeepSpeed config has ``"terapipe": {"enabled": true}``.
    ``train_batch()``, ``eval_batch()`` and checkpointing work as with DeepSpeed's engine.

    Attributes:
        plan: the :class:`~ds_terapipe.runtime.planning.plan.ResolvedPlan` in use (for the current batches' sequence
            length); ``slices``, ``slicing_plan`` and ``plan_source`` read it.
    """

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
        problem = unhonoured_config_problem(ds_config, config_class, model)   # keys nothing would honour
        if problem:
            raise ValueError(problem)
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
        # ZeRO's optimizer would keep a dropped engine alive (runtime/execution/lifetime.py)
        hold_engine_weakly(self.optimizer, self._backward_post_hook)
        undo_construction_step(self.optimizer)   # fp16 at ZeRO 0: the step DeepSpeed took on zero gradients
        VocabParallel.check_engine(self)
        mark_replicated_grads(self.optimizer)   # fp16 at ZeRO 0: its norm skips tied copies (runtime/execution/clip.py)
        if self.using_bf16_optimizer:   # a rank listing no gradient for the norm adds a zero (bf16_grads.py)
            norm_of_no_gradient_is_zero(self.optimizer)
        problem = loss_fn_problem(self.module)   # trained loss parameters no checkpoint would hold
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
        # the flag watched while inside DeepSpeed's collectives after each schedule (collective_watch.py)
        self.collective_watch = CollectiveWatch(self.p2p.abort, self.global_rank, self.p2p.poll_s)
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
        self._tied_order = self._tied_order_by_config()
        with self._failing_fast("engine init"):
            agree_or_raise(self._directories_problem(), ValueError, self.p2p, "the check of terapipe's directories")
            if self.terapipe.deferred_weight_grads:  # before profiling, which measures the split backward
                count = enable_deferred_weight_grads(self.module)
                logger.info("terapipe: stage %d defers the weight gradients of %d nn.Linear module(s)",
                            self.stage_id, count)
            self.fused_grad_accumulation = self._fuse_grad_accumulation()   # before profiling too: it times it
            install_sliced_checkpointing(self.module, self.terapipe)  # before profiling: it times the recompute
            # the slice check and profile time plain collectives (the tied and data-parallel reductions, the
            # vocabulary broadcasts, sharded layers' gathers, sequence ranks' all-to-alls) and end in decisions
            # broadcast from rank 0: a rank failing among them (out of memory) stops its peers through the watch
            with self.collective_watch.stretch("engine init's slice check and profile"):
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

    def destroy(self) -> None:
        """DeepSpeed's ``destroy()``, then the thread this engine's transfers wait on is stopped, for a process that
        builds engine after engine (trials, notebooks). The process groups are DeepSpeed's (its module's grid) and
        stay as DeepSpeed leaves them."""
        try:
            super().destroy()
        finally:
            self.collective_watch.leave()
            self.p2p.close()

    # -- train and eval entry points -------------------------------------------------------------------------
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
            if self.freezer is not None:   # (a repack watches itself: engine.watching)
                self.freezer.before_step(self)  # a repack (runtime/features/repack.py) turns self into the new engine
            # watched by the engine that runs the step (after a repack, the new one)
            with self._watched_if_blind("train_batch"):   # a new length's plan and slice check run the layers too
                if self.repack_share is not None:   # this replica's share of the step's micro-batches
                    data_iter = self.repack_share.take(self, source, self.micro_batches)
                if data_iter is not None:
                    self.set_dataiterator(data_iter)
                peeked = self._use_plan_for_next_batch(self.data_iterator, train=True)
                if self.is_first_stage() or self.is_last_stage():
                    self.data_iterator = peeked
                if self.replanner is not None:
                    self.replanner.before_step(self)
                with self.collective_watch.around():   # entered after the schedule's last barrier
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
                count = self._repacked_eval_share(bound.arguments["num_micro_batches"])
                data_iter = self.repack_share.take(self, data_iter, count, "eval_batch")
                bound.arguments["num_micro_batches"] = count
                args, kwargs = bound.args[2:], bound.kwargs   # this replica's share, as DeepSpeed runs it
            with self._watched_if_blind("eval_batch"), self.collective_watch.around():
                return super().eval_batch(self._use_plan_for_next_batch(data_iter, count=count), *args, **kwargs)

    def _repacked_eval_share(self, asked: Optional[int]) -> int:
        """After a repack onto k times the replicas: the micro-batches of an evaluation each replica runs. The call
        means what it meant before the repack (``num_micro_batches`` micro-batches read from the iterator, default
        the step's), so each replica runs a k-th of them; a count k does not divide is refused on every rank."""
        factor = self.repack_share.factor
        if asked is None:
            return self.micro_batches
        if asked % factor:
            raise mark_collective(ValueError(
                f"token pipeline: eval_batch(num_micro_batches={asked}) after a repack onto {factor} times the "
                f"data-parallel replicas: each replica runs a share of the micro-batches, and {asked} does not split "
                f"over {factor}; pass a multiple of {factor}"))
        return asked // factor

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
        blind = self._blind_collectives()
        if blind:   # watched since the step's start (_watched_if_blind): named for the schedule from here
            self.collective_watch.enter(f"the schedule's {blind}", rename=True)
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
            if self.is_last_stage():
                # Keep the value, not the spent graph: DeepSpeed's forward hooks its outputs with closures over this
                # engine, and the graph's nodes hold them in C++, a cycle the collector cannot see. Kept, the last
                # loss would keep the engine (model, optimizer state) alive after the script drops it (lifetime.py).
                self.loss = _detached(self.loss)
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
        return SequenceShare(self.grid.get_slice_parallel_group(), self.grid.get_slice_parallel_rank(), degree)

    # -- sharded data parallelism (runtime/features/sharding.py) ----------------------------------------------
    def _exec_shard_gather(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self.sharded.gather(chunk)

    def _exec_shard_release(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self.sharded.release(chunk)

    def _exec_shard_reduce_scatter(self, buffer_id: int, microbatch: int, slice_index: int, chunk: int) -> None:
        self.sharded.reduce_scatter(chunk)

    def _chunk_note(self, chunk: int) -> str:
        return f" of chunk {chunk}" if self.num_chunks != self.num_stages else ""

    def _exec_commit_p2p(self) -> None:
        self.p2p.drain()
        if self.p2p.abort is not None:
            # Every rank finished its schedule before any enters DeepSpeed's blocking collectives, which cannot
            # watch the abort flag: a rank failing in its last backward stops its peers here, not there. A rank
            # failing inside them (an optimizer step out of memory) stops its peers through the watch.
            self.barrier("the schedule of this batch")
            self.collective_watch.enter("DeepSpeed's gradient reduction, optimizer step and loss broadcast",
                                        rename=True)

    _INSTRUCTION_MAP = {
        **PipelineEngine._INSTRUCTION_MAP,
        ds_schedule.LoadMicroBatch: BatchLoading._exec_load_micro_batch,
        ds_schedule.CommitP2P: _exec_commit_p2p,
        ds_schedule.ReduceTiedGrads: GradReduction._exec_reduce_tied_grads,
        ds_schedule.ReduceGrads: GradReduction._exec_reduce_grads,
        ds_schedule.OptimizerStep: GradReduction._exec_optimizer_step,
    }  # and every action kind's instruction, from DISPATCH (below the class)

    def barrier(self, what: str) -> None:
        """An all-reduce of one number that waits with the p2p deadline and watches the abort flag."""
        flag = torch.zeros(1, device=self.device)
        self.p2p.wait(torch.distributed.all_reduce(flag, async_op=True), f"the barrier after {what}")

    @contextmanager
    def watching(self, what: str) -> Iterator[None]:
        """A block of collectives that cannot watch the abort flag (a repack's engine build: DeepSpeed's
        broadcasts and groups), entered by every rank after an abort-aware barrier and run under the collective
        watch (collective_watch.py): a peer failing inside it stops this rank within ``poll_s`` instead of at the
        process group's timeout."""
        self.barrier(f"the work before {what}")
        with self.collective_watch.stretch(what):
            yield

    def _blind_collectives(self) -> Optional[str]:
        """The collectives this rank's own layers run that cannot watch the abort flag (None: none): sharded
        chunks' gathers and reduce-scatters (FSDP2), sequence ranks' all-to-alls. They block in the backend
        without a deadline, so a peer failing in a layer (out of memory) would leave this rank inside one until
        the process group's timeout."""
        blind = ["gathers and reduce-scatters"] * (self.sharded is not None) + \
            ["all-to-alls"] * (self.sequence is not None)
        return " and ".join(blind) or None

    @contextmanager
    def _watched_if_blind(self, what: str) -> Iterator[None]:
        """``what`` (a step) under the collective watch when this rank's layers run collectives that cannot watch
        the abort flag (:meth:`_blind_collectives`): a new length's slice check and profile and the schedule all
        run the layers. Nothing otherwise: every wait of the engine's own watches the flag."""
        blind = self._blind_collectives()
        if blind is None:
            yield
            return
        with self.collective_watch.stretch(f"the {blind} of {what}"):
            yield


# The actions' instructions and their handlers, from the one table of runtime/execution/schedule.py.
TokenPipelineEngine._INSTRUCTION_MAP.update(
    {d.instruction: getattr(TokenPipelineEngine, d.handler) for d in DISPATCH.values()})

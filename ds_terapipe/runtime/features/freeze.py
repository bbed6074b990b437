"""Progressive freezing of the front layers (``terapipe.freeze``), as PipeTransformer (ICML 2021) does.

Why: in fine-tuning and continued pre-training the early layers of a deep model converge first. Once frozen they
need no backward, no weight gradient and no optimizer state, and a pipeline rank whose layers are all frozen
only runs forwards; the slicing that was best for the whole model is then no longer the best (the front stages
got cheaper), so the plan is solved again from the costs profiled at init.

What freezing layer ``l`` means here (layers are DeepSpeed's layer list, global indices as in checkpoint files;
the frozen layers are always a prefix ``[0, k)``):

* its forward runs under ``torch.no_grad()``: nothing in front of layer ``k`` is part of the graph, so no backward
  reaches it and no gradient flows into it (the result equals a model whose first ``k`` layers are constants);
* its parameters get ``requires_grad=False`` and their optimizer state is dropped (or, in DeepSpeed's flat master
  copies, held at zero), so DeepSpeed's gradient reduction skips them and the optimizer never moves them again
  (the frozen weights stay bit-identical). A weight the layer *shares* (``TiedLayerSpec``
  ``tied_weight_attr``) with a layer that still trains keeps training, from that layer's use only: DeepSpeed's
  tied-gradient all-reduce then sees a zero gradient from the frozen side (:meth:`Freezer.fill_tied_grads`);
* a chunk whose layers are all frozen drops its backward and W actions from the schedule, and every gradient
  message into it (:func:`freeze_lowered`): that rank runs forward only and receives no gradient. The first
  chunk that trains gets inputs that do not require grad, so its backward stops at its first trained layer.

When (every rank the same step, decided before the batch): a ``schedule`` of ``[step, num_frozen_layers]`` is a
function of the step count all ranks share (their configs were checked equal at init); the ``auto`` policy is
decided on global rank 0 from the per-layer gradient norms all ranks gathered at the last check, and broadcast
(the rule: :func:`auto_freeze_count`). Steps count the optimizer steps taken (:meth:`Freezer.steps_taken`): a step
DeepSpeed skips (fp16 overflow, bf16 inf/nan gradients) moves nothing, so it is not counted, and it is no check:
its norms are inf or nan, which the rule would read as stable (nan) or as a change (inf). A check reads the
gradients the optimizer steps with, after the data-parallel reduction: the whole gradient, or under ZeRO 1 this
rank's fragment of each parameter's (summed over the replicas), divided by the fp16 loss scale of the backward.
Re-planning (``freeze.replan`` with ``slices: "auto"``): the costs profiled at init with each chunk's backward
scaled by the share of its layers still training (0 for a frozen chunk; :func:`frozen_cost`), solved on rank 0 and
installed on every rank with ``engine.install_plan``.

Optimizers: with fp32 at ZeRO stage 0 the optimizer holds the parameters themselves (the state is dropped, as
above). bf16, fp16 and ZeRO 1 keep fp32 master copies, mostly flat, that their inner optimizer updates whole; there
the frozen elements are held still around each update and their state kept at zero (runtime/features/frozen_state.py).
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from ...planner.cost import PipelineCost
from ...planner.freeze import auto_freeze_count, frozen_chunk_count, frozen_cost
from ...planner.schedule import Schedule
from ...planner.simulate import simulate
from ..execution.collective import decided_on_rank0, mark_collective
from ..execution.stage import PipelineStage
from ..planning.plan import solve_slicing
from .frozen_state import FrozenMasters, frozen_state_problem


__all__ = ["Freezer"]

logger = logging.getLogger(__name__)

def layer_norms(tables: list[Mapping[Any, float]], scale: float = 1.0) -> dict[int, float]:
    """Each layer's gradient norm from every rank's squared norms: ``{layer: squares}`` from the stage that holds
    it (replicas send the same reduced values: counted once), ``{(layer, *where): squares}`` for a piece of a
    layer's gradient (rows of a table split over the pipeline: ``(layer, stage)``; a ZeRO 1 partition's fragments:
    ``(layer, stage, partition)``), each distinct piece counted once and summed into the layer's; divided by
    ``scale``."""
    merged: dict[Any, float] = {}
    for table in tables:
        merged.update(table)
    summed: dict[int, float] = {}
    for key, value in merged.items():
        layer = key[0] if isinstance(key, tuple) else key
        summed[layer] = summed.get(layer, 0.0) + value
    return {layer: value ** 0.5 / scale for layer, value in summed.items()}


# -- the engine's part ------------------------------------------------------------------------------------------
class _NoGradLayer:
    """A frozen layer's forward: run under ``torch.no_grad()``, so no graph is kept and no backward reaches it."""

    def __init__(self, layer: Callable[..., Any]) -> None:
        self.layer = layer

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return self.layer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Everything else is the layer's: DeepSpeed saves and loads per-layer checkpoint files through
        # ``forward_funcs[i].state_dict()`` (and skips entries without one, as it would the layer).
        if name == "layer":
            raise AttributeError(name)
        return getattr(self.layer, name)


def _tied_attrs(module: Any, key: str) -> list[str]:
    attrs = getattr(module, "tied_weight_attrs", {}).get(key, [])
    return [attrs] if isinstance(attrs, str) else list(attrs)


class Freezer:
    """The engine's freezing controller (``terapipe.freeze``): decides, applies, re-plans.

    Attributes:
        num_frozen_layers: the frozen prefix ``[0, k)`` in effect.
        num_frozen_chunks: leading chunks with frozen layers only (forward only, no gradient into them).
        events: what each freeze did (step, layers, chunks, slices before/after, predicted ms), for logs and tests.
    """

    def __init__(self, engine: "PipelineStage") -> None:
        cfg = engine.terapipe.freeze
        assert cfg is not None
        self.cfg = cfg
        module = engine.module
        # vocabulary parallelism takes the output layer out of the layers DeepSpeed builds (it is still the model's
        # last layer); its rows train through the vocabulary passes, which run beside the last chunk's backward, so
        # the last built layer with parameters is the one that never freezes
        self.vocab_parallel = getattr(module, "vocab_head_spec", None) is not None
        self.num_layers = len(module._layer_specs) + self.vocab_parallel
        self.parts = tuple(int(p) for p in module.parts)
        self.num_frozen_layers = 0
        self.num_frozen_chunks = 0
        self.events: list[dict[str, Any]] = []
        self._pending: Optional[int] = None  # the auto policy's decision, applied before the next batch
        self._previous_norms: Optional[dict[int, float]] = None
        # a check's (DeepSpeed's step, squared norms, loss scale, skipped steps), taken before the optimizer step,
        # until the step says whether it was skipped
        self._check: Optional[tuple[int, dict[Any, float], float, int]] = None
        self._base_cost = engine.plan.cost  # the profiled costs (rank 0), before any freeze
        self.repacked: Optional[dict[str, Any]] = None  # the repack this run made (runtime/features/repack.py), if any
        self._masters: Optional[FrozenMasters] = None  # DeepSpeed's master copies of the frozen weights
        self.grads = engine.grad_sink
        problem = self._unsupported(engine)
        if problem is None and cfg.repack:
            from .repack import check_repack_supported

            problem = check_repack_supported(engine)
        # Every rank's parameter counts per layer and config: one gather, so every rank checks the same table.
        local = {idx: sum(p.numel() for p in self._layer_params(module, idx)) for idx in self._local_layers(module)}
        rows_layer, rows = self._split_rows(module)
        if rows_layer is not None:
            local[rows_layer] = local.get(rows_layer, 0) + sum(p.numel() for p in rows)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (local, cfg.model_dump(), problem))
        if any(g[1] != gathered[0][1] for g in gathered):
            raise mark_collective(ValueError(f"terapipe.freeze differs between ranks ({[g[1] for g in gathered]}); "
                                             "every rank must get the same DeepSpeed config"))
        problems = [g[2] for g in gathered if g[2]]
        if problems:
            raise mark_collective(ValueError(problems[0]))
        counts: dict[int, int] = {}
        for table, _, _ in gathered:
            for idx, n in table.items():
                counts[int(idx)] = max(counts.get(int(idx), 0), n)
        self.param_layers = tuple(sorted(i for i, n in counts.items() if n > 0))
        self._check_counts(self.max_requested())
        # Gradient clipping needs nothing here: a rank whose layers are all frozen joins the norm's all-reduce
        # with zero (runtime/execution/clip.py).

    # -- checks at init ----------------------------------------------------------------------------------------
    @staticmethod
    def _unsupported(engine: "PipelineStage") -> Optional[str]:
        return frozen_state_problem(engine.optimizer)

    def max_requested(self) -> int:
        return max((n for _, n in self.cfg.schedule), default=0) if self.cfg.schedule is not None else \
            (self.cfg.auto.max_frozen_layers or 0)

    def _check_counts(self, requested: int) -> None:
        if requested > self.num_layers:
            raise mark_collective(ValueError(
                f"terapipe.freeze asks to freeze {requested} layers but the model has {self.num_layers} (DeepSpeed "
                f"layer list: embedding, blocks, head, ...); use at most {self.num_layers - 1}"))
        if requested and not any(layer >= requested for layer in self.param_layers):
            last = self.param_layers[-1] if self.param_layers else None
            if self.vocab_parallel:
                raise mark_collective(ValueError(
                    f"terapipe.freeze asks to freeze {requested} layers of {self.num_layers}: with vocab_parallel the "
                    "output layer's rows train through the vocabulary passes beside the last chunk's backward, so a "
                    f"layer with parameters in front of the output layer must train (the last is layer {last}); "
                    f"freeze at most {last or 0} layers, or set vocab_parallel to false"))
            raise mark_collective(ValueError(
                f"terapipe.freeze asks to freeze {requested} layers of {self.num_layers}: that freezes every layer "
                f"with parameters (the last is layer {last}) and nothing would train; freeze at most {last or 0} "
                "layers"))

    # -- layers of this rank ------------------------------------------------------------------------------------
    @staticmethod
    def _local_layers(module: Any) -> list[int]:
        bounds = getattr(module, "chunk_bounds", [(module._local_start, module._local_stop)])
        return [idx for start, stop in bounds for idx in range(start, stop)]

    @staticmethod
    def _layer_params(module: Any, idx: int, *, keep_tied_with: Optional[int] = None) -> list[torch.nn.Parameter]:
        """The parameters of global layer ``idx`` on this rank. With ``keep_tied_with=k``: those that freeze when
        layers ``[0, k)`` do (a tied weight also used by a layer >= k keeps training)."""
        from deepspeed.pipe import TiedLayerSpec

        spec = module._layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            tied = module.tied_modules[spec.key] if spec.key in module.tied_modules else None
            if tied is None:
                return []
            shared = keep_tied_with is not None and any(
                isinstance(s, TiedLayerSpec) and s.key == spec.key for s in module._layer_specs[keep_tied_with:])
            keep = {id(module._recursive_getattr(tied, a)) for a in _tied_attrs(module, spec.key)} if shared else set()
            return [p for p in tied.parameters() if id(p) not in keep]
        layer = module._modules.get(str(idx))
        return list(layer.parameters()) if layer is not None else []

    @staticmethod
    def _split_rows(module: Any) -> tuple[Optional[int], list[torch.nn.Parameter]]:
        """(its layer, this rank's rows) of an untied input embedding split over the pipeline by vocabulary
        parallelism (runtime/features/vocab_embedding.py): every rank holds rows of that layer's table, so they
        freeze with it on every rank, whichever stage holds the rest of the layer; (None, []) without one."""
        table = getattr(module, "vocab_embed", None)
        if table is None:
            return None, []
        return module.vocab_head.embedding.layer, list(table.parameters())

    # -- each step ------------------------------------------------------------------------------------------------
    @staticmethod
    def steps_taken(engine: "PipelineStage") -> int:
        """The optimizer steps taken so far: DeepSpeed's ``global_steps`` less those it skipped (fp16 overflow,
        bf16 inf/nan gradients: no optimizer step, no learning-rate step). ``freeze.schedule``, ``warmup_steps`` and
        ``check_interval`` count these, as the learning-rate schedule does; every rank skips the same steps."""
        return engine.global_steps - engine.skipped_steps

    def target(self, step: int) -> int:
        """The frozen layer count the policy asks for before the batch of optimizer step ``step`` (steps taken)."""
        if self.cfg.schedule is not None:
            return max([n for s, n in self.cfg.schedule if s <= step] + [self.num_frozen_layers])
        return max(self.num_frozen_layers, self._pending or 0)

    @property
    def base_cost(self) -> Optional[dict]:
        """The costs profiled at init, before any freeze (global rank 0; None elsewhere)."""
        return self._base_cost

    def before_step(self, engine: "PipelineStage") -> None:
        """Freeze what the policy asks for at this step (every rank reaches the same count, see the module doc),
        then repack when ``repack`` is on and the rule says so (``engine`` is then the repacked engine)."""
        target = self.target(self.steps_taken(engine))
        if target > self.num_frozen_layers:
            self._check_counts(target)
            # freezing re-plans on rank 0 and broadcasts the plan, which blocks without a deadline; a rank may have
            # failed after the last step's barrier (in DeepSpeed's logging at the end of train_batch): meet first
            # in a barrier that watches the abort flag
            engine.barrier("the step before freezing")
            self.apply(engine, target)
            self.maybe_repack(engine)

    def maybe_repack(self, engine: "PipelineStage") -> None:
        """Repack (runtime/features/repack.py) when whole stages hold frozen layers only; once per run (collective)."""
        from .repack import repack, repack_factor

        if not self.cfg.repack or self.repacked:
            return
        k = repack_factor(engine.num_stages, self.num_frozen_chunks, engine.num_chunks // engine.num_stages)
        if k > 1:
            repack(engine, k)

    def adopt(self, engine: "PipelineStage", before: "Freezer", event: dict[str, Any]) -> None:
        """Continue ``before``'s run on the repacked ``engine``: its history, then the same layers frozen here."""
        self.events = list(before.events) + [event]
        self._pending, self._previous_norms = before._pending, before._previous_norms
        self.repacked = dict(event["repack"], num_frozen_layers=before.num_frozen_layers)
        self.apply(engine, before.num_frozen_layers, quiet=True)
        self.events[-1]["after_repack"] = True

    def predicted_ms(self) -> Optional[float]:
        """The predicted step time of the plan after the latest freeze (or repack), when it was re-planned."""
        return next((e["after_ms"] for e in reversed(self.events) if e.get("after_ms")), None)

    def apply(self, engine: "PipelineStage", num_frozen_layers: int, *, quiet: bool = False,
              keep_slices: bool = False) -> None:
        """Freeze layers ``[0, num_frozen_layers)`` on this rank (collective when it re-plans); ``quiet``: log
        nothing (a repack re-applies what already froze and logs the result itself); ``keep_slices``: re-plan the
        predicted step but keep the slicing (a loaded checkpoint's, which its run was using with these layers
        frozen)."""
        module = engine.module
        before_layers, before_chunks = self.num_frozen_layers, self.num_frozen_chunks
        local = self._local_layers(module)
        released, held, frozen_params = 0, 0, 0
        optimizer = engine.optimizer
        masters = None
        if not isinstance(optimizer, torch.optim.Optimizer):  # DeepSpeed's master copies (frozen_state.py)
            if self._masters is None or self._masters.optimizer is not optimizer:
                self._masters = FrozenMasters(optimizer)
            masters = self._masters
        targets = [param for idx in local if idx < num_frozen_layers
                   for param in self._layer_params(module, idx, keep_tied_with=num_frozen_layers)]
        rows_layer, rows = self._split_rows(module)
        if rows_layer is not None and rows_layer < num_frozen_layers:
            targets += rows
        for param in targets:
            if param.requires_grad:
                frozen_params += param.numel()
            param.requires_grad_(False)
            param.grad = None
            if masters is not None:
                held += masters.freeze(param)
                continue
            dropped = optimizer.state.pop(param, None)
            if isinstance(dropped, dict):
                released += sum(t.numel() * t.element_size() for t in dropped.values() if torch.is_tensor(t))
        self._wrap_frozen_forwards(module, num_frozen_layers)
        self.num_frozen_layers = num_frozen_layers
        self.num_frozen_chunks = frozen_chunk_count(self.parts, num_frozen_layers)
        if frozen_params and not quiet:
            kept = (f"; {held / 2**20:.1f} MiB of their master copies and state stay in {type(optimizer).__name__}'s "
                    "flat buffers, held still") if masters is not None else ""
            logger.info("terapipe: step %d: stage %d froze %d parameter(s) of layers < %d, released %.1f MiB of "
                        "optimizer state%s", engine.global_steps, engine.stage_id, frozen_params, num_frozen_layers,
                        released / 2**20, kept)
        event: dict[str, Any] = {"step": self.steps_taken(engine), "global_step": engine.global_steps,
                                 "layers": [before_layers, num_frozen_layers],
                                 "frozen_chunks": self.num_frozen_chunks, "slices_before": list(engine.slices)}
        if self.cfg.replan and engine.terapipe.slicing.is_auto:
            event.update(self._replan(engine, before_layers, before_chunks, may_switch=not keep_slices))
        event["slices_after"] = list(engine.slices)
        self.events.append(event)
        if engine.global_rank == 0 and not quiet:
            chunks = {0: "no chunk is wholly frozen", 1: "chunk 0 runs forward only"}.get(
                self.num_frozen_chunks, f"chunks 0..{self.num_frozen_chunks - 1} run forward only")
            speed = (f"; predicted step {event['before_ms']:.1f} ms -> {event['after_ms']:.1f} ms "
                     f"({event['before_ms'] / event['after_ms']:.2f}x; {event['unfrozen_ms'] / event['after_ms']:.2f}x "
                     "the unfrozen model's)") if event.get("after_ms") else ""
            logger.info("terapipe: step %d: froze layers %d..%d (%d of %d frozen; %s); plan %s -> %s%s",
                        engine.global_steps, before_layers, num_frozen_layers - 1, num_frozen_layers,
                        self.num_layers, chunks, event["slices_before"], event["slices_after"], speed)

    def _wrap_frozen_forwards(self, module: Any, num_frozen_layers: int) -> None:
        funcs = getattr(module, "chunk_funcs", [module.forward_funcs])
        bounds = getattr(module, "chunk_bounds", [(module._local_start, module._local_stop)])
        for layer_funcs, (start, _) in zip(funcs, bounds):
            for j, func in enumerate(layer_funcs):
                if start + j < num_frozen_layers and not isinstance(func, _NoGradLayer):
                    layer_funcs[j] = _NoGradLayer(func)

    # -- engine hooks ---------------------------------------------------------------------------------------------
    def fill_tied_grads(self, engine: "PipelineStage") -> None:
        """Before DeepSpeed's tied-gradient all-reduce: a trained tied weight whose only use on this rank is
        frozen has no gradient here, and DeepSpeed skips a missing gradient, leaving its peers in the all-reduce
        alone; a zero gradient is what this rank contributes."""
        if not self.num_frozen_layers:
            return
        for weight, _ in engine.module.get_tied_weights_and_groups():
            if weight.requires_grad and self.grads.read(weight) is None:
                self.grads.buffer(weight)  # zeros, where DeepSpeed's reduction reads (the bf16 master gradient)

    def observe_gradients(self, engine: "PipelineStage") -> None:
        """The auto policy's check, first half: right before the optimizer step of a check step, this rank's squared
        gradient norm of every training layer it holds (local; :meth:`after_optimizer_step` decides)."""
        auto = self.cfg.auto
        step = self.steps_taken(engine)
        self._check = None
        if auto is None or step < auto.warmup_steps or (step - auto.warmup_steps) % auto.check_interval:
            return
        module = engine.module
        partitioned = self._partitioned(engine.optimizer)
        # squared norms: a layer's on the stage that holds it, a split table's rows (key (layer, stage)) on every
        # rank; under ZeRO 1 each fragment keyed by its partition too (the replicas hold different fragments), and
        # the layer's own key holds 0 (every training layer has a norm, whichever rank holds its fragments)
        local: dict[Any, float] = {}

        def add(key: Any, params: list[torch.nn.Parameter]) -> None:
            for param in params:
                grad = self._reduced_grad(param, partitioned)
                if grad is not None:
                    piece = key if not partitioned else (*key, dist.get_rank(param._dp_group))
                    local[piece] = local.get(piece, 0.0) + float((grad.float() ** 2).sum())

        for idx in self._local_layers(module):
            if idx < self.num_frozen_layers or idx not in self.param_layers:
                continue
            local[idx] = 0.0
            add(idx if not partitioned else (idx, engine.stage_id), self._layer_params(module, idx))
        rows_layer, rows = self._split_rows(module)
        if rows_layer is not None and rows_layer >= self.num_frozen_layers:
            local.setdefault((rows_layer, engine.stage_id) if not partitioned else rows_layer, 0.0)
            add((rows_layer, engine.stage_id), rows)
        # fp16: the gradients carry the loss scale of their backward, which the step may move; the log names
        # DeepSpeed's step, as the other log lines do
        self._check = (engine.global_steps, local, self.grads.scale(), engine.skipped_steps)

    def after_optimizer_step(self, engine: "PipelineStage") -> None:
        """The auto policy's check, second half (collective on a check step): gather every rank's squared norms and
        whether DeepSpeed skipped the step; a skipped step, or one whose norms are not all finite, is no check (the
        previous norms stay, and the check comes again at the next step: the steps taken did not move); otherwise
        decide on rank 0 and broadcast the count for the next batch."""
        if self._check is None:
            return
        step, local, scale, skipped_before = self._check
        self._check = None
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (local, engine.skipped_steps != skipped_before))
        norms = layer_norms([table for table, _ in gathered], scale)
        skipped = any(s for _, s in gathered)
        if skipped or not all(math.isfinite(v) for v in norms.values()):
            if engine.global_rank == 0:
                logger.info("terapipe: step %d: no gradient norm check (%s); the previous norms stay", step,
                            "DeepSpeed skipped the step" if skipped else
                            f"non-finite norms of layers {sorted(k for k, v in norms.items() if not math.isfinite(v))}")
            return
        previous, self._previous_norms = self._previous_norms, norms
        if previous is None:
            return

        self._pending = decided_on_rank0(
            lambda: auto_freeze_count(self.num_frozen_layers, previous, norms, self.param_layers, self.cfg.auto))
        if engine.global_rank == 0:
            logger.info("terapipe: step %d: gradient norms %s (previous %s): %s", step,
                        {k: round(v, 6) for k, v in sorted(norms.items())},
                        {k: round(v, 6) for k, v in sorted(previous.items())},
                        f"freezing {self._pending} layer(s) from the next step"
                        if self._pending > self.num_frozen_layers else "nothing to freeze")

    @staticmethod
    def _partitioned(optimizer: Any) -> bool:
        """Whether ``optimizer`` keeps the reduced gradients in partitions over the replicas (ZeRO 1 and 2, which
        clear ``.grad`` once they reduced it)."""
        return hasattr(optimizer, "single_partition_of_fp32_groups")

    def _reduced_grad(self, param: torch.nn.Parameter, partitioned: bool) -> Optional[torch.Tensor]:
        """``param``'s gradient after the data-parallel reduction as far as this rank holds it: the whole gradient,
        or under ZeRO 1 this rank's fragment of it (None where it holds none)."""
        if not partitioned:
            return self.grads.read(param)
        mapping = getattr(param, "_hp_mapping", None)
        if mapping is None:   # its partition lives on another replica
            return None
        fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).reshape(-1)
        address = mapping.lp_fragment_address
        if fragment.numel() == param.numel() and address.numel != param.numel():   # a whole gradient: its fragment
            fragment = fragment.narrow(0, address.start, address.numel)
        return fragment

    # -- re-planning ---------------------------------------------------------------------------------------------
    def lowered(self, engine: "PipelineStage", num_slices: int, num_frozen_chunks: int) -> Schedule:
        return engine.lowered_schedule(num_slices, num_frozen_chunks)

    def _replan(self, engine: "PipelineStage", before_layers: int, before_chunks: int, *,
                may_switch: bool = True) -> dict[str, Any]:
        """Solve the slicing again under the frozen costs (rank 0) and install it on every rank (collective);
        ``may_switch`` False: only the frozen costs and the predictions change."""

        plan = engine.plan
        batch = engine.micro_batch_size

        def decide() -> Optional[dict[str, Any]]:
            if self._base_cost is None or plan.stage_meta is None:
                return None
            old = PipelineCost.from_dict(frozen_cost(self._base_cost, self.parts, before_layers),
                                         num_stages=engine.num_chunks)
            unfrozen = PipelineCost.from_dict(self._base_cost, num_stages=engine.num_chunks)
            cost = frozen_cost(self._base_cost, self.parts, self.num_frozen_layers)
            model = PipelineCost.from_dict(cost, num_stages=engine.num_chunks)
            n = len(plan.slices)
            before_ms = simulate(self.lowered(engine, n, before_chunks), old, plan.slices, batch).makespan_ms
            # the model before any freeze, on the slicing it was planned with at init
            first = tuple(self.events[0]["slices_before"]) if self.events else tuple(plan.slices)
            unfrozen_ms = simulate(self.lowered(engine, len(first), 0), unfrozen, first, batch).makespan_ms
            current_ms = simulate(self.lowered(engine, n, self.num_frozen_chunks), model, plan.slices,
                                  batch).makespan_ms
            best = solve_slicing(engine, model, plan.stage_meta, plan.seq_len)
            best_ms = simulate(self.lowered(engine, len(best.slices), self.num_frozen_chunks), model, best.slices,
                               batch).makespan_ms
            switch = may_switch and tuple(best.slices) != tuple(plan.slices) and best_ms < current_ms
            return {"cost": cost, "best": best.to_dict(), "before_ms": before_ms, "current_ms": current_ms,
                    "unfrozen_ms": unfrozen_ms,
                    "best_ms": best_ms, "switch": switch}

        decision = decided_on_rank0(decide)
        if decision is None:
            return {}
        from ...planner.slicing import SlicingPlan

        if decision["switch"]:
            best = SlicingPlan.from_dict(decision["best"])
            new = replace(plan, slices=tuple(best.slices), source="replanned", planner=best,
                          cost=decision["cost"] if plan.cost is not None else None)
        else:
            new = replace(plan, cost=decision["cost"] if plan.cost is not None else None)
        engine.install_plan(new)
        after = decision["best_ms"] if decision["switch"] else decision["current_ms"]
        return {"before_ms": decision["before_ms"], "kept_ms": decision["current_ms"], "after_ms": after,
                "unfrozen_ms": decision["unfrozen_ms"],
                "replanned": bool(decision["switch"])}

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        # base_cost: the costs every later re-plan is made from (rank 0's); a resumed run that restores the
        # checkpoint's slicing re-plans from them too, not from what its own start profiled (another host's speed,
        # or a loaded one, would re-plan a later freeze differently and the runs would part)
        return {"num_frozen_layers": self.num_frozen_layers, "pending": self._pending,
                "previous_norms": self._previous_norms, "repacked": self.repacked, "base_cost": self._base_cost}

    def load_state_dict(self, engine: "PipelineStage", state: Mapping[str, Any], *,
                        keep_slices: bool = False) -> None:
        """Re-freeze what the checkpoint had frozen (every rank loads the same state); ``keep_slices``: the
        engine already runs the checkpoint's slicing (``planning.plan.restore_checkpoint_plan``)."""
        self._pending = state.get("pending")
        if keep_slices and state.get("base_cost") is not None:   # the run's costs go with its slicing
            self._base_cost = state["base_cost"]
        norms = state.get("previous_norms")
        self._previous_norms = None if norms is None else {int(k): float(v) for k, v in norms.items()}
        count = int(state.get("num_frozen_layers", 0))
        if count > self.num_frozen_layers:
            self.apply(engine, count, keep_slices=keep_slices)

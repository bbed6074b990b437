"""Which slices every rank runs: the plan, resolved once at engine init and once per new sequence length.

:func:`resolve_plan` is the one call (collective: every rank makes it, in the same order):

1. Slices from the config (a list, or an int for equal slices), or ``None`` for ``slices: "auto"``.
2. The slice check (:mod:`ds_terapipe.runtime.planning.slice_check`): a layer that would train wrong when sliced is
   refused on every rank; its probe pass leaves each stage a realistic input.
3. For ``"auto"``: global rank 0 looks in the plan cache (:mod:`ds_terapipe.runtime.planning.plan_cache`). On a miss
   every stage profiles its own layers on its own device (:mod:`ds_terapipe.runtime.planning.profile`), rank 0 gathers
   the costs, solves with the planner and broadcasts the plan. A rank never plans alone. On a hit every stage
   re-times the plan's median slice length (``terapipe.profile.recheck_cached``); when the device now runs more
   than 5% off the cached costs they are rescaled and the plan solved again, so its predicted step is this run's.
4. All ranks check they hold the same slices before the first step.

A checkpoint keeps the plan its run was using; :func:`restore_checkpoint_plan` runs it again in the engine that
loads it (``terapipe.resume_plan``), so a resumed ``"auto"`` run does not depend on what this start profiled.

The result is a :class:`ResolvedPlan`, an immutable value the engine keeps. It carries what planning another
sequence length needs (the measured costs, on rank 0), so :func:`plan_for_length` returns a new value from it
instead of writing into the engine.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Mapping, Optional

import torch.distributed as dist

from ...config import TeraPipeConfig
from ...planner import _checks
from ...planner.cost import PipelineCost, scaled_cost
from ...planner.slicing import MemoryLimitError, MemoryModel, MemoryShortfall, SlicingPlan, plan_slicing
from ..execution.collective import decided_on_rank0, mark_collective
from ..execution.stage import PipelineStage
from ..features.recompute import planned_activation_factor
from .plan_cache import cache_entry, gather_fingerprints, load_cached, store_plan
from .profile import measure_costs, recheck_costs
from .slice_check import check_stage_slicing


__all__ = ["ResolvedPlan", "checkpoint_slices", "memory_limit_refusal", "plan_for_length", "resolve_plan",
           "restore_checkpoint_plan", "solve_slicing"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResolvedPlan:
    """The slices all ranks run for one sequence length, and where they came from.

    Attributes:
        slices: token counts per slice, summing to the sequence length.
        source: ``"config"`` (a list or an int), ``"profiled"`` (measured at init), ``"cache"`` (the plan cache),
            ``"planned"`` (another sequence length, from costs measured earlier), ``"replanned"`` (a freeze or the
            re-planner switched), ``"checkpoint"`` (the loaded checkpoint's run was using it) or ``"documents"``
            (one step's plan for its packed rows, ``terapipe.plan_per_batch``).
        planner: the planner's :class:`~ds_terapipe.planner.slicing.SlicingPlan` (predicted time, speedup) for
            ``slices: "auto"``, else None.
        cost: the measured costs (``PipelineCost.to_dict()``) other lengths are planned from; global rank 0 only.
        stage_meta: per stage, the layer count, hidden size and element size the memory model needs; rank 0 only.
        fingerprints: every rank's model fingerprint (the plan cache's key), once gathered.
    """

    slices: tuple[int, ...]
    source: str
    planner: Optional[SlicingPlan] = None
    cost: Optional[dict] = None
    stage_meta: Optional[tuple[dict, ...]] = None
    fingerprints: Optional[tuple] = None

    @property
    def seq_len(self) -> int:
        return sum(self.slices)


def solve_slicing(engine: "PipelineStage", cost: PipelineCost, stage_meta: Any, seq_len: int,
                  quiet: bool = False, granularity: Optional[int] = None) -> SlicingPlan:
    """Run the planner for one sequence length (rank 0 only; the caller broadcasts). ``quiet``: log the plan at
    debug level (a plan per batch would fill the log). ``granularity``: a coarser grid than the config's (a
    multiple of it), for plans that must be cheap."""
    cfg = engine.terapipe
    memory, limit = None, None
    if cfg.memory_limit_gb is not None:
        # stage_meta is per chunk; the memory model counts a rank's layers (all its chunks)
        per_rank = [sum(m["layers"] for m, r in zip(stage_meta, engine.placement) if r == rank)
                    for rank in range(engine.num_stages)]
        memory = MemoryModel(num_layers_per_stage=max(per_rank),
                             hidden=stage_meta[0]["hidden"] or 1, bytes_per_element=max(m["bytes"] for m in stage_meta),
                             activation_factor=planned_activation_factor(
                                 engine.module.activation_checkpoint_interval, cfg),
                             deferred_weight_grads=bool(cfg.deferred_weight_grads))
        limit = cfg.memory_limit_gb * 2**30
    grid = granularity or cfg.granularity
    coarse = _checks.fitting_granularity(seq_len, grid)
    if coarse != grid:   # a finer grid would take the planner minutes (its search grows faster than units squared)
        logger.log(logging.DEBUG if quiet else logging.INFO,
                   "terapipe: seq_len %d is %d slice units of terapipe.granularity=%d, more than the %d the planner "
                   "searches: planning it on a grid of %d tokens", seq_len, seq_len // grid, grid, _checks.MAX_UNITS,
                   coarse)
    try:
        plan = plan_slicing(cost, seq_len, num_microbatches=engine.micro_batches,
                            micro_batch_size=engine.micro_batch_size, granularity=coarse,
                            schedule=cfg.schedule, memory_limit_bytes=limit, memory=memory,
                            max_slices=cfg.max_slices, deferred_weight_grads=cfg.deferred_weight_grads,
                            virtual_stages=cfg.virtual_stages,
                            # nothing shorter than the profile timed: its fit is blind there
                            min_slice_len=min(cfg.profile.slice_lengths) if cfg.profile.slice_lengths else None)
    except MemoryLimitError as err:   # the planner's refusal is in its API's words; the user set a config key
        raise ValueError(memory_limit_refusal(
            cfg, err.shortfall, seq_len=seq_len, micro_batch_size=engine.micro_batch_size,
            num_stages=engine.num_stages, checkpoint_interval=engine.module.activation_checkpoint_interval)) from None
    logger.log(logging.DEBUG if quiet else logging.INFO,
               "terapipe: plan for seq_len %d: %s slices=%s predicted %.1f ms vs %.1f ms unsliced (%.2fx)", seq_len,
               cfg.schedule, list(plan.slices), plan.predicted_ms, plan.unsliced_ms, plan.speedup)
    return plan


def memory_limit_refusal(cfg: TeraPipeConfig, short: MemoryShortfall, *, seq_len: int, micro_batch_size: int,
                         num_stages: int, checkpoint_interval: int) -> str:
    """Why ``terapipe.memory_limit_gb`` cannot be met, in the config's terms: the key and its value, the smallest
    estimate the planner found (both in the key's unit, 2**30 bytes) and the changes of the run that would lower
    that estimate (``short`` says which of the planner's own would)."""
    gb = short.smallest_bytes / 2**30
    enough = float(f"{gb * 1.01:.3g}")   # 3 digits, rounded at least to the estimate
    fixes = [f"raise terapipe.memory_limit_gb to {enough:g} or more"]
    if micro_batch_size > 1:
        fixes.append(f"lower train_micro_batch_size_per_gpu (now {micro_batch_size})")
    fixes.append(f"train on shorter sequences (terapipe.seq_len; this batch's: {seq_len} tokens)")
    checkpointing = ("turn on activation checkpointing (activation_checkpoint_interval=1 on the pipeline module, "
                     'see docs/configuration.md, "Activation checkpointing with slices")')
    if planned_activation_factor(1, cfg) >= planned_activation_factor(0, cfg):
        # weight gradients deferred to the micro-batch's end keep what recomputation frees
        fixes.append("set terapipe.deferred_weight_grads to false" +
                     (" (it keeps what activation checkpointing frees)" if checkpoint_interval > 0 else
                      f" and {checkpointing}"))
    elif checkpoint_interval <= 0:
        fixes.append(checkpointing)
    fixes.append(f"use more pipeline stages (now {num_stages})")
    if short.lower_schedule:
        fixes.append(f"use terapipe.schedule {short.lower_schedule!r}")
    if short.more_slices_help:
        fixes.append(f"raise terapipe.max_slices (now {cfg.max_slices})")
    return (f"terapipe.memory_limit_gb = {cfg.memory_limit_gb:g} cannot be met: the smallest activation estimate "
            f"of any plan the planner may choose is {gb:.3g} GB on the busiest stage; {', '.join(fixes[:-1])} or "
            f"{fixes[-1]}")


def _auto_plan(engine: "PipelineStage", known: Optional[ResolvedPlan], stage_input: Any,
               seq_len: int) -> ResolvedPlan:
    """Plan for ``seq_len``: from the plan cache, from costs already measured (``known``), or by profiling.

    Collective over all ranks: rank 0 decides and broadcasts, so every rank returns the same slices.
    """
    fingerprints = known.fingerprints if known is not None and known.fingerprints is not None else \
        gather_fingerprints(engine)
    cost = known.cost if known is not None else None
    stage_meta = known.stage_meta if known is not None else None
    entry = cache_entry(engine, fingerprints, seq_len)

    def from_cache_or_known_costs() -> Optional[tuple[str, dict, bool]]:
        nonlocal cost, stage_meta
        cached = load_cached(entry)
        if cached is not None:
            cost = cost or cached.get("cost")
            stage_meta = stage_meta or cached.get("stage_meta")
            return "cache", cached["plan"], cost is not None
        if cost is not None:
            # a new sequence length: the costs measured at init cover it, no re-profiling
            plan = solve_slicing(engine, PipelineCost.from_dict(cost, num_stages=engine.num_chunks), stage_meta,
                                 seq_len)
            store_plan(entry, plan, cost, stage_meta)
            return "planned", plan.to_dict(), False
        return None

    decision = decided_on_rank0(from_cache_or_known_costs)
    if decision is not None:
        source, plan_dict, has_cost = decision
        plan = SlicingPlan.from_dict(plan_dict)
        if source == "cache" and has_cost and stage_input is not None:
            plan, cost = _retimed(engine, stage_input, seq_len, plan, cost, stage_meta)
        return ResolvedPlan(tuple(plan.slices), source, plan, cost, stage_meta, fingerprints)

    if stage_input is None:
        # every rank reaches this together (the decision above was broadcast): a verdict, not a fault
        raise mark_collective(ValueError(
            f"terapipe: no measured costs to plan seq_len={seq_len}: the plan cache entry for terapipe.seq_len "
            "holds a plan but not the costs it was made from; delete the plan cache directory "
            "(terapipe.plan_cache) so the next start profiles again"))
    # gathered on rank 0 (None elsewhere); an error of rank 0's assembly of the gathered costs comes back as the
    # value and is raised inside the decision below, so every rank learns of it instead of waiting in its broadcast
    measured = measure_costs(engine, stage_input, seq_len, errors_to_caller=True)

    def from_measured() -> dict:
        nonlocal cost, stage_meta
        if isinstance(measured, Exception):
            raise measured
        assert measured is not None
        cost, stage_meta = measured.cost.to_dict(), measured.stage_meta
        logger.info("terapipe: profiled %d chunk(s) in %.1fs", engine.num_chunks, measured.seconds)
        plan = solve_slicing(engine, measured.cost, stage_meta, seq_len)
        store_plan(entry, plan, cost, stage_meta, profile_seconds=measured.seconds)
        return plan.to_dict()

    plan = SlicingPlan.from_dict(decided_on_rank0(from_measured))
    return ResolvedPlan(tuple(plan.slices), "profiled", plan, cost, stage_meta, fingerprints)


def _retimed(engine: "PipelineStage", stage_input: Any, seq_len: int, plan: SlicingPlan,
             cost: Optional[dict], stage_meta: Any) -> tuple[SlicingPlan, Optional[dict]]:
    """A cached plan and its costs after re-timing the plan's median slice length
    (``terapipe.profile.recheck_cached``; collective). Rank 0 rescales the costs and solves again when any
    chunk's forward, backward or weight gradients run more than :data:`RECHECK_TOLERANCE` off them; else nothing
    changes. ``cost`` is rank 0's.

    Why: a plan-cache hit reuses an earlier launch's profile, and the shared benchmark host runs the same layers
    10-30% slower or faster minutes apart: a cached plan predicted the trainer's step 23% short; re-timed, the
    cache hits of the same benchmark predicted within -4.6% to +4.0% in one run and -13.7% to +2.5% in a noisier
    one. (Re-timing right after a fresh profile was tried: it moved the costs by up to 12% but did not bring
    those launches' predictions closer on average, so a fresh profile is used as measured.)
    """
    if not engine.terapipe.profile.recheck_cached:
        return plan, cost
    length = _recheck_length(plan.slices, engine)
    ratios = recheck_costs(engine, stage_input, seq_len, cost, length)   # rank 0's, None elsewhere

    def decide() -> dict:
        nonlocal cost
        assert ratios is not None and cost is not None
        drift = max(abs(r - 1.0) for chunk in ratios.values() for r in chunk.values())
        shown = {c: {k: round(v, 2) for k, v in r.items()} for c, r in ratios.items()}
        if drift <= RECHECK_TOLERANCE:
            logger.info("terapipe: cached costs re-timed at %d-token slices: measured / cached per chunk %s, within "
                        "%.0f%%: plan kept", length, shown, 100 * RECHECK_TOLERANCE)
            return plan.to_dict()
        logger.info("terapipe: cached costs re-timed at %d-token slices: measured / cached per chunk %s, up to "
                    "%.0f%% off: rescaling the costs and planning again", length, shown, 100 * drift)
        cost = scaled_cost(cost, ratios)
        return solve_slicing(engine, PipelineCost.from_dict(cost, num_stages=engine.num_chunks), stage_meta,
                      seq_len).to_dict()

    return SlicingPlan.from_dict(decided_on_rank0(decide)), cost


#: a plan-cache hit whose re-timed costs all lie within this fraction of the cached ones keeps its plan
RECHECK_TOLERANCE = 0.05


def _recheck_length(slices: tuple[int, ...], engine: "PipelineStage") -> int:
    """The slice length a cache recheck times: the plan's median slice, on the granularity grid (every rank
    derives the same from the broadcast plan)."""
    g = engine.terapipe.granularity
    median = sorted(slices)[len(slices) // 2]
    return min(max(g, round(median / g) * g), sum(slices) // g * g)


def _agree(engine: "PipelineStage", slices: tuple[int, ...]) -> None:
    """Every rank must run the same slices and schedule (collective); a mismatch is a config mismatch."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, (list(slices), engine.terapipe.schedule))
    if any(e != every[0] for e in every):
        raise mark_collective(ValueError(f"terapipe: ranks disagree on the plan ({every}); every rank must get "
                                         "the same DeepSpeed config"))


def resolve_plan(engine: "PipelineStage") -> ResolvedPlan:
    """Decide the slices every rank will run for ``terapipe.seq_len`` (collective over all ranks)."""
    cfg = engine.terapipe
    seq_len = cfg.seq_len
    assert seq_len is not None
    slices = cfg.slicing.fixed_for(seq_len)
    module = engine.module
    if slices is None and not (hasattr(module, "has_sampler") and module.has_sampler()):
        raise mark_collective(ValueError(
            "terapipe.slices=\"auto\" needs to profile each stage on a sample input: build the model as "
            "ds_terapipe.TokenPipelineModule(..., vocab_size=V) or with input_sampler=fn, or set terapipe.slices to "
            "an int or a list"))
    preset = getattr(engine, "preset_plan", None)
    if slices is None and preset is not None:
        # a repack (runtime/features/repack.py): the same layers, already checked and profiled by the engine it replaces
        resolved = preset
    else:
        stage_input = check_stage_slicing(engine, seq_len, slices)  # this rank's chunk inputs, by chunk
        resolved = ResolvedPlan(slices, "config") if slices is not None else \
            _auto_plan(engine, None, stage_input, seq_len)
    _agree(engine, resolved.slices)
    if engine.global_rank == 0:
        logger.info("terapipe: running %s with %d slice(s) %s over %d stage(s), %d micro-batch(es) (plan from %s)",
                    cfg.schedule, len(resolved.slices), list(resolved.slices), engine.num_stages, engine.micro_batches,
                    resolved.source)
    return resolved


def plan_for_length(engine: "PipelineStage", known: ResolvedPlan, seq_len: int) -> ResolvedPlan:
    """The plan for a sequence length other than ``terapipe.seq_len`` (collective: every rank calls it).

    ``known`` is the latest plan resolved: its measured costs plan the new length without profiling again.
    """
    cfg = engine.terapipe
    # Every rank calls this with the same length and config, so every rank raises these together.
    if seq_len % cfg.granularity:
        raise mark_collective(ValueError(
            f"terapipe: a batch has sequence length {seq_len}, not a multiple of terapipe.granularity="
            f"{cfg.granularity}; pad sequences to a multiple of {cfg.granularity} (or lower granularity)"))
    try:
        fixed = cfg.slicing.fixed_for(seq_len)
    except ValueError as err:
        raise mark_collective(err) from None
    if fixed is not None:
        return ResolvedPlan(fixed, "config")
    return _auto_plan(engine, known, None, seq_len)


#: What a slicing is made for, besides its length, as :meth:`TokenPipelineEngine.plan_summary` writes it.
PLAN_SHAPE_KEYS = ("schedule", "num_stages", "virtual_stages", "micro_batches", "micro_batch_size")
#: The ``terapipe`` keys the planner reads: one changed since the save means the user asked for another plan.
PLAN_CONFIG_KEYS = ("seq_len", "slices", "granularity", "schedule", "virtual_stages", "deferred_weight_grads",
                    "vocab_parallel", "max_slices", "memory_limit_gb")


def checkpoint_slices(saved: Any, current_plan: Mapping[str, Any],
                      current_config: Mapping[str, Any]) -> tuple[dict[int, tuple[int, ...]], str]:
    """The slicing per sequence length a checkpoint's run was using, when this engine may run it again; else
    ``({}, why)``.

    ``saved`` is what the checkpoint's manifest holds: ``{"plan": plan_summary, "plans": {length: slices},
    "config": terapipe config}`` (``plans`` is every length the run had planned, with variable lengths; a
    manifest without it gives the plan in use only). ``current_plan`` is this engine's ``plan_summary()``,
    ``current_config`` its ``terapipe.model_dump()``. A plan made for another shape (stages, micro-batches,
    schedule, ...) or under other planning keys (a new memory limit, granularity, ...) is not what this run asks
    for, and a checkpoint without a plan (written by hand, or by an older version) has nothing to restore.
    """
    plan = saved.get("plan") if isinstance(saved, Mapping) else None
    if not isinstance(plan, Mapping):
        return {}, "the checkpoint holds no terapipe plan"
    config = saved.get("config") if isinstance(saved.get("config"), Mapping) else {}
    diffs = [(k, plan.get(k), current_plan.get(k)) for k in PLAN_SHAPE_KEYS if plan.get(k) != current_plan.get(k)]
    diffs += [(f"terapipe.{k}", config[k], current_config.get(k)) for k in PLAN_CONFIG_KEYS
              if k in config and config[k] != current_config.get(k) and k not in {d[0] for d in diffs}]
    if diffs:
        return {}, "it was made for other settings (" + ", ".join(f"{k} {a!r} -> {b!r}" for k, a, b in diffs) + ")"
    granularity = int(current_config.get("granularity") or 1)
    plans = saved.get("plans") if isinstance(saved.get("plans"), Mapping) else {}
    by_length: dict[int, Any] = {plan.get("seq_len"): plan.get("slices")}
    for length, slices in plans.items():
        try:
            by_length[int(length)] = slices
        except (TypeError, ValueError):
            return {}, f"its plans name a sequence length {length!r}"
    for length, slices in by_length.items():
        if not (isinstance(slices, list) and slices and all(isinstance(s, int) and s > 0 and s % granularity == 0
                                                            for s in slices) and sum(slices) == length):
            return {}, (f"its slices {slices!r} for seq_len {length!r} are not positive multiples of granularity "
                        f"{granularity} summing to it")
    return {n: tuple(by_length[n]) for n in sorted(by_length)}, ""


def restore_checkpoint_plan(engine: "PipelineStage", saved: Any) -> Optional[dict[int, tuple[int, ...]]]:
    """Run the slicing the checkpoint's run was using, for every sequence length it had planned (collective:
    every rank calls it after the load).

    Why: with ``slices: "auto"`` the engine that loads a checkpoint profiled this start's speed; on a shared or
    different host that can choose another slicing than the run that wrote it (it did, 48 tokens in one slice
    against 24 + 24), and although every slicing trains the same model, float sums in another order change the
    last bits: the resumed run would not continue bit for bit. The same holds for the other lengths of a
    variable-length run, which this start would plan from its own costs. Rank 0 decides from the checkpoint's
    manifest (:func:`checkpoint_slices`) and broadcasts, so every rank installs the same plans (source
    ``"checkpoint"``; they keep this start's costs for lengths the run had not seen). Returns the slices by
    length, or None (``slices`` not ``"auto"``, ``terapipe.resume_plan`` off, or the checkpoint's plan does not
    fit: logged with why).
    """
    cfg = engine.terapipe
    if not cfg.slicing.is_auto or not cfg.resume_plan:
        return None

    def decide() -> tuple[dict[int, tuple[int, ...]], Optional[dict], str]:
        by_length, why = checkpoint_slices(saved, engine.plan_summary(), cfg.model_dump())
        planner = saved["plan"].get("planner") if by_length else None
        if not (isinstance(planner, Mapping) and
                by_length.get(planner.get("seq_len")) == tuple(planner.get("slices", ()))):
            planner = None  # its prediction is only worth keeping for the very slices it was made for
        return by_length, planner, why

    by_length, planner, why = decided_on_rank0(decide)
    current = engine.plan
    if not by_length:
        if engine.global_rank == 0:
            logger.info("terapipe: the checkpoint's slicing is not run again: %s; running this start's plan %s",
                        why, list(current.slices))
        return None
    replaced = []
    for length, slices in by_length.items():
        known = engine.plans.get(length)
        if known is not None and tuple(known.slices) == slices:
            continue
        kept = SlicingPlan.from_dict(planner) if planner is not None and planner["seq_len"] == length else None
        engine.install_plan(replace(current, slices=slices, source="checkpoint", planner=kept))
        replaced.append(length)
    if engine.global_rank == 0:
        shown = ", ".join(f"{n}: {list(s)}" for n, s in by_length.items())
        logger.info("terapipe: running the checkpoint's slicing by sequence length {%s} (this start planned %s for "
                    "%d%s)", shown, list(current.slices), current.seq_len,
                    "; terapipe.resume_plan false keeps this start's plans" if replaced else ": the same")
    return by_length

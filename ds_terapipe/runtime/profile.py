"""Choosing the plan at engine init: slice probe, on-device profiling, one plan for all ranks, plan cache.

Order of events in :func:`resolve_plan` (every rank runs it, collectively):

1. Probe pass: stage 0 samples an input (``TokenPipelineModule.sample_input``), every stage runs its layers on
   what it receives, unsliced, and passes the result on. Each stage now holds a realistic input.
2. Slice check: each stage runs its layers layer by layer on that input both unsliced and cut into slices
   through the slice context; a layer whose sliced output differs mixes tokens non-causally or ignores the
   context, and training it sliced would give wrong gradients, so every rank refuses, naming the layer.
3. For ``slices: "auto"``: unless the plan cache has a plan for exactly this setting, each stage times
   forward and backward of its own layers over a grid of (slice length, context) points, the measurements
   are gathered, global rank 0 solves with the planner, and broadcasts the plan. A rank never plans alone.
4. All ranks check they hold the same slices before the first step.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from .checkpoint import atomic_write_text
from .context import MicroBatchState, SliceContext, cut_tokens, slice_scope
from .deferred import WeightGradStash
from .p2p import agree_or_raise, as_tuple

if TYPE_CHECKING:  # pragma: no cover
    from .engine import TokenPipelineEngine

__all__ = ["resolve_plan", "check_slicing_equivalence", "profile_stage", "profile_weight_grads", "measure_costs",
           "SlicingMismatchError"]

logger = logging.getLogger(__name__)

PLAN_CACHE_VERSION = 3


class SlicingMismatchError(ValueError):
    """A layer gives different results when the sequence is cut into slices."""


# -- helpers -------------------------------------------------------------------------------------------------
def _concat_like(parts: list[Any], full: Any, seq_len: int) -> Any:
    """Reassemble per-slice outputs along dim 1 wherever the unsliced output has the sequence on dim 1."""
    if torch.is_tensor(full):
        if full.dim() >= 2 and full.shape[1] == seq_len:
            return torch.cat(parts, dim=1)
        return parts[-1]
    return tuple(_concat_like([p[i] for p in parts], f, seq_len) for i, f in enumerate(full))


def _max_rel_diff(a: Any, b: Any) -> float:
    worst = 0.0
    for x, y in zip(as_tuple(a), as_tuple(b)):
        if x.shape != y.shape:
            return float("inf")
        if not x.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(x, y) else float("inf"))
            continue
        scale = float(y.abs().max()) + 1e-6
        worst = max(worst, float((x.float() - y.float()).abs().max()) / scale)
    return worst


def _probe_cuts(seq_len: int, granularity: int, slices: Optional[tuple[int, ...]]) -> list[int]:
    """The slicing used for the check: the plan's if known, else three unequal slices on the granularity."""
    if slices is not None and len(slices) > 1:
        return list(slices)
    units = seq_len // granularity
    if units < 2:
        return [seq_len]
    first = max(1, units // 4)
    second = max(1, (units - first) // 2) if units - first > 1 else 0
    cuts = [first, second, units - first - second] if second else [first, units - first]
    return [c * granularity for c in cuts if c > 0]


# -- 1. probe pass --------------------------------------------------------------------------------------------
def _probe_pass(engine: "TokenPipelineEngine", seq_len: int) -> Any:
    """Run one unsliced forward through the pipeline on a sampled input; return this stage's input."""
    module = engine.module
    gen = torch.Generator().manual_seed(20210701)
    was_training = module.training
    module.eval()
    try:
        if engine.is_first_stage():
            sample = module.sample_input(engine.micro_batch_size, seq_len, gen)
            stage_input = tuple(t.to(engine.device) for t in sample) if isinstance(sample, tuple) else \
                sample.to(engine.device)
        else:
            received = engine._p2p.recv(engine.prev_stage, "probe activations")
            stage_input = received[0] if len(received) == 1 else received
        with torch.no_grad(), slice_scope(None):
            output = module(stage_input)
        if not engine.is_last_stage():
            engine._p2p.send(as_tuple(output), engine.next_stage, "probe activations", header=True)
            engine._p2p.drain()
    finally:
        module.train(was_training)
    return stage_input


# -- 2. slice check ---------------------------------------------------------------------------------------------
def check_slicing_equivalence(layers: list[Callable], first_layer_idx: int, stage_input: Any,
                              slices: list[int]) -> Optional[str]:
    """Run ``layers`` unsliced and sliced; return a description of the first layer that differs, or None."""
    seq_len = sum(slices)
    bounds, start = [], 0
    for length in slices:
        bounds.append((start, start + length))
        start += length
    x = stage_input
    with torch.no_grad():
        for idx, layer in enumerate(layers):
            with slice_scope(None):
                full = layer(x)
            state = MicroBatchState(0, seq_len, len(slices))
            parts = []
            for i, (lo, hi) in enumerate(bounds):
                with slice_scope(SliceContext(0, i, lo, hi, state)):
                    parts.append(layer(cut_tokens(x, lo, hi, seq_len)))
            sliced = _concat_like(parts, full, seq_len)
            dtype = as_tuple(full)[0].dtype
            tolerance = 1e-3 if dtype in (torch.float32, torch.float64) else 5e-2
            diff = _max_rel_diff(sliced, full)
            if diff > tolerance:
                name = getattr(layer, "__name__", None) or type(layer).__name__
                return (f"layer {first_layer_idx + idx} ({name}) gives different outputs when the sequence is cut "
                        f"into slices {slices} (max relative difference {diff:.2e}): it mixes tokens non-causally or "
                        "does not read the slice context. Use ds_terapipe.sliced_causal_attention for attention "
                        "(and ds_terapipe.token_offset for positions), or run with terapipe.slices=1")
            x = full
    return None


# -- 3. profiling -----------------------------------------------------------------------------------------------
def _default_lengths(seq_len: int, granularity: int) -> list[int]:
    lengths, s = [], granularity
    while s < seq_len:
        lengths.append(s)
        s *= 2
    lengths.append(seq_len)
    if len(lengths) > 6:  # keep the small end sparse: the planner rarely picks tiny slices
        lengths = [lengths[0]] + lengths[-5:]
    return lengths


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slice_leaves(stage_input: Any, start: int, end: int, seq_len: int) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """Tokens ``[start, end)`` of the stage input as fresh leaves (floats require grad): what ``run`` takes, and
    the leaves whose gradients the backward computes."""
    leaves = tuple(t.detach().requires_grad_(t.is_floating_point())
                   for t in as_tuple(cut_tokens(stage_input, start, end, seq_len)))
    return (leaves[0] if len(leaves) == 1 else leaves), leaves


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    return [t for t in as_tuple(outputs) if t.is_floating_point() and t.requires_grad]


def _backward(out: list[torch.Tensor], params: list[torch.nn.Parameter], leaves: tuple[torch.Tensor, ...]) -> None:
    """Backward of one slice through ``torch.autograd.grad``: ``.grad`` (and DeepSpeed's hooks) stay untouched."""
    wrt = [p for p in params if p.requires_grad] + [t for t in leaves if t.requires_grad]
    torch.autograd.grad(out, wrt, [torch.ones_like(t) for t in out], allow_unused=True)


def profile_stage(run: Callable[[Any], Any], params: list[torch.nn.Parameter], stage_input: Any, seq_len: int,
                  granularity: int, batch: int, *, slice_lengths: Optional[list[int]] = None, num_contexts: int = 3,
                  warmup: int = 1, repeats: int = 3, device: torch.device = torch.device("cpu"),
                  deferred: bool = False) -> list[dict]:
    """Time forward and backward of this stage's layers for slices of length s after a prefix of c tokens.

    Backward uses ``torch.autograd.grad``, so parameter ``.grad`` (and DeepSpeed's gradient hooks) are never
    touched. With ``deferred`` (weight gradients deferred, ``runtime/deferred.py``) the backward measured is the
    input-gradient part the runtime runs per slice. Returns points in the planner's cost-file format.
    """
    lengths = slice_lengths or _default_lengths(seq_len, granularity)
    grid = []
    for length in lengths:
        if length % granularity or length > seq_len or length < 1:
            raise ValueError(f"terapipe.profile.slice_lengths: {length} must be a multiple of granularity "
                             f"{granularity} and <= seq_len {seq_len}")
        free = (seq_len - length) // granularity
        contexts = sorted({round(free * k / max(1, num_contexts - 1)) * granularity for k in range(num_contexts)})
        grid.extend((length, context) for context in contexts)
    samples: dict[tuple[int, int], tuple[list[float], list[float]]] = {point: ([], []) for point in grid}
    # Rounds over the whole grid, not a point's repeats back to back: on a shared host a burst of foreign load
    # then spoils one sample of many points, which the median rejects, instead of every sample of a few points,
    # which skews the fitted model and with it the plan (seen: 4 or 13 slices where 6-8 are best).
    for rep in range(warmup + repeats):
        for length, context in grid:
            state = MicroBatchState(0, seq_len, 2)
            state.weight_stash = WeightGradStash() if deferred else None
            if context > 0:
                with torch.no_grad(), slice_scope(SliceContext(0, 0, 0, context, state)):
                    run(cut_tokens(stage_input, 0, context, seq_len))
            inputs, leaves = _slice_leaves(stage_input, context, context + length, seq_len)
            _sync(device)
            t0 = time.perf_counter()
            with slice_scope(SliceContext(0, 1, context, context + length, state)):
                out = _differentiable(run(inputs))
            _sync(device)
            t1 = time.perf_counter()
            _backward(out, params, leaves)
            _sync(device)
            t2 = time.perf_counter()
            if rep >= warmup:
                fwd, bwd = samples[(length, context)]
                fwd.append((t1 - t0) * 1e3)
                bwd.append((t2 - t1) * 1e3)
    return [{"batch": batch, "slice": length, "context": context, "forward_ms": statistics.median(fwd),
             "backward_ms": statistics.median(bwd)} for (length, context), (fwd, bwd) in samples.items()]


def profile_weight_grads(run: Callable[[Any], Any], params: list[torch.nn.Parameter], stage_input: Any, seq_len: int,
                         granularity: int, batch: int, *,
                         warmup: int = 1, repeats: int = 3, device: torch.device = torch.device("cpu")) -> float:
    """Milliseconds per token (and sequence) of the deferred weight-gradient pass of this stage.

    One micro-batch of ``seq_len`` tokens in two slices (so the pass accumulates over slices, as the runtime's
    does) is run forward and backward, then the pass is timed without touching ``.grad``.
    """
    half = max(granularity, (seq_len // 2) // granularity * granularity)
    bounds = [(0, half), (half, seq_len)] if half < seq_len else [(0, seq_len)]
    times = []
    for rep in range(warmup + repeats):
        state = MicroBatchState(0, seq_len, len(bounds))
        state.weight_stash = WeightGradStash()
        outs = []
        for i, (lo, hi) in enumerate(bounds):
            inputs, leaves = _slice_leaves(stage_input, lo, hi, seq_len)
            with slice_scope(SliceContext(0, i, lo, hi, state)):
                outs.append((_differentiable(run(inputs)), leaves))
        for out, leaves in reversed(outs):  # later slices first, as the runtime (KV gradients flow backwards)
            _backward(out, params, leaves)
        _sync(device)
        t0 = time.perf_counter()
        state.weight_stash.compute()
        _sync(device)
        if rep >= warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times) / (seq_len * batch)


def _stage_fingerprint(engine: "TokenPipelineEngine") -> list:
    return [[name, list(p.shape), str(p.dtype)] for name, p in engine.module.named_parameters()] + \
        [type(f).__name__ for f in engine.module.forward_funcs]


def _cache_path(engine: "TokenPipelineEngine", fingerprints: list, seq_len: int) -> tuple[Optional[str], str]:
    cfg = engine.terapipe
    material = {
        "version": PLAN_CACHE_VERSION, "model": fingerprints, "num_stages": engine.num_stages,
        "dp": engine.dp_world_size, "micro_batch_size": engine.micro_batch_size,
        "micro_batches": engine.micro_batches, "seq_len": seq_len, "granularity": cfg.granularity,
        "schedule": cfg.schedule, "max_slices": cfg.max_slices, "memory_limit_gb": cfg.memory_limit_gb,
        "deferred_weight_grads": cfg.deferred_weight_grads,
        "profile": cfg.profile.model_dump(), "device": str(engine.device.type), "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    if cfg.plan_cache is None:
        return None, key
    return os.path.join(cfg.plan_cache, f"terapipe-plan-{key}.json"), key


def _solve(engine: "TokenPipelineEngine", cost: Any, seq_len: int) -> Any:
    """Run the planner for one sequence length (rank 0 only; the caller broadcasts)."""
    from ..planner.slicing import MemoryModel, plan_slicing

    cfg = engine.terapipe
    meta = engine._stage_meta
    memory, limit = None, None
    if cfg.memory_limit_gb is not None:
        memory = MemoryModel(num_layers_per_stage=max(m["layers"] for m in meta), hidden=meta[0]["hidden"] or 1,
                             bytes_per_element=max(m["bytes"] for m in meta))
        limit = cfg.memory_limit_gb * 2**30
    plan = plan_slicing(cost, seq_len, num_microbatches=engine.micro_batches, micro_batch_size=engine.micro_batch_size,
                        granularity=cfg.granularity, schedule=cfg.schedule, memory_limit_bytes=limit, memory=memory,
                        max_slices=cfg.max_slices, deferred_weight_grads=cfg.deferred_weight_grads)
    logger.info("terapipe: plan for seq_len %d: %s slices=%s predicted %.1f ms vs %.1f ms unsliced (%.2fx)", seq_len,
                cfg.schedule, list(plan.slices), plan.predicted_ms, plan.unsliced_ms, plan.speedup)
    return plan


def _auto_plan(engine: "TokenPipelineEngine", stage_input: Any, seq_len: int) -> tuple[int, ...]:
    """Plan for ``seq_len``: from the plan cache, from costs already measured, or by profiling (collective)."""
    from ..planner.cost import PipelineCost
    from ..planner.slicing import SlicingPlan

    if engine._cache_fingerprints is None:
        fingerprints = [None] * dist.get_world_size()
        dist.all_gather_object(fingerprints,
                               (engine.stage_id, engine.grid.data_parallel_id, _stage_fingerprint(engine)))
        engine._cache_fingerprints = sorted(fingerprints, key=lambda f: (f[1], f[0]))
    path, key = _cache_path(engine, engine._cache_fingerprints, seq_len)
    decision: list[Any] = [None]
    if dist.get_rank() == 0:
        if path is not None and os.path.exists(path):
            try:
                with open(path) as f:
                    cached = json.load(f)
                decision = [("cache", cached["plan"])]
                engine._cost_dict = engine._cost_dict or cached.get("cost")
                engine._stage_meta = engine._stage_meta or cached.get("stage_meta")
                logger.info("terapipe: plan cache hit %s", path)
            except (OSError, ValueError, KeyError) as err:
                logger.warning("terapipe: ignoring unreadable plan cache %s (%s)", path, err)
        if decision[0] is None and engine._cost_dict is not None:
            # a new sequence length: the costs measured at init cover it, no re-profiling
            plan = _solve(engine, PipelineCost.from_dict(engine._cost_dict, num_stages=engine.num_stages), seq_len)
            decision = [("planned", plan.to_dict())]
            _store(path, key, plan, engine)
    dist.broadcast_object_list(decision, src=0)
    if decision[0] is not None:
        engine.plan_source, plan_dict = decision[0]
        engine.slicing_plan = SlicingPlan.from_dict(plan_dict)
        return tuple(engine.slicing_plan.slices)

    if stage_input is None:
        raise ValueError(f"terapipe: no measured costs to plan seq_len={seq_len}; the plan cache lost them")
    measured = measure_costs(engine, stage_input, seq_len)
    result: list[Any] = [None]
    if measured is not None:
        cost, engine._stage_meta, profile_s = measured
        engine._cost_dict = cost.to_dict()
        logger.info("terapipe: profiled %d stage(s) in %.1fs", engine.num_stages, profile_s)
        plan = _solve(engine, cost, seq_len)
        _store(path, key, plan, engine, profile_seconds=profile_s)
        result = [plan.to_dict()]
    dist.broadcast_object_list(result, src=0)
    engine.slicing_plan = SlicingPlan.from_dict(result[0])
    engine.plan_source = "profiled"
    return tuple(engine.slicing_plan.slices)


def measure_costs(engine: "TokenPipelineEngine", stage_input: Any = None,
                  seq_len: Optional[int] = None) -> Optional[tuple[Any, list, float]]:
    """Profile every stage's layers now and gather the costs (collective: every rank calls it).

    Engine init calls it for ``slices: "auto"``. Called again later it tells how far the costs a plan was made
    from have moved: on a shared host the same work can run 10-20% slower a few minutes on, and a prediction
    compared with steps timed later carries that drift as error unless its costs are measured in the same window
    (``benchmarks/pipeline_speedup.py`` re-profiles after its rounds). ``stage_input`` (``seq_len`` tokens,
    default ``terapipe.seq_len``) defaults to a fresh probe pass.

    Returns ``(PipelineCost, stage_meta, seconds)`` on global rank 0 and None on other ranks.
    """
    from ..planner.cost import PipelineCost

    cfg = engine.terapipe
    seq_len = cfg.seq_len if seq_len is None else seq_len
    if stage_input is None:
        stage_input = _probe_pass(engine, seq_len)
    started = time.perf_counter()
    params = list(engine.module.parameters())
    points = profile_stage(engine.module, params, stage_input, seq_len, cfg.granularity, engine.micro_batch_size,
                           slice_lengths=cfg.profile.slice_lengths, num_contexts=cfg.profile.num_contexts,
                           warmup=cfg.profile.warmup, repeats=cfg.profile.repeats, device=engine.device,
                           deferred=cfg.deferred_weight_grads)
    weight_rate = None
    if cfg.deferred_weight_grads:
        weight_rate = profile_weight_grads(engine.module, params, stage_input, seq_len, cfg.granularity,
                                           engine.micro_batch_size, warmup=cfg.profile.warmup,
                                           repeats=cfg.profile.repeats, device=engine.device)
    profile_s = time.perf_counter() - started
    first = as_tuple(stage_input)[0]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"stage": engine.stage_id, "dp": engine.grid.data_parallel_id,
                                      "points": points, "weight_ms_per_token": weight_rate,
                                      "layers": len(engine.module.forward_funcs),
                                      "hidden": first.shape[-1] if first.is_floating_point() else None,
                                      "bytes": first.element_size() if first.is_floating_point() else 4})
    if dist.get_rank() != 0:
        return None
    stages = sorted((g for g in gathered if g["dp"] == 0), key=lambda g: g["stage"])
    stage_meta = [{k: g[k] for k in ("layers", "hidden", "bytes")} for g in stages]
    hidden = next((m["hidden"] for m in stage_meta if m["hidden"]), None)
    for m in stage_meta:
        m["hidden"] = hidden
    cost = PipelineCost.from_dict({"stages": [{"points": g["points"], **({} if g["weight_ms_per_token"] is None else
                                              {"weight_ms_per_token": g["weight_ms_per_token"]})}
                                            for g in stages]}, num_stages=engine.num_stages)
    return cost, stage_meta, profile_s


def _store(path: Optional[str], key: str, plan: Any, engine: "TokenPipelineEngine", **extra: Any) -> None:
    if path is not None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_write_text(path, json.dumps({"key": key, "plan": plan.to_dict(), "cost": engine._cost_dict,
                                            "stage_meta": engine._stage_meta, **extra}, indent=1))


def plan_for_length(engine: "TokenPipelineEngine", seq_len: int) -> tuple[int, ...]:
    """Slices for a sequence length other than ``terapipe.seq_len`` (collective: every rank calls it)."""
    cfg = engine.terapipe
    if seq_len % cfg.granularity:
        raise ValueError(f"terapipe: a batch has sequence length {seq_len}, not a multiple of terapipe.granularity="
                         f"{cfg.granularity}; pad sequences to a multiple of {cfg.granularity} (or lower granularity)")
    if isinstance(cfg.slices, list):
        raise ValueError(f"terapipe.slices={cfg.slices} is a fixed list for seq_len {sum(cfg.slices)}, but a batch has "
                         f"sequence length {seq_len}; use slices \"auto\" or an int for variable lengths")
    if isinstance(cfg.slices, int):
        return tuple(cfg.equal_slices(seq_len))
    return _auto_plan(engine, None, seq_len)


# -- 4. entry point ---------------------------------------------------------------------------------------------
def resolve_plan(engine: "TokenPipelineEngine") -> tuple[int, ...]:
    """Decide the slices every rank will run (collective over all ranks)."""
    cfg = engine.terapipe
    if isinstance(cfg.slices, list):
        slices: Optional[tuple[int, ...]] = tuple(cfg.slices)
    elif isinstance(cfg.slices, int):
        slices = tuple(cfg.equal_slices())
    else:
        slices = None
    seq_len = cfg.seq_len
    assert seq_len is not None
    module = engine.module
    can_sample = hasattr(module, "has_sampler") and module.has_sampler()
    if slices is None and not can_sample:
        raise ValueError("terapipe.slices=\"auto\" needs to profile each stage on a sample input: build the model "
                         "as ds_terapipe.TokenPipelineModule(..., vocab_size=V) or with input_sampler=fn, or set "
                         "terapipe.slices to an int or a list")
    stage_input = None
    if can_sample and (slices is None or len(slices) > 1):
        stage_input = _probe_pass(engine, seq_len)
        cuts = _probe_cuts(seq_len, cfg.granularity, slices)
        problem = None
        if len(cuts) > 1:
            problem = check_slicing_equivalence(list(module.forward_funcs), module._local_start, stage_input, cuts)
            if problem:
                problem = f"terapipe: stage {engine.stage_id}: {problem}"
        agree_or_raise(problem, SlicingMismatchError)
    elif slices is not None and len(slices) > 1 and engine.global_rank == 0:
        logger.warning("terapipe: %s has no input sampler, so the slice check (refusing layers that mix tokens "
                       "non-causally) was skipped; use ds_terapipe.TokenPipelineModule(..., vocab_size=V)",
                       type(module).__name__)
    if slices is None:
        slices = _auto_plan(engine, stage_input, seq_len)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (list(slices), cfg.schedule))
    if any(e != every[0] for e in every):
        raise ValueError(f"terapipe: ranks disagree on the plan ({every}); every rank must get the same "
                         "DeepSpeed config")
    if engine.global_rank == 0:
        logger.info("terapipe: running %s with %d slice(s) %s over %d stage(s), %d micro-batch(es)", cfg.schedule,
                    len(slices), list(slices), engine.num_stages, engine.micro_batches)
    return tuple(slices)

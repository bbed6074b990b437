"""On-device measurement of what a step costs besides the slices: the whole-step part of the cost model.

:mod:`ds_terapipe.runtime.planning.profile` times each chunk's layers per slice. A training step also runs the
optimizer, reduces gradients (tied embedding/head between first and last stage, data-parallel replicas), meets
at the end-of-schedule barrier and the loss broadcast, moves every slice over p2p, and, in each backward that is
not deferred, adds the slice's weight gradients into ``.grad``. :func:`measure_step_terms` times each of these
at engine init, on this rank's device, without changing anything the first step sees:

* the optimizer step runs on *copies* of the parameters (with zero gradients) and a fresh optimizer of the same
  class and hyper-parameters, so the model and the real optimizer's state are untouched;
* the all-reduces (tied, data-parallel) reduce zero buffers of the gradients' sizes in the same groups (one
  replica: through a flat buffer and back, as DeepSpeed does unless the engine skips it as an identity);
* the p2p latency and bandwidth come from a ping-pong between neighbouring ranks (a tiny and a micro-batch-sized
  message);
* the gradient accumulation is an in-place ``add_`` per parameter (as AccumulateGrad does) over buffers of the
  accumulated parameters' shapes.

Collective: every rank calls it, in the same order. :func:`ds_terapipe.runtime.planning.profile.measure_costs` gathers
the results into the cost model's ``step`` (:class:`~ds_terapipe.planner.step_cost.StepCost`) and ``comm``.
"""

from __future__ import annotations

import functools
import itertools
import inspect
import logging
import statistics
import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..slicing.devices import synchronize
from ..execution.stage import PipelineStage


__all__ = ["measure_step_terms", "time_optimizer_step", "time_grad_accumulation"]

logger = logging.getLogger(__name__)


def _median_ms(fn: Callable[[], Any], warmup: int, repeats: int, clock: Callable[[], float] = time.perf_counter
               ) -> float:
    times = []
    for rep in range(warmup + repeats):
        synchronize()
        t0 = clock()
        fn()
        synchronize()
        if rep >= warmup:
            times.append((clock() - t0) * 1e3)
    return statistics.median(times)


def _inner_optimizer(optimizer: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer doing the update: the client's own, or the one a DeepSpeed wrapper holds."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(candidate, torch.optim.Optimizer):
            return candidate
    return None


#: At most this many elements are copied to time a per-element cost (optimizer, accumulation, all-reduce); a
#: larger stage is timed on a prefix of its tensors and scaled by elements, so init never needs much memory.
MAX_TIMED_ELEMENTS = 1 << 24
#: The accumulation into ``.grad`` is timed on up to this many: its two sample sizes (this and half of it) must
#: both overflow an accelerator's L2 cache (50 MB on an H100), or the slope between them is the step from cached
#: to uncached bandwidth rather than the cost per element (a 16 M-element sample of a 175B-shaped layer's bf16
#: gradients, 8 M at half, put its accumulation at 5.3 ms against 3.4 ms in the real backward). Up to 256 MB of
#: bf16 (512 MB of fp32) buffers while timing.
ACCUMULATE_TIMED_ELEMENTS = 1 << 26


def _sample(tensors: list[torch.Tensor], limit: int) -> tuple[list[torch.Tensor], float]:
    """The leading ``limit`` elements of ``tensors`` in order (the last one taken may be a flat prefix of its
    tensor), and total / sampled elements.

    Why a prefix of elements and not of whole tensors: a stage's first tensors are often tiny (a norm's weight)
    and the next one huge (a 12288-wide block's first projection, 450 M elements); stopping before the huge one
    would time two tiny tensors, mostly launch overhead, and scale that by the element ratio (measured on one
    H100: 1.4 s "per backward" for a 175B-shaped layer whose accumulation takes 4 ms).
    """
    total = sum(t.numel() for t in tensors)
    out, taken = [], 0
    for t in tensors:
        if taken >= limit:
            break
        if taken + t.numel() > limit:
            t = t.detach().reshape(-1)[:limit - taken]
        out.append(t)
        taken += t.numel()
    return out, (total / taken if taken else 1.0)


def _scaled_ms(time_of: Callable[[list[torch.Tensor]], float], tensors: list[torch.Tensor], limit: int) -> float:
    """``time_of(tensors)`` for all of ``tensors``, timed on at most ``limit`` elements: a fixed part plus a
    part per element, fitted from the sample and half of it, the per-element part scaled to the whole.

    Why two sizes: a timed call also pays fixed costs (launching the fused kernels, the sync around it) that do not
    grow with the elements; scaling the whole sample's time by total / sampled multiplies them too (measured on one
    H100: a 175B-shaped layer's accumulation into ``.grad`` timed at 6.1 ms on a 16 M-element sample against 3.2 ms
    in the real backward). Where the two times do not give a positive slope (noise on a small sample), the
    sample's time is scaled whole, as an elementwise cost would be.
    """
    total = sum(t.numel() for t in tensors)
    sample, scale = _sample(tensors, limit)
    full_ms = time_of(sample)
    taken = sum(t.numel() for t in sample)
    if taken >= total or taken < 2:
        return full_ms * scale
    half, _ = _sample(tensors, taken // 2)
    half_taken = sum(t.numel() for t in half)
    per_element = (full_ms - time_of(half)) / (taken - half_taken)
    if per_element <= 0:
        return full_ms * scale
    fixed = max(0.0, full_ms - per_element * taken)
    return fixed + per_element * total


def time_optimizer_step(optimizer: Any, clip_norm: float = 0.0, *, warmup: int = 1, repeats: int = 3,
                        limit: int = MAX_TIMED_ELEMENTS) -> float:
    """Milliseconds of one ``optimizer.step()`` (with gradient clipping when ``clip_norm`` > 0) over this rank's
    parameters, measured on copies: a fresh optimizer of the same class and groups steps cloned parameters with
    zero gradients, so the real parameters and optimizer state are untouched. An optimizer step is elementwise,
    so beyond ``limit`` elements prefixes are timed and scaled (:func:`_scaled_ms`). 0 when no torch optimizer is
    found.
    """
    inner = _inner_optimizer(optimizer)
    if inner is None:
        return 0.0
    # the groups carry every hyper-parameter; what the constructor still requires comes from its defaults
    accepted = inspect.signature(type(inner).__init__).parameters
    failed: list[Exception] = []

    def time_of(sampled: list[torch.Tensor]) -> float:
        left = iter(sampled)   # the same order: each group's params, while the sample lasts
        groups = []
        for group in inner.param_groups:
            clones = []
            for part in itertools.islice(left, len(group["params"])):
                c = part.detach().clone().requires_grad_(True)
                c.grad = torch.zeros_like(c)
                clones.append(c)
            if clones:
                groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": clones})
        params = [p for g in groups for p in g["params"]]
        if not params or failed:
            return 0.0
        try:
            copy = type(inner)(groups, **{k: v for k, v in inner.defaults.items() if k in accepted})
        except Exception as err:   # noqa: BLE001 - an optimizer that cannot be rebuilt: leave the term out, say so
            failed.append(err)
            return 0.0

        def step() -> None:
            if clip_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, clip_norm)
            copy.step()

        return _median_ms(step, warmup, repeats)

    ms = _scaled_ms(time_of, [p for g in inner.param_groups for p in g["params"]], limit)
    if failed:
        logger.warning("terapipe: cannot time the optimizer step (%s: %s); the plan leaves it out",
                       type(failed[0]).__name__, failed[0])
        return 0.0
    return ms


def time_grad_accumulation(params: list[torch.nn.Parameter], *, warmup: int = 1, repeats: int = 3,
                           limit: int = ACCUMULATE_TIMED_ELEMENTS) -> float:
    """Milliseconds to add one backward's gradients into ``.grad`` for ``params`` (what every slice's backward
    does beyond the profiled ``torch.autograd.grad``), on buffers of their shapes (prefixes beyond ``limit``,
    :func:`_scaled_ms`).

    Timed as autograd runs it, one ``add_`` per parameter: on one H100 a fused ``_foreach_add_`` over a
    175B-shaped layer's bf16 gradients took 6.3 ms where the real backward paid 3.2-3.8 ms per slice."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return 0.0

    def time_of(sampled: list[torch.Tensor]) -> float:
        acc = [torch.zeros_like(p) for p in sampled]
        new = [torch.ones_like(p) for p in sampled]

        def accumulate() -> None:   # as AccumulateGrad does: an in-place add per parameter, not a fused foreach
            for a, n in zip(acc, new):
                a.add_(n)

        return _median_ms(accumulate, warmup, repeats)

    return _scaled_ms(time_of, params, limit)


def _time_tied_reduce(engine: "PipelineStage", warmup: int, repeats: int) -> float:
    """The tied-weight all-reduce (DeepSpeed's ``allreduce_tied_weight_gradients``) on zero buffers; only the
    ranks of a tied group take part, in DeepSpeed's key order."""
    module = engine.module
    comms = getattr(module, "tied_comms", {}) or {}
    buffers = []
    for key, comm in comms.items():
        for attr in comm["weight_attr"]:
            weight = functools.reduce(getattr, attr.split("."), module.tied_modules[key])   # "wte.weight"
            buffers.append((torch.zeros_like(weight), comm["group"]))
    if not buffers:
        return 0.0

    def reduce() -> None:
        for buf, group in buffers:
            dist.all_reduce(buf, group=group)

    return _median_ms(reduce, warmup, repeats)


def _time_dp_reduce(engine: "PipelineStage", warmup: int, repeats: int) -> float:
    """Data-parallel gradient reduction: one all-reduce of this stage's gradient size over its replicas.

    With one replica the engine skips DeepSpeed's reduction where it is an identity (fp32/fp16, ZeRO 0, no
    pre-divide: ``TokenPipelineEngine.dp_reduce_will_be_identity``): 0 then. Elsewhere one replica still pays
    for it: DeepSpeed moves every gradient through its buffers and back (the fallback flattens, reduces over a group of
    one and copies back; ZeRO 1 and the bf16 optimizer copy into their fp32 partitions), 50-65 ms per step for a
    4 x 512 stage on one CPU core. Timed as that: flatten zero gradients, all-reduce over the group of one, copy
    back. Measured through the example trainer (ZeRO 1, one replica, GPT 8 x 512, seq 256, m = 4): 49-53 ms here
    against 71-152 ms in the steps, where it used to be 0. ZeRO 1's optimizer step stays underestimated (95-139 ms
    in the steps against 21-22 ms for the torch optimizer timed on copies: its norm, unscale and copy-back passes
    are not timed); the re-planner's refit measures both.
    """
    params = [p for p in engine.module.parameters() if p.requires_grad]
    group = engine.grid.get_data_parallel_group()
    if engine.grid.data_parallel_size == 1:
        if not params or engine.dp_reduce_will_be_identity():
            return 0.0
        sampled, scale = _sample(params, MAX_TIMED_ELEMENTS)
        grads = [torch.zeros_like(p) for p in sampled]

        def through_a_buffer() -> None:
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=group)
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
                grad.copy_(reduced)

        return _median_ms(through_a_buffer, warmup, repeats) * scale
    numel = sum(p.numel() for p in params)
    dtype = next((p.dtype for p in engine.module.parameters()), torch.float32)
    # every replica of a stage holds the same parameters, so all members of the group agree on the size
    buf = torch.zeros(max(1, min(numel, MAX_TIMED_ELEMENTS)), dtype=dtype, device=engine.device)
    return _median_ms(lambda: dist.all_reduce(buf, group=group), warmup, repeats) * max(1.0, numel / buf.numel())


def _ping_pong(engine: "PipelineStage", numel: int, dtype: torch.dtype, repeats: int) -> Optional[float]:
    """One-way milliseconds of a ``numel`` message from each rank to the next (rank 0 of every pair reports)."""
    p = engine.num_stages
    if p == 1:
        return None
    me = engine.stage_id
    out = None
    buf = torch.zeros(max(1, numel), dtype=dtype, device=engine.device)
    for sender in range(p - 1):   # each boundary in turn, so no rank is in two pairs at once
        if me not in (sender, sender + 1):
            continue
        peer = engine.grid.stage_to_global(sender + 1 if me == sender else sender)
        times = []
        for rep in range(repeats + 1):
            synchronize()
            t0 = time.perf_counter()
            if me == sender:
                dist.send(buf, peer)
                dist.recv(buf, peer)
            else:
                dist.recv(buf, peer)
                dist.send(buf, peer)
            synchronize()
            if rep:
                times.append((time.perf_counter() - t0) * 1e3 / 2)
        if me == sender:
            out = statistics.median(times)
    return out


def _time_sync(engine: "PipelineStage", warmup: int, repeats: int) -> float:
    """The end-of-step meetings: the engine's barrier and the loss broadcast over the pipeline."""
    loss = torch.zeros(2, device=engine.device)
    group = engine.grid.get_pipe_parallel_group()
    src = engine.last_chunk_global_rank()

    def meet() -> None:
        engine.barrier("the step-cost profile")
        dist.broadcast(loss, src=src, group=group)

    return _median_ms(meet, warmup, repeats)


#: Elements of the message the bandwidth is measured with (the same on every rank: the pairs must agree).
_BANDWIDTH_NUMEL = 1 << 20


def measure_step_terms(engine: "PipelineStage", warmup: int = 1, repeats: int = 3) -> dict[str, Any]:
    """This rank's whole-step terms (collective over all ranks); see the module docstring.

    Returns plain numbers: ``optimizer_ms``, ``grad_reduce_ms``, ``tied_reduce_ms``, ``sync_ms``,
    ``accumulate_ms`` (per backward action), ``handover_ms`` (deferred weight gradients to ``.grad``, once per
    step), ``latency_ms`` and ``gbps`` (to the next rank; None on the last).
    """
    cfg = engine.terapipe
    clip = float(engine.gradient_clipping() or 0.0)
    opt_ms = time_optimizer_step(engine.optimizer, clip, warmup=warmup, repeats=repeats)
    params = [p for p in engine.module.parameters() if p.requires_grad]
    handover_ms = 0.0
    if cfg.deferred_weight_grads:
        # nn.Linear weights (and biases) get theirs from the W passes, summed over the step and handed to .grad
        # once before the reductions (deferred.WeightGradAccumulator): a per-step term; the backward adds the rest
        linears = [m for m in engine.module.modules() if isinstance(m, torch.nn.Linear)]
        deferred = {id(t) for m in linears for t in (m.weight, m.bias) if t is not None}
        handover_ms = time_grad_accumulation([p for p in params if id(p) in deferred], warmup=warmup, repeats=repeats)
        params = [p for p in params if id(p) not in deferred]
    fused = {id(p) for p in engine.fused_parameters()}   # added in their GEMMs: the profiled backward has them
    accumulate_ms = time_grad_accumulation([p for p in params if id(p) not in fused], warmup=warmup, repeats=repeats)
    # the timings above are this rank's own (a copy of the optimizer can run out of memory); the reductions below
    # would not see a peer that failed in them: meet in a barrier that watches the abort flag first
    engine.barrier("timing the step")
    tied_ms = _time_tied_reduce(engine, warmup, repeats)
    dp_ms = _time_dp_reduce(engine, warmup, repeats)
    sync_ms = _time_sync(engine, warmup, repeats)
    latency = _ping_pong(engine, 1, torch.float32, repeats)
    big = _ping_pong(engine, _BANDWIDTH_NUMEL, torch.float32, repeats)
    gbps = None
    if big is not None and latency is not None and big > latency:
        gbps = _BANDWIDTH_NUMEL * 4 * 8.0 / ((big - latency) * 1e6)
    return {"optimizer_ms": opt_ms, "grad_reduce_ms": dp_ms, "tied_reduce_ms": tied_ms, "sync_ms": sync_ms,
            "accumulate_ms": accumulate_ms, "handover_ms": handover_ms, "latency_ms": latency, "gbps": gbps,
            "tied": bool(getattr(engine.module, "tied_comms", None))}

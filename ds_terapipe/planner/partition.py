"""Balanced stages: choose the layer boundaries and the slicing together, with the vocabulary layers counted.

Why: a pipeline runs at the pace of its slowest stage, and in a language model that is usually the one holding the
LM head -- a (hidden x vocab) GEMM plus softmax per token, as costly as several blocks at 50k-256k vocabularies --
or the first, whose dense embedding gradient is written once per slice. Splitting blocks evenly (the naive layout,
``presets.split_layers``) leaves those stages slow; token slicing makes it worse, since the head runs once per
slice on one rank. Two remedies are costed here:

* **Cost-based partitioning**: contiguous layer boundaries over the p ranks (p*v chunks with virtual stages) that
  minimise the simulated step time. The layers are costs (``StageCost`` per layer, e.g.
  ``presets.analytic_layer_costs`` or per-layer profiles), a chunk costs the sum of its layers (:class:`ChunkCost`).
* **Vocabulary parallelism** (VP, Yeung et al., MLSys 2025): the head is split by vocabulary rows over all p ranks;
  per slice every rank pays head/p plus the collectives (:class:`VocabShareCost`): the final hidden states and the
  labels broadcast from the last stage, one small all-reduce of softmax statistics (every rank's max, sum of exp and
  target logit), and in backward a reduce of the hidden-state gradient back to the last stage. The share is charged
  inside each rank's per-slice compute, as if the vocabulary passes were interleaved with the stage's own work; the
  runtime would run them as separate actions in the schedule, so this is the balanced ideal, not a simulated
  schedule.

How (:func:`plan_partition`): start from the naive layout and its best slicing (``plan_slicing``). For a fixed
slicing, a chunk's work is additive over its layers (prefix sums), so the min-max partition is an exact O(K L^2)
dynamic program (:func:`minmax_partition`); candidates are all partitions whose largest chunk work lies within a
window of that optimum (:func:`enumerate_partitions`, depth-first with a feasibility table), ranked by a sound
lower bound on the step time (no rank can finish before its own work) and simulated in that order until the bound
exceeds the best makespan. With an unbounded window that search is exact over all partitions for the slicing
(tests check it against brute force). Then the slicing is re-planned for the winner, and this alternates until
the step time stops improving. The naive layout is always a candidate: never worse than it.
This module imports numpy and the planner only.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ._checks import check_int
from .cost import ArrayLike, PipelineCost, StageCost, VocabShareCost
from .registry import get_schedule
from .schedule import build_schedule
from .simulate import SimResult, simulate
from .slicing import SlicingPlan, plan_slicing

logger = logging.getLogger(__name__)

__all__ = ["ChunkCost", "VocabShareCost", "PartitionPlan", "chunk_costs", "naive_partition", "minmax_partition",
           "enumerate_partitions", "best_partition", "plan_partition", "layer_work", "Layouts", "analytic_layouts"]

#: Partitions simulated per round at most, and the window over the min-max chunk work they are drawn from.
_WINDOW = 0.10
_MAX_CANDIDATES = 256
_MAX_ROUNDS = 4


# --------------------------------------------------------------------------------------------------------------
# Costs of chunks of layers

class ChunkCost(StageCost):
    """The cost of a run of layers: the sum of their costs; the activations sent are the last layer's.

    Layers with equal ``cache_key`` are evaluated once and counted, so a chunk of 40 equal blocks costs 3 model
    evaluations, not 40. ``extra``: costs added on top (a :class:`VocabShareCost`), not counted as layers, each
    weighted ``extra_weight``: a rank runs the vocabulary passes once per slice however many chunks it holds, so
    with v chunks per rank each chunk carries 1/v of the share.
    """

    def __init__(self, layers: Sequence[StageCost], extra: Sequence[StageCost] = (), extra_weight: float = 1.0
                 ) -> None:
        parts = [*layers, *extra]
        if not parts:
            raise ValueError("ChunkCost needs at least one layer; a chunk holds one or more layers")
        counts: Counter = Counter(p.cache_key() for p in layers)
        for p in extra:
            counts[p.cache_key()] += extra_weight
        first: dict[Hashable, StageCost] = {}
        for p in parts:
            first.setdefault(p.cache_key(), p)
        self._parts = [(first[k], n) for k, n in counts.items()]
        self._last = layers[-1] if layers else parts[-1]
        self._key = ("chunk", tuple(sorted(((repr(k), n) for k, n in counts.items()))), self._last.cache_key())

    def _sum(self, name: str, *args: Any) -> Any:
        total = None
        for part, n in self._parts:
            x = n * np.asarray(getattr(part, name)(*args), dtype=float)
            total = x if total is None else total + x
        return total[()] if total.ndim == 0 else total

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self._sum("forward_ms", slice_len, context, batch)

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self._sum("backward_ms", slice_len, context, batch)

    def weight_ms(self, tokens: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self._sum("weight_ms", tokens, batch)

    def comm_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        return self._last.comm_ms(slice_len, batch)

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike | None = None) -> bool:
        return all(p.covers(slice_len, context, batch) for p, _ in self._parts)

    def cache_key(self) -> Hashable:
        return self._key


def _check_parts(parts: Sequence[int], num_layers: int, num_chunks: int) -> tuple[int, ...]:
    parts = tuple(int(x) for x in parts)
    if len(parts) != num_chunks + 1 or parts[0] != 0 or parts[-1] != num_layers or \
            any(b <= a for a, b in zip(parts[:-1], parts[1:])):
        raise ValueError(f"partition {list(parts)} must be {num_chunks + 1} increasing boundaries from 0 to "
                         f"{num_layers} (every chunk holds >= 1 layer); fix the boundaries")
    return parts


def chunk_costs(layers: Sequence[StageCost], parts: Sequence[int], extra: Sequence[StageCost] = (),
                extra_weight: float = 1.0) -> PipelineCost:
    """The pipeline cost of ``layers`` cut at ``parts`` (chunk c holds layers ``parts[c]:parts[c+1]``); every
    chunk also pays ``extra_weight`` x ``extra`` (a vocabulary share; ``1/v`` with v chunks per rank, so each rank
    pays it once). Chunks with equal layer kinds share one cost object."""
    parts = _check_parts(parts, len(layers), len(parts) - 1)
    cache: dict[Hashable, ChunkCost] = {}
    stages = []
    for a, b in zip(parts[:-1], parts[1:]):
        chunk = ChunkCost(layers[a:b], extra, extra_weight)
        stages.append(cache.setdefault(chunk.cache_key(), chunk))
    return PipelineCost(stages, meta={"parts": list(parts)})


# --------------------------------------------------------------------------------------------------------------
# Partitions for a fixed slicing

def naive_partition(num_layers: int, num_chunks: int, *, first: int = 0, last: int = 0) -> tuple[int, ...]:
    """Blocks split evenly (``presets.split_layers``: the remainder to the first chunks), with ``first`` leading
    layers (the embedding) on chunk 0 and ``last`` trailing layers (final norm, head) on the last chunk."""
    num_layers = check_int(num_layers, "num_layers", fix="pass the model's layer count")
    num_chunks = check_int(num_chunks, "num_chunks", fix="pass ranks x virtual stages")
    blocks = num_layers - first - last
    if blocks < num_chunks:
        raise ValueError(f"{blocks} blocks cannot be cut into {num_chunks} chunks of at least one block; use at "
                         f"most {max(blocks, 1)} chunks")
    base, rem = divmod(blocks, num_chunks)
    parts = [0]
    for c in range(num_chunks):
        parts.append(parts[-1] + base + (c < rem) + (first if c == 0 else 0) + (last if c == num_chunks - 1 else 0))
    return tuple(parts)


def layer_work(layers: Sequence[StageCost], slices: Sequence[int], units: int, batch: int = 1) -> np.ndarray:
    """Per layer, the compute it adds to its chunk in one step: ``units`` x sum over slices of forward + backward
    (+ the deferred weight pass). Chunk work is additive over layers, which is what makes the DP exact."""
    lens = np.asarray(slices, dtype=float)
    ctx = np.concatenate([[0.0], np.cumsum(lens)[:-1]])
    seen: dict[Hashable, float] = {}
    out = np.empty(len(layers))
    for i, layer in enumerate(layers):
        key = layer.cache_key()
        if key not in seen:
            f = np.sum(layer.forward_ms(lens, ctx, batch)) + np.sum(layer.backward_ms(lens, ctx, batch))
            w = np.sum(np.broadcast_to(layer.weight_ms(lens, batch), lens.shape))   # every slice's W work
            seen[key] = units * float(f) + units * float(w)
        out[i] = seen[key]
    return out


def minmax_partition(work: Sequence[float], num_chunks: int, extra: float = 0.0) -> tuple[float, tuple[int, ...]]:
    """(smallest possible largest chunk work, a partition reaching it): exact DP over contiguous chunks of >= 1
    layer; each chunk's work is the sum of its layers' plus ``extra``."""
    w = np.asarray(work, dtype=float)
    n = len(w)
    if not 1 <= num_chunks <= n:
        raise ValueError(f"{n} layers cannot be cut into {num_chunks} chunks of at least one layer")
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    seg = prefix[None, :] - prefix[:, None] + extra          # seg[a, b]: chunk [a, b)
    seg = np.where(np.triu(np.ones((n + 1, n + 1), bool), 1), seg, math.inf)   # a chunk holds >= 1 layer
    g = np.full(n + 1, math.inf)
    g[0] = 0.0
    args = []
    for _ in range(num_chunks):
        cand = np.maximum(g[:, None], seg)
        a = cand.argmin(axis=0)
        g = cand[a, np.arange(n + 1)]
        args.append(a)
    parts = [n]
    for a in reversed(args):
        parts.append(int(a[parts[-1]]))
    return float(g[n]), tuple(parts[::-1])


def enumerate_partitions(work: Sequence[float], num_chunks: int, cap: float, extra: float = 0.0,
                         limit: int | None = None) -> Iterator[tuple[int, ...]]:
    """Every partition into ``num_chunks`` chunks whose chunk works (layers + ``extra``) are all <= ``cap``, depth
    first, at most ``limit`` of them. A feasibility table (can layers j.. be cut into k chunks under the cap?)
    keeps every branch productive, so the time is proportional to the partitions produced."""
    w = np.asarray(work, dtype=float)
    n = len(w)
    prefix = np.concatenate([[0.0], np.cumsum(w)])
    tol = 1e-9 * max(1.0, abs(cap))
    ok = prefix[None, :] - prefix[:, None] + extra <= cap + tol      # ok[a, b]: chunk [a, b) fits (b > a)
    feas = np.zeros((num_chunks + 1, n + 1), bool)
    feas[0, n] = True
    for k in range(1, num_chunks + 1):
        for a in range(n):
            feas[k, a] = bool(np.any(ok[a, a + 1:] & feas[k - 1, a + 1:]))
    produced = 0
    stack: list[int] = [0]

    def walk(k: int) -> Iterator[tuple[int, ...]]:
        nonlocal produced
        a = stack[-1]
        for b in range(a + 1, n + 1):
            if limit is not None and produced >= limit:
                return
            if not (ok[a, b] and feas[k - 1, b]):
                continue
            stack.append(b)
            if k == 1:
                produced += 1
                yield tuple(stack)
            else:
                yield from walk(k - 1)
            stack.pop()

    if feas[num_chunks, 0]:
        yield from walk(num_chunks)


@dataclass(frozen=True)
class _Scored:
    parts: tuple[int, ...]
    result: SimResult


def _rank_work(chunk_work: np.ndarray, placement: Sequence[int], num_ranks: int) -> np.ndarray:
    return np.bincount(np.asarray(placement), weights=chunk_work, minlength=num_ranks)


def best_partition(layers: Sequence[StageCost], slices: Sequence[int], *, num_ranks: int, num_microbatches: int = 1,
                   micro_batch_size: int = 1, schedule: str = "gpipe", virtual_stages: int | None = None,
                   extra: Sequence[StageCost] = (), window: float = _WINDOW,
                   max_candidates: int | None = _MAX_CANDIDATES, include: Sequence[Sequence[int]] = ()
                   ) -> tuple[tuple[int, ...], SimResult, bool]:
    """The partition of ``layers`` with the smallest simulated makespan for this slicing, among the candidates:
    every partition whose largest chunk work is within ``window`` of the min-max optimum (``math.inf``: all), at
    most ``max_candidates`` of them, plus ``include``. Returns (parts, its SimResult, exhaustive) where exhaustive
    means no candidate was cut by ``max_candidates`` (with ``window=inf`` the result is then the exact optimum).

    Candidates are simulated in increasing order of a sound bound (a rank cannot finish before its own work), and
    the search stops once that bound reaches the best makespan found.
    """
    spec = get_schedule(schedule)
    v = spec.virtual_stages if virtual_stages is None else virtual_stages
    placement = spec.placement(num_ranks, v)
    num_chunks = num_ranks * v
    units = num_microbatches
    work = layer_work(layers, slices, units, micro_batch_size)
    extra_work = float(layer_work(list(extra), slices, units, micro_batch_size).sum()) / v if extra else 0.0
    opt, opt_parts = minmax_partition(work, num_chunks, extra_work)
    cap = opt * (1.0 + window) if math.isfinite(window) else math.inf
    limit = max_candidates
    found = list(enumerate_partitions(work, num_chunks, cap, extra_work, None if limit is None else limit + 1))
    exhaustive = limit is None or len(found) <= limit
    found = found[:limit] if limit is not None else found
    candidates = list(dict.fromkeys([opt_parts, *(tuple(p) for p in include), *found]))
    prefix = np.concatenate([[0.0], np.cumsum(work)])
    bounds = []
    for parts in candidates:
        p = np.asarray(parts)
        chunk_work = prefix[p[1:]] - prefix[p[:-1]] + extra_work
        bounds.append(float(_rank_work(chunk_work, placement, num_ranks).max()))
    sched = build_schedule(schedule, num_ranks, units, len(slices), virtual_stages=v)
    best: _Scored | None = None
    simulated = 0
    for i in np.argsort(bounds, kind="stable"):
        if best is not None and bounds[i] >= best.result.makespan_ms * (1 - 1e-12):
            break
        res = simulate(sched, chunk_costs(layers, candidates[i], extra, 1.0 / v), list(slices), micro_batch_size)
        simulated += 1
        if best is None or res.makespan_ms < best.result.makespan_ms:
            best = _Scored(candidates[i], res)
    assert best is not None
    logger.debug("best_partition: %d candidates (min-max %.4g ms, cap %.4g), %d simulated, best %s %.4g ms",
                 len(candidates), opt, cap, simulated, best.parts, best.result.makespan_ms)
    return best.parts, best.result, exhaustive


# --------------------------------------------------------------------------------------------------------------
# Partition and slicing together

@dataclass(frozen=True)
class PartitionPlan:
    """Layer boundaries and slicing chosen together, with the naive layout it is compared with.

    ``parts``: chunk c holds layers ``parts[c]:parts[c+1]`` (``parts`` has p*v + 1 entries, DeepSpeed's
    ``PipelineModule.parts``). ``plan``: the slicing for it. ``busy_ms``: per rank, simulated compute per step;
    ``imbalance``: max/mean of it. ``naive_*``: the same for ``naive_parts`` with its own best slicing.
    ``speedup`` = naive step time / this step time. ``vocab_parallel``: the head is split over the ranks (its
    layer is then not in ``parts``' last chunk but shared by all). ``exhaustive``: the last round's search was
    not cut by the candidate limit.
    """

    parts: tuple[int, ...]
    plan: SlicingPlan
    busy_ms: tuple[float, ...]
    naive_parts: tuple[int, ...]
    naive_plan: SlicingPlan
    naive_busy_ms: tuple[float, ...]
    vocab_parallel: bool = False
    exhaustive: bool = True
    cost: PipelineCost | None = field(default=None, repr=False, compare=False)
    """The chunk costs of ``parts`` (what ``simulate`` takes for ``plan``)."""

    @property
    def imbalance(self) -> float:
        return _imbalance(self.busy_ms)

    @property
    def naive_imbalance(self) -> float:
        return _imbalance(self.naive_busy_ms)

    @property
    def speedup(self) -> float:
        return self.naive_plan.predicted_ms / self.plan.predicted_ms if self.plan.predicted_ms > 0 else 1.0

    @property
    def layers_per_chunk(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.parts[:-1], self.parts[1:]))

    def to_dict(self) -> dict[str, Any]:
        return {"parts": list(self.parts), "layers_per_chunk": list(self.layers_per_chunk),
                "slices": list(self.plan.slices), "predicted_ms": self.plan.predicted_ms,
                "busy_ms": list(self.busy_ms), "imbalance": self.imbalance, "naive_parts": list(self.naive_parts),
                "naive_slices": list(self.naive_plan.slices), "naive_ms": self.naive_plan.predicted_ms,
                "naive_busy_ms": list(self.naive_busy_ms), "naive_imbalance": self.naive_imbalance,
                "speedup": self.speedup, "vocab_parallel": self.vocab_parallel, "exhaustive": self.exhaustive}

    def report_lines(self) -> list[str]:
        """The partition report: per-rank busy time, imbalance and speedup over the naive layout."""
        def row(name: str, parts: Sequence[int], plan: SlicingPlan, busy: Sequence[float]) -> list[str]:
            sizes = [b - a for a, b in zip(parts[:-1], parts[1:])]
            return [f"{name:<9}layers per chunk {' '.join(map(str, sizes))}; {plan.num_slices} slices; step "
                    f"{plan.predicted_ms:.4g} ms; imbalance {_imbalance(busy):.3f} (max/mean busy)",
                    f"{'':<9}busy ms per rank {' '.join(f'{b:.4g}' for b in busy)}"]
        vp = " + vocabulary-parallel head" if self.vocab_parallel else ""
        return [*row("naive:", self.naive_parts, self.naive_plan, self.naive_busy_ms),
                *row(f"balanced{vp}:" if vp else "balanced:", self.parts, self.plan, self.busy_ms),
                f"speedup over the naive layout {self.speedup:.3f}x"
                + ("" if self.exhaustive else " (partition search cut at the candidate limit)")]


def _imbalance(busy: Sequence[float]) -> float:
    mean = float(np.mean(busy))
    return float(np.max(busy)) / mean if mean > 0 else 1.0


def _busy(cost: PipelineCost, plan: SlicingPlan) -> tuple[float, ...]:
    sched = build_schedule(plan.schedule, plan.num_stages, plan.num_microbatches * len(plan.batch_splits),
                           plan.num_slices, virtual_stages=plan.virtual_stages)
    return simulate(sched, cost, list(plan.slices), plan.batch_splits[0]).busy_ms


def plan_partition(layers: Sequence[StageCost], seq_len: int, *, num_ranks: int, num_microbatches: int = 1,
                   micro_batch_size: int = 1, granularity: int = 8, schedule: str = "gpipe",
                   virtual_stages: int | None = None, first: int = 1, last: int = 1,
                   vocab_share: StageCost | None = None, max_slices: int | None = None,
                   window: float = _WINDOW, max_candidates: int | None = _MAX_CANDIDATES,
                   max_rounds: int = _MAX_ROUNDS) -> PartitionPlan:
    """Layer boundaries and slicing that minimise the simulated step time of ``layers`` on ``num_ranks`` ranks.

    ``layers``: one cost per layer in model order (``presets.analytic_layer_costs``, or per-layer profiles).
    ``first``/``last``: layers the naive layout pins to the first/last chunk (embedding; final norm and head).
    ``vocab_share``: vocabulary parallelism -- ``layers`` then excludes the head, and every chunk pays this share
    (:class:`VocabShareCost`); the naive layout is then compared *with* VP too, so ``speedup`` isolates the
    partition (compare ``plan.predicted_ms`` of two calls to see what VP buys).
    Slicing arguments are ``plan_slicing``'s. Alternates: best partition for the current slicing
    (:func:`best_partition`), best slicing for that partition, until no round improves by more than 1e-9.
    """
    num_ranks = check_int(num_ranks, "num_ranks", fix="pass the pipeline ranks")
    spec = get_schedule(schedule)
    v = spec.virtual_stages if virtual_stages is None else check_int(virtual_stages, "virtual_stages",
                                                                   fix="use the schedule's chunks per rank")
    extra = () if vocab_share is None else (vocab_share,)
    if vocab_share is not None:
        last = max(0, last - 1)  # the head is not among the layers
    kw = dict(num_microbatches=num_microbatches, micro_batch_size=micro_batch_size, granularity=granularity,
              schedule=schedule, max_slices=max_slices, virtual_stages=v)
    naive = naive_partition(len(layers), num_ranks * v, first=first, last=last)
    naive_cost = chunk_costs(layers, naive, extra, 1.0 / v)
    naive_plan = plan_slicing(naive_cost, seq_len, **kw)
    best_parts, best_plan, exhaustive = naive, naive_plan, True
    slices = naive_plan.slices
    for round_ in range(max_rounds):
        parts, _, exhaustive = best_partition(layers, slices, num_ranks=num_ranks, num_microbatches=num_microbatches,
                                              micro_batch_size=micro_batch_size, schedule=schedule,
                                              virtual_stages=v, extra=extra, window=window,
                                              max_candidates=max_candidates, include=[best_parts])
        plan = plan_slicing(chunk_costs(layers, parts, extra, 1.0 / v), seq_len, **kw)
        logger.debug("plan_partition round %d: parts %s, %d slices, %.4g ms", round_, parts, plan.num_slices,
                     plan.predicted_ms)
        if plan.predicted_ms >= best_plan.predicted_ms - 1e-9:
            break
        best_parts, best_plan, slices = parts, plan, plan.slices
    cost = chunk_costs(layers, best_parts, extra, 1.0 / v)
    result = PartitionPlan(best_parts, best_plan, _busy(cost, best_plan), naive, naive_plan,
                           _busy(naive_cost, naive_plan), vocab_share is not None, exhaustive, cost)
    logger.info("partition: %s", "; ".join(result.report_lines()))
    return result


# --------------------------------------------------------------------------------------------------------------
# The three layouts of a preset model, side by side (CLI and benchmarks)

@dataclass(frozen=True)
class Layouts:
    """Naive (blocks split evenly, head on the last stage), balanced (cost-based boundaries) and, when asked,
    vocabulary-parallel (head split over the ranks, boundaries balanced around it) for one model and pipeline.
    ``balanced.naive_*`` is the naive layout; speedups are over it."""

    balanced: PartitionPlan
    vocab_parallel: PartitionPlan | None = None

    @property
    def chosen(self) -> PartitionPlan:
        return self.vocab_parallel if self.vocab_parallel is not None else self.balanced

    def speedup(self, plan: PartitionPlan) -> float:
        return self.balanced.naive_plan.predicted_ms / plan.plan.predicted_ms

    def to_dict(self) -> dict[str, Any]:
        out = {"naive": {"parts": list(self.balanced.naive_parts), "slices": list(self.balanced.naive_plan.slices),
                         "predicted_ms": self.balanced.naive_plan.predicted_ms,
                         "busy_ms": list(self.balanced.naive_busy_ms), "imbalance": self.balanced.naive_imbalance},
               "balanced": {**self.balanced.to_dict(), "speedup": self.speedup(self.balanced)}}
        if self.vocab_parallel is not None:
            out["vocab_parallel"] = {**self.vocab_parallel.to_dict(), "speedup": self.speedup(self.vocab_parallel)}
        return out

    def report_lines(self) -> list[str]:
        """One row per layout: layers per chunk, slices, step time, speedup over naive, imbalance, busy per rank."""
        b = self.balanced
        rows = [("naive", b.naive_parts, b.naive_plan, b.naive_busy_ms), ("balanced", b.parts, b.plan, b.busy_ms)]
        if self.vocab_parallel is not None:
            vp = self.vocab_parallel
            rows.append(("vocab-par", vp.parts, vp.plan, vp.busy_ms))
        lines = []
        for name, parts, plan, busy in rows:
            sizes = " ".join(str(y - x) for x, y in zip(parts[:-1], parts[1:]))
            speedup = b.naive_plan.predicted_ms / plan.predicted_ms
            lines.append(f"{name:<10}{plan.predicted_ms:>10.4g} ms {speedup:>6.3f}x"
                         f"  imbalance {_imbalance(busy):.3f}  {plan.num_slices:>3} slices  layers/chunk {sizes}")
            lines.append(f"{'':<10}busy ms per rank {' '.join(f'{x:.4g}' for x in busy)}")
        if self.vocab_parallel is not None:
            lines.append(f"{'':<10}vocab-par: head/p + collectives on every rank; layers/chunk without the head")
        return lines


def analytic_layouts(model: Any, device: Any, num_ranks: int, seq_len: int, *, vocab: int | None = None,
                     vocab_parallel: bool = False, bytes_per_element: int = 2, **kwargs: Any) -> Layouts:
    """The layouts of a preset (or ``TransformerSpec``) on a device preset (or ``DeviceSpec``): layers from
    ``presets.analytic_layer_costs`` (embedding, blocks, head); VP collectives over the device's link.
    ``kwargs`` go to :func:`plan_partition` (micro-batches, schedule, granularity, ...)."""
    from .presets import analytic_layer_costs, get_device_preset, resolve_model

    spec = resolve_model(model, vocab)
    dev = get_device_preset(device) if isinstance(device, str) else device
    layers = analytic_layer_costs(spec, dev, bytes_per_element=bytes_per_element)
    balanced = plan_partition(layers, seq_len, num_ranks=num_ranks, **kwargs)
    if not vocab_parallel:
        return Layouts(balanced)
    if spec.vocab < num_ranks:
        raise ValueError(f"vocabulary parallelism splits the vocabulary over the {num_ranks} pipeline ranks but the "
                         f"vocabulary has {spec.vocab} entries; use at most {spec.vocab} ranks or drop it")
    share = VocabShareCost(layers[-1], num_ranks, spec.hidden, link_latency_ms=dev.link_latency_ms,
                           link_gbps=dev.link_gbps, bytes_per_element=bytes_per_element)
    return Layouts(balanced, plan_partition(layers[:-1], seq_len, num_ranks=num_ranks, vocab_share=share, **kwargs))

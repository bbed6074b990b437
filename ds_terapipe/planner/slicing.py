"""Optimal token slicing: cut each sequence into pipeline units so a step finishes soonest.

Why: with K stages, m micro-batches and a sequence cut into slices with per-stage times t_1..t_n, a GPipe step
over equal stages takes (TeraPipe, ICML 2021, eq. 5)

    T = m * sum_i w_i + (K - 1) * max_i t_i

where w_i = forward_i + backward_i is the compute each stage spends on slice i and, with K > 1, t_i = w_i +
2 * comm_i adds the slice's activation send and gradient send, which overlap compute (isend) but lie on the
critical path once per stage boundary. This is exactly the event simulator's makespan (``simulate.py``) when
forward, backward and comm of the slices peak on the same slice (e.g. comm = 0 and backward proportional to
forward); otherwise the simulator's (K-1) * (max(forward+comm) + max(backward+comm)) is up to that much larger
and the closed form is a lower bound. More slices shrink the bubble term; slices are not free because later
ones attend over a longer prefix and short ones underuse the device, so t(s, c) comes from a cost model.

How: every slice length is a multiple of the granularity g, so a slicing is a path 0 -> N = L / g over slice
boundaries. For a threshold tau on max t, the min-sum path with every t_i <= tau is an O(N^2) DP (numpy over
the inner dimension). The optimum is the best m * minsum(tau) + (K-1) * tau over thresholds tau taken from the
distinct slice times, and minsum is a non-increasing step function of tau, so a branch and bound over the sorted
thresholds (``_thresholds``) solves only O(tens) of DPs: each solve settles a whole range of thresholds, and a
range whose best possible score cannot win is dropped. Exact: tests compare it with brute force.

Run ``python benchmarks/planner_speed.py`` for timings.
"""
from __future__ import annotations

import bisect
import heapq
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterator

import numpy as np

from ._checks import MAX_UNITS, check_int, too_many_units
from .cost import PipelineCost
from .registry import accepts_virtual_stages, find_schedule, get_schedule, schedule_names
from .schedule import Schedule, build_schedule
from .simulate import SimResult, simulate

logger = logging.getLogger(__name__)

__all__ = ["MAX_UNITS", "SCHEDULES", "MemoryLimitError", "MemoryModel", "MemoryShortfall", "SlicingPlan",
           "memory_shortfall", "plan_slicing", "too_many_units"]

_INF = math.inf
#: Simulated candidates: distinct min-sum plans whose slowest-stage closed form is within this fraction of the
#: best one, at most _SIM_MAX of them, best closed form first (see plan_slicing).
_SIM_WINDOW = 0.05
_SIM_MAX = 64
#: With virtual stages each distinct slice count is a new schedule whose lowered comm is compiled in Python
#: (~1 s at 48 ranks x 2 chunks x 256 units), so fewer candidates are simulated.
_SIM_MAX_CHUNKS = 16


# --------------------------------------------------------------------------------------------------------------
# Memory

@dataclass(frozen=True)
class MemoryModel:
    """What the memory estimate needs to know about the model split.

    ``num_layers_per_stage``: layers on each stage (one int for all stages, or one per stage).
    ``hidden``: model width. ``bytes_per_element``: 2 for fp16/bf16 activations.
    ``activation_factor``: stashed-activation bytes per token per hidden unit per layer at 16 bits; 34 is
    Korthikanti et al. (2022) without recomputation and with fused attention (no s^2 score term). It is scaled by
    bytes_per_element / 2 for other precisions; pass ~2 for full activation recomputation.
    ``weight_input_factor``: bytes per token per hidden unit per layer at 16 bits that a unit holds between its
    backward and its deferred W: the Linears' inputs and output gradients, 16 values of a GPT block (QKV 1 + 3,
    projection 1 + 1, MLP 1 + 4 and 4 + 1), 32 bytes. Recomputation does not shrink them.
    ``deferred_weight_grads``: whether the run defers its weight gradients to W actions (the runtime's resolved
    ``terapipe.deferred_weight_grads``: off under ``shard_params``, for example); None: each schedule's default. Only
    with deferral do a schedule's waiting W's hold inputs (``ScheduleSpec.held_subbatches``).
    """

    num_layers_per_stage: int | tuple[int, ...]
    hidden: int
    bytes_per_element: int = 2
    activation_factor: float = 34.0
    weight_input_factor: float = 32.0
    deferred_weight_grads: bool | None = None

    def __post_init__(self) -> None:
        layers = self.num_layers_per_stage
        if isinstance(layers, Sequence) and not isinstance(layers, str):
            object.__setattr__(self, "num_layers_per_stage",
                               tuple(check_int(x, f"MemoryModel.num_layers_per_stage[{i}]", minimum=0,
                                               wrong_type=ValueError) for i, x in enumerate(layers)))
        else:
            check_int(layers, "MemoryModel.num_layers_per_stage", minimum=0, wrong_type=ValueError)
        check_int(self.hidden, "MemoryModel.hidden", minimum=1, wrong_type=ValueError)
        check_int(self.bytes_per_element, "MemoryModel.bytes_per_element", minimum=1, wrong_type=ValueError)
        f = self.activation_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 0:
            raise ValueError(f"MemoryModel.activation_factor = {f!r} must be a finite number >= 0; use 34 "
                             "(no recomputation) or ~2 (full recomputation)")
        w = self.weight_input_factor
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"MemoryModel.weight_input_factor = {w!r} must be a finite number >= 0; use 32 "
                             "(a GPT block's Linear inputs and output gradients)")
        if self.deferred_weight_grads not in (None, True, False):
            raise ValueError(f"MemoryModel.deferred_weight_grads = {self.deferred_weight_grads!r} must be True, False "
                             "or None (the schedule's default)")

    @staticmethod
    def factor_for_checkpoint_interval(interval: int, without: float = 34.0) -> float:
        """``activation_factor`` with activation checkpointing every ``interval`` layers (0: none, ``without``).

        A checkpointed segment keeps only its input, ``hidden`` values per token (factor 2 at 16 bits), for its
        ``interval`` layers: 2 / interval per layer. The segment recomputed during one slice's backward holds its
        full activations for that slice only, which this per-unit estimate leaves out.
        """
        check_int(interval, "activation_checkpoint_interval", minimum=0, wrong_type=ValueError)
        return without if interval == 0 else 2.0 / interval

    def layers(self, num_stages: int) -> tuple[int, ...]:
        layers = self.num_layers_per_stage
        if isinstance(layers, tuple):
            if len(layers) != num_stages:
                raise ValueError(f"MemoryModel.num_layers_per_stage has {len(layers)} entries but the cost has "
                                 f"{num_stages} stages; give one count per stage")
            return layers
        return (int(layers),) * num_stages

    @staticmethod
    def live_subbatches(schedule: str, stage: int, num_stages: int, num_units: int, num_slices: int,
                        virtual_stages: int = 1) -> float:
        """Sub-batches' worth of tokens whose activations and KV caches a stage holds at its peak: the
        schedule's registered estimate (``ScheduleSpec.live_subbatches``; e.g. gpipe: all ``num_units``
        micro-batches x splits). It never grows with the slice count, so a memory cap translates into a
        minimum slice count. With virtual stages, ``stage`` is a rank and the estimate covers its chunks.
        """
        return _call_estimate(get_schedule(schedule).live_subbatches, stage, num_stages, num_units, num_slices,
                              virtual_stages)

    @staticmethod
    def held_subbatches(schedule: str, stage: int, num_stages: int, num_units: int, num_slices: int,
                        virtual_stages: int = 1) -> float:
        """Sub-batches' worth of tokens holding activations or W inputs at the stage's peak
        (``ScheduleSpec.held_subbatches``); :meth:`live_subbatches` for schedules whose W inputs do not wait."""
        held = get_schedule(schedule).held_subbatches
        live = MemoryModel.live_subbatches(schedule, stage, num_stages, num_units, num_slices, virtual_stages)
        if held is None:
            return live
        return max(live, _call_estimate(held, stage, num_stages, num_units, num_slices, virtual_stages))

    def peak_bytes(self, *, schedule: str, num_stages: int, num_microbatches: int, micro_batch_size: int,
                   num_splits: int, seq_len: int, num_slices: int, virtual_stages: int = 1) -> float:
        """Estimated peak bytes of the busiest stage: live tokens x layers x hidden x (activations + KV).

        Live tokens = ``live_subbatches`` x (micro_batch_size / num_splits) x seq_len; per token per layer a stage
        stashes hidden * activation_factor * bytes_per_element / 2 activation bytes and keeps a KV cache of
        2 * hidden * bytes_per_element (the cache overlaps with the stashed K and V, so this errs high).
        Weights, gradients and optimizer state are not included: subtract them from the device memory yourself.
        Nor are backward temporaries, and a W right behind its backward or once per micro-batch sits within them:
        it holds the Linears' inputs and output gradients of the micro-batch (about 16 x hidden values per token per
        block, less than the activations its backward freed) plus, while one GEMM per Linear runs over all slices,
        that Linear's rows laid end to end (measured on CPU, 4 GPT blocks x 512, 1024 tokens in 8 slices: step peak
        170 MiB with gpipe's W per micro-batch, 185 MiB without deferral, 129 MiB after the forwards). Where a
        schedule's W's wait behind later work (``ScheduleSpec.held_subbatches``: dualpipev), the units that hold
        only W inputs add ``weight_input_factor`` bytes each, and every held unit costs at least that much (with
        recomputation a unit's activations may be the smaller).
        ``num_stages`` and ``num_layers_per_stage`` are per rank; with ``virtual_stages`` v a rank's layers are cut
        into v chunks and the schedule's estimate counts a unit alive on one chunk as 1/v.
        """
        per_token_layer = self.hidden * (self.activation_factor * self.bytes_per_element / 2.0
                                         + 2.0 * self.bytes_per_element)
        sub_batch = micro_batch_size // num_splits
        units = num_microbatches * num_splits
        spec = get_schedule(schedule)
        deferred = spec.deferred_weight_grads if self.deferred_weight_grads is None else self.deferred_weight_grads
        waits = deferred and spec.held_subbatches is not None
        weight_inputs = self.hidden * self.weight_input_factor * self.bytes_per_element / 2.0
        peak = 0.0
        for s, layers in enumerate(self.layers(num_stages)):
            live = self.live_subbatches(schedule, s, num_stages, units, num_slices, virtual_stages)
            per_unit = live * per_token_layer
            if waits:   # units with activations (each at least its W inputs), then units with W inputs only
                held = self.held_subbatches(schedule, s, num_stages, units, num_slices, virtual_stages)
                per_unit = live * max(per_token_layer, weight_inputs) + (held - live) * weight_inputs
            peak = max(peak, layers * per_unit * sub_batch * seq_len)
        return peak


def _call_estimate(estimate: Callable[..., float], stage: int, num_stages: int, num_units: int, num_slices: int,
                   virtual_stages: int) -> float:
    if virtual_stages == 1:
        return estimate(stage, num_stages, num_units, num_slices)
    return estimate(stage, num_stages, num_units, num_slices, virtual_stages)


# --------------------------------------------------------------------------------------------------------------
# The plan

@dataclass(frozen=True)
class SlicingPlan:
    """A solved plan: how to cut sequences and batches, and what the planner expects it to take.

    ``slices``: tokens per slice, summing to ``seq_len``. ``batch_splits``: sequences per sub-batch, summing to
    ``micro_batch_size`` (``(B,)`` when unsplit); every sub-batch uses the same slices. ``predicted_ms`` and
    ``unsliced_ms`` are the step times with this plan and with whole sequences (stock pipelining);
    ``speedup = unsliced_ms / predicted_ms``. ``memory_bytes`` is the peak estimate when a MemoryModel was given.
    ``num_stages`` is the pipeline ranks; ``virtual_stages`` the chunks per rank the schedule ran with.
    """

    slices: tuple[int, ...]
    batch_splits: tuple[int, ...]
    seq_len: int
    num_stages: int
    num_microbatches: int
    micro_batch_size: int
    granularity: int
    schedule: str
    predicted_ms: float
    unsliced_ms: float
    speedup: float
    bubble_fraction: float
    memory_bytes: float | None = None
    virtual_stages: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "slices", tuple(int(s) for s in self.slices))
        object.__setattr__(self, "batch_splits", tuple(int(b) for b in self.batch_splits))
        if not self.slices or min(self.slices) <= 0 or sum(self.slices) != self.seq_len:
            raise ValueError(f"SlicingPlan.slices = {self.slices} must be positive and sum to seq_len = "
                             f"{self.seq_len}; re-plan for this sequence length")
        if not self.batch_splits or min(self.batch_splits) <= 0 or sum(self.batch_splits) != self.micro_batch_size:
            raise ValueError(f"SlicingPlan.batch_splits = {self.batch_splits} must be positive and sum to "
                             f"micro_batch_size = {self.micro_batch_size}; re-plan for this batch size")
        if find_schedule(self.schedule) is None:
            raise ValueError(f"SlicingPlan.schedule = {self.schedule!r} is unknown; valid: "
                             f"{', '.join(schedule_names())}")

    @property
    def num_slices(self) -> int:
        return len(self.slices)

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe; ``SlicingPlan.from_dict(p.to_dict()) == p``."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["slices"], out["batch_splits"] = list(self.slices), list(self.batch_splits)
        return out

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> SlicingPlan:
        names = [f.name for f in fields(cls)]
        if not isinstance(obj, Mapping):
            raise TypeError(f"SlicingPlan.from_dict needs a dict, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(names))
        missing = [n for n in names if n not in obj and n not in ("memory_bytes", "virtual_stages")]
        if unknown or missing:
            raise ValueError(f"SlicingPlan dict has unknown keys {unknown} / missing keys {missing}; valid keys: "
                             f"{', '.join(names)}")
        return cls(**{n: obj[n] for n in names if n in obj})

    def __str__(self) -> str:
        shown = ", ".join(map(str, self.slices[:8])) + (", ..." if len(self.slices) > 8 else "")
        split = f" x {len(self.batch_splits)} sub-batches of {self.batch_splits[0]}" if len(self.batch_splits) > 1 \
            else ""
        chunks = f" v={self.virtual_stages}" if self.virtual_stages != 1 else ""
        return (f"{self.schedule} K={self.num_stages}{chunks} m={self.num_microbatches} "
                f"B={self.micro_batch_size}{split}: {self.num_slices} slices [{shown}] of L={self.seq_len}; "
                f"{self.predicted_ms:.4g} ms vs "
                f"{self.unsliced_ms:.4g} unsliced ({self.speedup:.2f}x), bubble {100 * self.bubble_fraction:.1f}%")


# --------------------------------------------------------------------------------------------------------------
# The DP over slice boundaries

class _Dp:
    """Min-sum paths 0 -> N over boundaries; slice [a, b) weighs ``w[a, b]`` and is allowed when ``t[a, b] <= tau``.

    ``w`` and ``t`` are (N+1, N+1) with inf where a >= b. Slice counts are limited to [n_min, n_max]:
    unlimited -> one sequential DP (numpy over a); n_min > 1 -> the same with the count as a capped extra axis;
    n_max < N -> layered DP, one min-plus product per slice count.
    """

    def __init__(self, w: np.ndarray, t: np.ndarray, n_min: int, n_max: int) -> None:
        self.n = w.shape[0] - 1
        self.w, self.t = w, t
        self.wt, self.tt = np.ascontiguousarray(w.T), np.ascontiguousarray(t.T)  # [b, a]: rows contiguous in a
        self.n_min, self.n_max = n_min, n_max

    def thresholds(self) -> np.ndarray:
        """The distinct slice times, ascending: the only thresholds at which the DP can change."""
        return np.unique(self.t[np.isfinite(self.t)])

    def max_t(self, cuts: Sequence[int]) -> float:
        return float(max(self.t[a, b] for a, b in zip(cuts[:-1], cuts[1:])))

    def bottleneck(self) -> float:
        """Smallest tau admitting any path (slice counts ignored: a lower bound under count limits)."""
        h = np.full(self.n + 1, _INF)
        h[0] = -_INF
        for b in range(1, self.n + 1):
            h[b] = np.maximum(h[:b], self.tt[b, :b]).min()
        return float(h[self.n])

    def solve(self, tau: float) -> tuple[float, list[int] | None]:
        """(min sum of w over paths with every t <= tau and an allowed slice count, its cut points or None)."""
        if self.n_max < self.n:
            return self._layered(tau)
        if self.n_min > 1:
            return self._capped(tau)
        wm = self.wt if tau == _INF else np.where(self.tt <= tau, self.wt, _INF)
        f = np.full(self.n + 1, _INF)
        f[0] = 0.0
        arg = np.zeros(self.n + 1, dtype=np.int64)
        for b in range(1, self.n + 1):
            v = f[:b] + wm[b, :b]
            a = int(v.argmin())
            f[b], arg[b] = v[a], a
        if not math.isfinite(f[self.n]):
            return _INF, None
        cuts = [self.n]
        while cuts[-1] > 0:
            cuts.append(int(arg[cuts[-1]]))
        return float(f[self.n]), cuts[::-1]

    def _capped(self, tau: float) -> tuple[float, list[int] | None]:
        # State (count so far capped at C = n_min, boundary); C means ">= n_min slices".
        cap = self.n_min
        wm = self.wt if tau == _INF else np.where(self.tt <= tau, self.wt, _INF)
        f = np.full((cap + 1, self.n + 1), _INF)
        f[0, 0] = 0.0
        arg = np.zeros((cap + 1, self.n + 1), dtype=np.int64)
        top_from_top = np.zeros(self.n + 1, dtype=bool)  # state C at b came from state C (else from C - 1)
        rows = np.arange(cap + 1)
        for b in range(1, self.n + 1):
            v = f[:, :b] + wm[b, :b]                      # (C+1, b): from count state c via slice [a, b)
            a = v.argmin(axis=1)
            best = v[rows, a]
            f[1:cap, b], arg[1:cap, b] = best[:cap - 1], a[:cap - 1]
            top_from_top[b] = best[cap] < best[cap - 1]
            src = cap if top_from_top[b] else cap - 1
            f[cap, b], arg[cap, b] = best[src], a[src]
        total = float(f[cap, self.n])
        if not math.isfinite(total):
            return _INF, None
        cuts, state = [self.n], cap
        while cuts[-1] > 0:
            b = cuts[-1]
            prev = cap if (state == cap and top_from_top[b]) else state - 1
            cuts.append(int(arg[state, b]))
            state = prev
        assert state == 0, "capped DP reconstruction must end in the empty state"
        return total, cuts[::-1]

    def _layered(self, tau: float) -> tuple[float, list[int] | None]:
        wm = self.w if tau == _INF else np.where(self.t <= tau, self.w, _INF)
        f = np.full(self.n + 1, _INF)
        f[0] = 0.0
        cols = np.arange(self.n + 1)
        best, best_j, args = _INF, 0, []
        for j in range(1, self.n_max + 1):
            rows = np.flatnonzero(np.isfinite(f))
            cand = f[rows, None] + wm[rows]                 # (rows, N+1): j-th slice [a, b) after j-1 slices
            a = cand.argmin(axis=0)
            f = cand[a, cols]
            args.append(rows[a])
            if j >= self.n_min and f[self.n] < best:
                best, best_j = float(f[self.n]), j
        if best_j == 0:
            return _INF, None
        cuts = [self.n]
        for j in range(best_j, 0, -1):
            cuts.append(int(args[j - 1][cuts[-1]]))
        assert cuts[-1] == 0, "layered DP reconstruction must reach boundary 0"
        return best, cuts[::-1]


def _thresholds(dp: _Dp, units: int, num_stages: int, window: float = 0.0, keep: int = 1
                ) -> tuple[float, list[int] | None, float, list[tuple[float, list[int]]]]:
    """Branch and bound over the sorted distinct slice times used as the threshold tau.

    minsum(tau) is a non-increasing step function. A solve at tau returns the min sum S and the plan's actual
    max M <= tau; minsum is S on all of [M, tau], so those thresholds are settled at once. An open interval of
    thresholds (lo, hi) between two solves has minsum in [S(hi side), S(lo side)]: it is dropped when both are
    equal (constant there) or when units * S(hi side) + (K-1) * (its smallest threshold) is at least
    (1 + window) * the best score found. Intervals are bisected best-bound-first, so the optimum is found early
    and prunes the rest. With window = 0 this is the exact optimiser; with window > 0 it also returns the
    ``keep`` best distinct min-sum plans whose score is within (1 + window) of the optimum (the simulator's
    candidates): once ``keep`` are known, intervals whose bound is no better than the worst of them are dropped.

    Returns (best score, its cuts, minsum(inf), [(score, cuts)] best first).
    """
    km1 = num_stages - 1
    s_inf, cuts = dp.solve(_INF)
    if cuts is None:
        return _INF, None, _INF, []
    best, best_cuts = units * s_inf + km1 * dp.max_t(cuts), cuts
    found = {tuple(cuts): best}              # distinct plans -> score
    kept = [best]                             # the ``keep`` best scores found, ascending
    if km1 == 0:
        return best, best_cuts, s_inf, [(best, cuts)]
    slack = 1.0 + window
    limit = (slack * best - units * s_inf) / km1   # tau >= limit cannot be within the window: minsum >= s_inf
    vals = dp.thresholds()
    heap: list[tuple[float, int, int, float, float]] = []   # (bound, first idx, last idx, S below, S above)

    def push(i: int, j: int, s_below: float, s_above: float) -> None:
        if i <= j and s_below > s_above:
            heapq.heappush(heap, (units * s_above + km1 * float(vals[i]), i, j, s_below, s_above))

    push(int(np.searchsorted(vals, dp.bottleneck(), side="left")), len(vals) - 1, _INF, s_inf)
    solves = 0
    while heap:
        bound, i, j, s_below, s_above = heapq.heappop(heap)
        j = min(j, int(np.searchsorted(vals, limit, side="left")) - 1)
        if i > j or bound >= slack * best or (len(kept) >= keep and bound >= kept[-1]):
            continue
        mid = (i + j) // 2
        total, cuts = dp.solve(float(vals[mid]))
        solves += 1
        if cuts is None:   # infeasible here, so everywhere below
            push(mid + 1, j, _INF, s_above)
            continue
        top = dp.max_t(cuts)
        score = units * total + km1 * top
        if tuple(cuts) not in found:
            found[tuple(cuts)] = score
            bisect.insort(kept, score)
            del kept[keep:]
        if score < best:
            best, best_cuts = score, cuts
            limit = (slack * best - units * s_inf) / km1
        push(i, int(np.searchsorted(vals, top, side="left")) - 1, s_below, total)
        push(mid + 1, j, total, s_above)
    logger.debug("slicing thresholds: N=%d, %d DP solves over %d distinct thresholds", dp.n, solves, len(vals))
    plans = sorted((sc, list(c)) for c, sc in found.items() if sc <= slack * best)
    return best, best_cuts, s_inf, plans[:keep]


# --------------------------------------------------------------------------------------------------------------
# Tables from the cost model

def _action_ms(cost: PipelineCost, stage: int) -> tuple[float, float]:
    """The whole-step model's fixed cost of one forward and one backward action on ``stage`` (0 without one)."""
    if cost.step is None:
        return 0.0, 0.0
    return (cost.step.action_ms("forward", stage, cost.num_chunks),
            cost.step.action_ms("backward", stage, cost.num_chunks))


def _stage_key(cost: PipelineCost, stage: int) -> Any:
    return cost.stages[stage].cache_key(), _action_ms(cost, stage)


def _distinct_stages(cost: PipelineCost) -> dict[Any, tuple[int, Any]]:
    """cache key -> (first stage index, stage model): shared stage models are evaluated once."""
    out: dict[Any, tuple[int, Any]] = {}
    for k, st in enumerate(cost.stages):
        out.setdefault(_stage_key(cost, k), (k, st))
    return out


def _times(stage: int, st: Any, lens: np.ndarray, ctx: np.ndarray, batch: int, action_ms: tuple[float, float]
           = (0.0, 0.0)) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(forward, backward, comm) of one stage model plus its per-action fixed costs, broadcast and checked."""
    shape = np.broadcast_shapes(lens.shape, ctx.shape)
    out = tuple(np.broadcast_to(np.asarray(x, dtype=float), shape) for x in (
        np.asarray(st.forward_ms(lens, ctx, batch)) + action_ms[0],
        np.asarray(st.backward_ms(lens, ctx, batch)) + action_ms[1], st.comm_ms(lens, batch)))
    for name, x in zip(("forward_ms", "backward_ms", "comm_ms"), out):
        if x.size and not (x.min() >= 0 and np.isfinite(x.max())):   # NaN fails the first test
            raise ValueError(f"stage {stage} cost model returned a negative or non-finite {name} for batch "
                             f"{batch}; fix the cost model (a fit extrapolated too far?)")
    return out  # type: ignore[return-value]


def _stage_times(cost: PipelineCost, lens: np.ndarray, ctx: np.ndarray, batch: int
                 ) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per stage (forward, backward, comm) for slices ``lens`` after ``ctx`` (small inputs: keeps all stages)."""
    seen = {key: _times(k, st, lens, ctx, batch, _action_ms(cost, k))
            for key, (k, st) in _distinct_stages(cost).items()}
    return [seen[_stage_key(cost, k)] for k in range(cost.num_chunks)]


def _tables(cost: PipelineCost, n: int, granularity: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(w, t) over all slices [a, b) of the grid for the slowest stage at each slice (inf where a >= b)."""
    w, t, _ = _divisor_tables(cost, n, granularity, batch)
    return w, t


def _divisor_tables(cost: PipelineCost, n: int, granularity: int, batch: int, *, min_len: int = 0,
                    units: int | None = None, virtual_stages: int = 1) -> tuple[np.ndarray, np.ndarray, float]:
    """``_tables`` (slices shorter than ``min_len`` tokens left out) plus, with ``units``, a sound lower bound on
    the simulated makespan of every plan of ``units`` units of ``batch`` sequences (0 without): what lets
    ``plan_slicing`` skip a batch split that cannot win.

    The bound is the work term of ``_Simulated.lower_bounds`` for chunk k, minimised over all slicings by one DP
    per distinct stage model: chunk k starts once slice 0 has crossed chunks < k (``head``), runs units *
    sum(F + B) of its own, and its last backward is a slice 0's (B(k,b,i) waits for B(k,b,i+1)), which then
    crosses chunks < k back (``tail``). Head and tail depend on the first slice only, so they ride on the DP's
    edges out of 0. Chunks sharing a stage model share w; the last of them has the largest head and tail
    (``penalty`` keeps the last one written), so only it is solved.
    """
    # Evaluate on the (start a, length l) grid: contexts (N, 1) x lengths (1, N), so fitted models interpolate
    # over N lengths rather than N^2 slices; half of it (a + l > N) is discarded. One stage at a time, keeping
    # only the running max (48 distinct stages x N^2 would not fit in memory at N = 1024).
    lens = granularity * np.arange(1, n + 1, dtype=float)[None, :]
    ctx = granularity * np.arange(n, dtype=float)[:, None]
    comm_factor = 2.0 if cost.num_chunks > 1 else 0.0
    a, length = np.nonzero(np.arange(n)[:, None] + np.arange(1, n + 1)[None, :] <= n)
    short = length + 1 < min_len / granularity   # (a, l) index pairs of slices below min_len tokens

    def square(grid: np.ndarray) -> np.ndarray:
        out = np.full((n + 1, n + 1), _INF)
        out[a, a + length + 1] = np.where(short, _INF, grid[a, length])
        return out

    stages = _distinct_stages(cost)
    penalty: dict[Any, np.ndarray] = {}   # stage key -> head + tail of its last chunk, by first slice length
    if units is not None:
        zero = np.zeros((1, 1))
        row = {key: [x[0] for x in _times(k, st, lens, zero, batch, _action_ms(cost, k))]
               for key, (k, st) in stages.items()}   # slice 0's (f, b, c) by length
        keys = [_stage_key(cost, k) for k in range(cost.num_chunks)]
        chunk_comm = 1.0 if virtual_stages == 1 else 0.0   # hand-offs inside a rank cost nothing: comm left out
        head = tail = np.zeros(n)   # slice 0's way from chunk 0 down to chunk k, and its gradient's way back
        for k, key in enumerate(keys):
            penalty[key] = head + tail
            if k + 1 < len(keys):
                head = head + row[key][0] + chunk_comm * row[key][2]
                tail = tail + row[key][1] + chunk_comm * row[keys[k + 1]][2]
    w_grid = t_grid = None
    bound = 0.0
    for key, (k, st) in stages.items():
        f, b, c = _times(k, st, lens, ctx, batch, _action_ms(cost, k))
        wk = f + b
        tk = wk + comm_factor * c if comm_factor else wk
        if units is not None:
            edges = square(units * wk)
            edges[0, 1:] += penalty[key]
            bound = max(bound, _Dp(edges, edges, 1, n).solve(_INF)[0])
        w_grid = wk if w_grid is None else np.maximum(w_grid, wk, out=w_grid)
        t_grid = tk.copy() if t_grid is None else np.maximum(t_grid, tk, out=t_grid)
    assert w_grid is not None and t_grid is not None
    return square(w_grid), square(t_grid), bound


# --------------------------------------------------------------------------------------------------------------
# Scoring with the simulator (unequal stages, 1F1B)

class _Simulated:
    """Scores candidate plans with ``simulate`` under the real per-stage costs, skipping hopeless ones."""

    def __init__(self, cost: PipelineCost, schedule: str, seq_len: int, deferred: bool = False,
                 virtual_stages: int = 1) -> None:
        self.cost, self.schedule, self.seq_len, self.deferred = cost, schedule, seq_len, deferred
        self.virtual_stages = virtual_stages
        self.num_ranks = cost.num_chunks // virtual_stages
        self.placement = get_schedule(schedule).placement(self.num_ranks, virtual_stages)
        self._schedules: dict[tuple[int, int], Schedule] = {}
        self.num_simulated = 0

    def run(self, slices: Sequence[int], units: int, batch: int) -> SimResult:
        key = (units, len(slices))
        if key not in self._schedules:
            self._schedules[key] = build_schedule(self.schedule, self.num_ranks, units, len(slices),
                                                  self.deferred, self.virtual_stages)
        self.num_simulated += 1
        return simulate(self._schedules[key], self.cost, list(slices), micro_batch_size=batch)

    def lower_bounds(self, plans: Sequence[Sequence[int]], units: int, batch: int) -> np.ndarray:
        """A sound makespan bound per plan (slices in tokens) from the dependencies every schedule obeys
        (F(k,b,i) after F(k-1,b,i) and F(k,b,i-1); B(k,b,i) after F(k,b,i), B(k+1,b,i), B(k,b,i+1)), with a
        message between stages arriving ``comm_ms`` of the sender after the compute that produced it.

        Work: stage k cannot start before slice 0 crossed stages < k, then works units * sum(F + B), and its
        last backward still crosses stages < k. Path: slice 0 down to stage k, slices 0..i forward on k, slice i
        down to the last stage and back up to k, slices i-1..0 backward on k, slice 0 up to stage 0 -- the
        critical path behind the closed form's (K-1) * max term. The bound is the max over k, i of both.
        Deferred weight gradients (W actions) only add work, so the bound stays sound without them.

        With virtual stages k runs over chunks, and comm is dropped (a hand-off between chunks on one rank costs
        nothing, so charging it could overshoot); each rank also works all its chunks: it starts no earlier than
        its first chunk's head and ends no earlier than its drain, the smallest over its chunks.
        """
        lens = np.concatenate([np.asarray(p, dtype=float) for p in plans])
        starts = np.cumsum([0] + [len(p) for p in plans])
        ctx = lens.cumsum() - lens
        ctx -= np.repeat(ctx[starts[:-1]], np.diff(starts))              # context restarts at each plan
        times = _stage_times(self.cost, lens, ctx, batch)
        fwd, bwd, comm = (np.stack([x[j] for x in times]) for j in range(3))   # (K, total slices) each
        if self.virtual_stages > 1:
            comm = np.zeros_like(comm)
        ranks = np.asarray(self.placement)
        zero = np.zeros(1)
        out = np.empty(len(plans))
        for p in range(len(plans)):
            f, b, c = (x[:, starts[p]:starts[p + 1]] for x in (fwd, bwd, comm))   # (K, n)
            c_fwd = c.copy()
            c_fwd[-1] = 0.0                                                # the last stage sends no activations
            head = np.concatenate([zero, np.cumsum(f[:-1, 0] + c[:-1, 0])])    # slice 0 reaches stage k
            tail = np.concatenate([zero, np.cumsum(b[:-1, 0] + c[1:, 0])])     # slice 0's grad leaves stage k
            drain = np.concatenate([zero, np.cumsum(b.min(axis=1)[:-1] + c.min(axis=1)[1:])])
            work = head + units * (f + b).sum(axis=1) + drain
            down = f[::-1].cumsum(axis=0)[::-1] - f + c_fwd[::-1].cumsum(axis=0)[::-1]   # slice i to the end
            up = b[::-1].cumsum(axis=0)[::-1] + c[::-1].cumsum(axis=0)[::-1] - c       # and back to stage k
            path = head[:, None] + f.cumsum(axis=1) + down + up + (b.cumsum(axis=1) - b) + tail[:, None]
            out[p] = max(float(work.max()), float(path.max()))
            if self.virtual_stages > 1:
                chunk_work = units * (f + b).sum(axis=1)
                for r in range(self.num_ranks):
                    mine = ranks == r
                    bound = head[mine].min() + chunk_work[mine].sum() + drain[mine].min()
                    out[p] = max(out[p], float(bound))
        return out


# --------------------------------------------------------------------------------------------------------------
# The planner

def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


#: Relative slack on a split's lower bound: it sums the same times as the simulator in another order.
_BOUND_SLACK = 1e-9


class _Best:
    """The best plan so far: the smallest value, ties going to the first in search order (split, then candidate),
    which is what one loop over the splits and their candidates keeping each strict improvement returns."""

    def __init__(self) -> None:
        self.value: float | None = None
        self.key: tuple[int, int] = (0, 0)
        self.q, self.cuts, self.result = 1, [0], None

    def may_beat(self, bound: float, key: tuple[int, int]) -> bool:
        """Whether a plan whose value is at least ``bound`` could still win, coming at ``key`` in search order."""
        return self.value is None or bound < self.value or (bound == self.value and key < self.key)

    def offer(self, value: float, key: tuple[int, int], q: int, cuts: list[int], result: Any = None) -> None:
        """Keep the plan if it beats the best so far (its value is exact: its own bound)."""
        if self.may_beat(value, key):
            self.take(value, key, q, cuts, result)

    def take(self, value: float, key: tuple[int, int], q: int, cuts: list[int], result: Any = None) -> None:
        self.value, self.key, self.q, self.cuts, self.result = value, key, q, cuts, result


class _Splits:
    """The batch splits to search, lowest lower bound first (ties in ``options`` order), so the search can stop
    at the first split whose bound cannot beat the best plan found: every later one has a bound at least as high.

    ``tables(q, bounded)`` gives a split's (w, t, bound), the bound only when asked. With several splits each one's
    tables are built twice (for its bound, then for its search), since keeping N^2 tables per divisor would not
    fit at 128 divisors x N = 1024; with one split nothing is bounded and its tables are built once.
    Exact (closed-form) splits are bounded by units * minsum(inf) + (K-1) * bottleneck, with ``units_per_split *
    q`` units: every plan's sum is at least the unconstrained minimum and its max at least any path's smallest.
    """

    def __init__(self, options: Sequence[tuple[int, int]],
                 tables: Callable[[int, bool], tuple[np.ndarray, np.ndarray, float]], *, n_max: int,
                 units_per_split: int, num_stages: int, exact: bool) -> None:
        self._tables = tables
        self._kept: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        entries = []
        for order, (q, n_min) in enumerate(options):
            if len(options) == 1:
                w, t, _ = tables(q, False)
                self._kept[q] = (w, t)
                entries.append((0.0, order, q, n_min))
                continue
            w, t, bound = tables(q, not exact)
            if exact:
                dp = _Dp(w, t, n_min, n_max)
                s_inf = dp.solve(_INF)[0]
                bound = units_per_split * q * s_inf + (num_stages - 1) * dp.bottleneck() if s_inf < _INF else _INF
            entries.append((bound * (1.0 - _BOUND_SLACK), order, q, n_min))
        self._entries = sorted(entries)
        self.next_bound = _INF
        """The bound of the split after the one being searched (inf after the last)."""

    def __iter__(self) -> Iterator[tuple[float, int, int, int, Callable[[], tuple[np.ndarray, np.ndarray]]]]:
        """(bound, place in ``options``, q, minimum slice count, the split's (w, t) when called)."""
        for pos, (bound, order, q, n_min) in enumerate(self._entries):
            self.next_bound = self._entries[pos + 1][0] if pos + 1 < len(self._entries) else _INF
            yield bound, order, q, n_min, lambda q=q: self._kept.pop(q, None) or self._tables(q, False)[:2]


class _Candidates:
    """The simulated candidates of the splits searched so far, simulated in order of their lower bound, each only
    while its bound could still beat the best; the winner is the one a loop over splits and candidates in their
    own order (simulating a candidate when its bound is below the best so far) keeps.

    A bound can exceed its plan's makespan by a rounding error, and then that loop skips a plan whose makespan
    ties the best to the last bits. So ``finish`` simulates every candidate whose bound lies within
    ``_BOUND_SLACK`` of the best and replays that loop over them: only they can hold or decide the result (any
    other plan's makespan is far above every one of their bounds).
    """

    def __init__(self, sim: _Simulated, best: _Best) -> None:
        self.sim, self.best = sim, best
        # (bound, split's place in the options, candidate's place in its list, units, sub-batch, q, cuts, slices)
        self._pending: list[tuple[float, int, int, int, int, int, list[int], list[int]]] = []
        self._all: list[tuple[float, int, int, int, int, int, list[int], list[int]]] = []
        self._results: dict[tuple[int, int], SimResult] = {}

    def add(self, order: int, q: int, units: int, batch: int, plans: list[list[int]],
            slicings: list[list[int]]) -> None:
        for i, (cuts, slices, bound) in enumerate(zip(plans, slicings, self.sim.lower_bounds(slicings, units, batch))):
            entry = (float(bound), order, i, units, batch, q, cuts, slices)
            heapq.heappush(self._pending, entry)
            self._all.append(entry)

    def _simulate(self, entry: tuple[float, int, int, int, int, int, list[int], list[int]]) -> SimResult:
        _, order, i, units, batch, _, _, slices = entry
        if (order, i) not in self._results:
            self._results[order, i] = self.sim.run(slices, units, batch)
        return self._results[order, i]

    def run(self, below: float) -> None:
        """Simulate the pending candidates with a bound under ``below`` (at least one while there is no best)."""
        while self._pending and (self._pending[0][0] < below or self.best.value is None):
            entry = heapq.heappop(self._pending)
            _, order, i, _, _, q, cuts, _ = entry
            if self.best.may_beat(entry[0], (order, i)):
                res = self._simulate(entry)
                self.best.offer(float(res.makespan_ms), (order, i), q, cuts, res)

    def finish(self) -> None:
        """Simulate what is left that could win, then replay the loop over the candidates near the best."""
        self.run(_INF)
        if self.best.value is None:
            return
        limit = self.best.value * (1.0 + _BOUND_SLACK)
        near = [e for e in self._all if e[0] <= limit or e[1:3] == self.best.key]
        floor, winner = _INF, None
        for entry in sorted(near, key=lambda e: e[1:3]):
            if entry[0] < floor:
                res = self._simulate(entry)
                if res.makespan_ms < floor:
                    floor, winner = float(res.makespan_ms), (entry, res)
        assert winner is not None, "the best candidate's own entry is replayed"
        (_, order, i, _, _, q, cuts, _), res = winner
        self.best.take(floor, (order, i), q, cuts, res)


@dataclass(frozen=True)
class MemoryShortfall:
    """Why no plan fits a memory cap, and which changes would lower the smallest estimate (callers phrase them in
    their own terms: the planner's arguments, the CLI's flags)."""

    smallest_bytes: float
    """The smallest peak estimate of any allowed plan (most slices allowed, best batch split)."""
    lower_schedule: str | None
    """The registered schedule with the smallest estimate, where it is below ``smallest_bytes``."""
    split_batch_helps: bool
    """Splitting micro-batches (not asked for) would lower the estimate."""
    more_slices_help: bool
    """Lifting ``max_slices`` would lower the estimate."""

    def fixes(self, *, schedule: str, split_batch: str, max_slices: str) -> list[str]:
        """The changes that would help, in the caller's words (``schedule`` is formatted with the name)."""
        return ([schedule.format(self.lower_schedule)] if self.lower_schedule else []) + \
            ([split_batch] if self.split_batch_helps else []) + ([max_slices] if self.more_slices_help else [])


class MemoryLimitError(ValueError):
    """:func:`plan_slicing`'s refusal of a memory cap no allowed plan meets; ``shortfall`` holds the smallest
    estimate and what would help, for a caller that words the refusal in its own terms (the engine: config keys)."""

    def __init__(self, message: str, shortfall: MemoryShortfall) -> None:
        super().__init__(message)
        self.shortfall = shortfall


def memory_shortfall(memory: MemoryModel, limit_bytes: float, *, schedule: str, num_stages: int,
                     num_microbatches: int, micro_batch_size: int, seq_len: int, granularity: int,
                     max_slices: int | None = None, split_batch: bool = False,
                     virtual_stages: int = 1) -> MemoryShortfall | None:
    """None when some plan allowed by these arguments fits ``limit_bytes``; else what the smallest is and what
    would help. The one memory-feasibility check: ``plan_slicing`` refuses exactly these cases.

    The estimate never grows with the slice count (``ScheduleSpec.live_subbatches``), so the most slices allowed
    give the smallest one, and the other schedules, splits and slice caps are compared there; only schedules
    that run ``virtual_stages`` chunks per rank are suggested (the cost model was built for that many chunks).
    """
    all_slices = seq_len // granularity
    most = all_slices if max_slices is None else min(all_slices, max_slices)

    def smallest(name: str, split: bool, num_slices: int) -> float:
        return min(memory.peak_bytes(schedule=name, num_stages=num_stages, num_microbatches=num_microbatches,
                                     micro_batch_size=micro_batch_size, num_splits=q, seq_len=seq_len,
                                     num_slices=num_slices, virtual_stages=virtual_stages)
                   for q in (_divisors(micro_batch_size) if split else [1]))

    now = smallest(schedule, split_batch, most)
    if now <= limit_bytes:
        return None
    others = {name: smallest(name, split_batch, most) for name in schedule_names() if name != schedule
              and accepts_virtual_stages(get_schedule(name), num_stages, virtual_stages)}
    best = min(others, key=others.__getitem__, default=None)
    return MemoryShortfall(
        smallest_bytes=now,
        lower_schedule=best if best is not None and others[best] < now else None,
        split_batch_helps=not split_batch and smallest(schedule, True, most) < now,
        more_slices_help=most < all_slices and smallest(schedule, split_batch, all_slices) < now)


def plan_slicing(cost: PipelineCost, seq_len: int, *, num_microbatches: int = 1, micro_batch_size: int = 1,
                 granularity: int = 8, schedule: str = "gpipe", memory_limit_bytes: float | None = None,
                 split_batch: bool = False, max_slices: int | None = None,
                 memory: MemoryModel | None = None, deferred_weight_grads: bool = False,
                 virtual_stages: int | None = None, min_slice_len: int | None = None) -> SlicingPlan:
    """The fastest slicing of ``seq_len``-token sequences for this pipeline, cost model and schedule.

    Slice lengths are multiples of ``granularity`` (smaller granularity: finer plans, slower planning); at
    most ``max_slices`` slices if given. What "fastest" means:

    * Equal stages, GPipe: the exact minimiser of the closed form in the module docstring; ``predicted_ms`` is
      that closed form (equal to the simulator's makespan whenever forward, backward and comm peak on the same
      slice, a lower bound on it otherwise).
    * Unequal stages or 1F1B: the closed form is no longer the step time. The DP runs on the slowest stage
      for every slice (w and t maxed over stages) and yields candidates: the distinct min-sum plans (one per
      max-slice threshold) whose slowest-stage closed form is within 5% of that DP's optimum, the 64 best of
      them, plus the unsliced plan. Each is scored by ``simulate`` (``build_schedule(schedule, ...)``) under
      the real per-stage costs; the smallest simulated makespan wins and is ``predicted_ms``. So the plan is
      optimal among those candidates, not over all slicings; a candidate is skipped only when a sound lower
      bound on its makespan (``_Simulated.lower_bounds``) already exceeds the best simulated one. Candidates
      are simulated in order of that bound; the plan is the one a plain loop over them in their own order keeps.

    ``split_batch`` (TeraPipe section 3.4) also splits each micro-batch of ``micro_batch_size`` sequences into
    q equal sub-batches, q dividing the micro-batch size, all with the same token slicing; sub-batches are
    extra pipeline units (m * q of them, costed at batch B / q). Only equal splits are searched because they
    are the only ones the runtime executes. Splits are searched lowest lower bound first (``_divisor_tables``:
    no plan of q sub-batches beats it), and the search stops at the first whose bound cannot beat the best
    plan found. ``memory_limit_bytes`` with ``memory`` (a MemoryModel) keeps only plans whose
    ``MemoryModel.peak_bytes`` estimate fits; for 1F1B that may demand a minimum number of slices.
    Sequence lengths outside what the cost model measured are extrapolated (a warning is logged).
    ``deferred_weight_grads``: the runtime computes weight gradients in ``W`` actions (``schedule.defer_weights``:
    one per micro-batch with gpipe, one per slice with 1f1b); ``cost`` then has ``backward_ms`` without them and
    ``weight_ms`` for W.
    Candidates are always simulated (W changes the critical path; the closed form does not know it).
    With ``cost.vocab`` (vocabulary parallelism) every rank's share of the output layer is added to its chunks'
    forward and backward per slice (:meth:`PipelineCost.folded_vocab`).

    ``virtual_stages`` (None: the schedule's default, 1 for gpipe and 1f1b): chunks per rank. The cost model's
    stages are then *chunks*: ``cost`` has p·v stages for p ranks (build it for p·v, e.g.
    ``analytic_pipeline_cost(model, device, p * v)``; a per-rank profile would have to be split by layers, which
    only the profiler knows). Candidates come from the DP on the slowest chunk with the closed form of the
    interleaved pipeline, v·units·sum(w) + (p-1)·max(t), and are scored by simulating the schedule actually run
    (``build_schedule(schedule, p, ..., virtual_stages=v)``), the 16 best rather than 64 (each distinct slice
    count compiles a new chunk schedule). ``memory`` is per rank (p layer counts).
    ``SlicingPlan.num_stages`` is p.

    ``min_slice_len``: no slice shorter than this many tokens (the whole sequence excepted, when it is shorter).
    A measured cost model knows nothing below its shortest profiled slice, and a fit extrapolated there can make
    tiny slices look free (a profile from 256 tokens up planned 256 slices of 8 tokens, 4x slower than its
    16 slices of ~128); the runtime passes its shortest profiled length.
    """
    if not isinstance(cost, PipelineCost):
        raise TypeError(f"cost must be a PipelineCost, got {type(cost).__name__}; build one with "
                        "PipelineCost.from_dict / load_cost_file / presets.analytic_pipeline_cost")
    granularity = check_int(granularity, "granularity", fix="use a positive token count such as 8")
    seq_len = check_int(seq_len, "seq_len", fix="pass the training sequence length")
    if seq_len < granularity:
        raise ValueError(f"seq_len = {seq_len} is smaller than granularity = {granularity}; lower the granularity")
    if seq_len % granularity:
        raise ValueError(f"seq_len = {seq_len} is not a multiple of granularity = {granularity}; pick a "
                         f"granularity dividing it (e.g. {math.gcd(seq_len, granularity)})")
    too_fine = too_many_units(seq_len, granularity)
    if too_fine:
        raise ValueError(too_fine)
    if min_slice_len is not None:
        min_slice_len = check_int(min_slice_len, "min_slice_len", fix="pass a token count, or None for no floor")
    m = check_int(num_microbatches, "num_microbatches", fix="pass the micro-batches per step (>= 1)")
    batch = check_int(micro_batch_size, "micro_batch_size", fix="pass the sequences per micro-batch (>= 1)")
    if cost.has_weight_terms and not deferred_weight_grads:
        raise ValueError("cost was measured with deferred weight gradients (a stage has weight_ms_per_token / "
                         "weight_ms_per_slice, and its backward_ms leaves them out), but deferred_weight_grads is "
                         "False: the plan would leave the weight-gradient work out of every step; pass "
                         "deferred_weight_grads=True, or use a cost measured without deferral")
    spec = get_schedule(schedule)
    n = seq_len // granularity
    n_max = n if max_slices is None else min(n, check_int(max_slices, "max_slices", fix="use None for no cap"))
    if memory is not None and not isinstance(memory, MemoryModel):
        raise TypeError(f"memory must be a MemoryModel, got {type(memory).__name__}")
    if memory_limit_bytes is not None:
        lim = memory_limit_bytes
        if isinstance(lim, bool) or not isinstance(lim, (int, float)) or not math.isfinite(lim) or lim <= 0:
            raise ValueError(f"memory_limit_bytes = {lim!r} must be a finite number > 0; pass bytes or None")
        if memory is None:
            raise ValueError(f"memory_limit_bytes = {lim!r} needs memory=MemoryModel(num_layers_per_stage, hidden, "
                             "bytes_per_element) to estimate a plan's memory (see presets.preset_memory_model)")
    v = spec.virtual_stages if virtual_stages is None else check_int(
        virtual_stages, "virtual_stages", fix="use 1, or the chunks per rank of a schedule with virtual stages")
    if cost.num_chunks % v:
        raise ValueError(f"cost has {cost.num_chunks} stages, not a multiple of virtual_stages = {v}: the cost "
                         f"model's stages are chunks (ranks x virtual stages); build it for p * {v} chunks")
    num_stages = cost.num_chunks // v   # pipeline ranks
    spec.placement(num_stages, v)       # refuses a v the schedule cannot run, with its rule and fix
    # with vocabulary parallelism every rank pays its share of the output layer per slice; the candidates are
    # scored on the schedule without the passes, so the share rides on the chunks (planner/cost.py)
    cost = cost.folded_vocab(v)
    if memory is not None:
        memory.layers(num_stages)  # validates the per-rank layer counts against the cost
    if not cost.covers(np.array([granularity, seq_len, granularity]), np.array([0, 0, seq_len - granularity]), batch):
        logger.warning("the cost model does not cover slices of %d..%d tokens with up to %d context at batch %d: "
                       "times are extrapolated; profile that range for a reliable plan", granularity, seq_len,
                       seq_len - granularity, batch)

    def peak(q: int, num_slices: int) -> float | None:
        if memory is None:
            return None
        return memory.peak_bytes(schedule=schedule, num_stages=num_stages, num_microbatches=m,
                                 micro_batch_size=batch, num_splits=q, seq_len=seq_len, num_slices=num_slices,
                                 virtual_stages=v)

    if memory is not None and memory_limit_bytes is not None:
        short = memory_shortfall(memory, memory_limit_bytes, schedule=schedule, num_stages=num_stages,
                                 num_microbatches=m, micro_batch_size=batch, seq_len=seq_len,
                                 granularity=granularity, max_slices=max_slices, split_batch=split_batch,
                                 virtual_stages=v)
        if short is not None:
            fixes = ["raise the limit", "add stages", *short.fixes(schedule="use schedule={!r}",
                                                                    split_batch="split_batch=True",
                                                                    max_slices="raise max_slices")]
            raise MemoryLimitError(f"memory_limit_bytes = {memory_limit_bytes:.4g} cannot be met: the smallest "
                                   f"estimated peak is {short.smallest_bytes:.4g} bytes; {', '.join(fixes)}, or "
                                   "recompute activations (MemoryModel.activation_factor)", short)
    options: list[tuple[int, int]] = []  # (splits q, minimum slice count the memory cap allows)
    for q in _divisors(batch) if split_batch else [1]:
        n_min = 1
        if memory_limit_bytes is not None:
            fits = [k for k in range(1, n_max + 1) if peak(q, k) <= memory_limit_bytes]  # type: ignore[operator]
            if not fits:
                continue
            n_min = fits[0]
        options.append((q, n_min))

    exact = spec.dp_exact and cost.is_uniform() and not deferred_weight_grads and \
        len({_action_ms(cost, k) for k in range(cost.num_chunks)}) == 1
    sim = None if exact else _Simulated(cost, schedule, seq_len, deferred_weight_grads, v)
    min_len = min(min_slice_len, seq_len) if min_slice_len is not None and min_slice_len > granularity else 0
    window = 0.0 if exact else _SIM_WINDOW
    # v chunk-units per unit on every rank: the interleaved closed form v*units*sum(w) + (p-1)*max(t).
    keep = 1 if exact else (_SIM_MAX if v == 1 else _SIM_MAX_CHUNKS)
    best = _Best()
    searched = _Splits(options, lambda q, bounded: _divisor_tables(
        cost, n, granularity, batch // q, min_len=min_len, units=m * q if bounded else None, virtual_stages=v),
        n_max=n_max, units_per_split=m * v, num_stages=num_stages, exact=exact)
    candidates = None if sim is None else _Candidates(sim, best)
    for q_bound, order, q, n_min, tables in searched:
        if not best.may_beat(q_bound, (order, -1)):
            break   # every split left has a bound at least this one's: none can win
        units, sub = m * q, batch // q
        value, cuts, _, scored = _thresholds(_Dp(*tables(), n_min, n_max), units * v, num_stages, window, keep)
        if cuts is None:
            continue
        if candidates is None:
            best.offer(value, (order, 0), q, cuts)
            continue
        plans = [c for _, c in scored]   # distinct, best closed form first
        if n_min == 1 and [0, n] not in plans:
            plans.append([0, n])  # the unsliced plan is always a candidate: never plan worse than stock
        candidates.add(order, q, units, sub, plans, [[granularity * (y - x) for x, y in zip(c[:-1], c[1:])]
                                                     for c in plans])
        logger.debug("q=%d: %d candidate plans (window %.3f), %d simulated so far", q, len(plans), window,
                     candidates.sim.num_simulated)
        candidates.run(below=searched.next_bound)
    if candidates is not None:
        candidates.finish()
    if best.value is None:  # only possible when the slice-count limits exclude every plan
        raise ValueError(f"no slicing of seq_len = {seq_len} at granularity {granularity} has between the "
                         f"{min(o[1] for o in options)} slices the memory cap needs and max_slices = {max_slices}; "
                         "raise max_slices or the memory limit")
    value, q, cuts, res = best.value, best.q, best.cuts, best.result
    slices = tuple(granularity * (y - x) for x, y in zip(cuts[:-1], cuts[1:]))

    # Unsliced reference: whole sequences, unsplit micro-batches, same schedule and cost.
    if exact:
        w_full, t_full = _tables(cost, 1, seq_len, batch)
        unsliced = m * float(w_full[0, 1]) + (num_stages - 1) * float(t_full[0, 1])
        idle = (num_stages - 1) * _plan_max_t(cost, slices, batch // q, num_stages) if num_stages > 1 else 0.0
        bubble = idle / value if value > 0 else 0.0
    else:
        assert sim is not None
        unsliced = float(sim.run([seq_len], m, batch).makespan_ms)
        bubble = float(res.bubble_fraction)
    # The whole step: what follows the schedule (optimizer, gradient reductions, sync) is the same for every plan.
    tail = 0.0 if cost.step is None else cost.step.tail_ms(num_stages)
    value, unsliced = value + tail, unsliced + tail
    plan = SlicingPlan(slices=slices, batch_splits=(batch // q,) * q, seq_len=seq_len, num_stages=num_stages,
                       num_microbatches=m, micro_batch_size=batch, granularity=granularity, schedule=schedule,
                       predicted_ms=float(value), unsliced_ms=unsliced,
                       speedup=unsliced / value if value > 0 else 1.0, bubble_fraction=bubble,
                       memory_bytes=peak(q, len(slices)), virtual_stages=v)
    logger.debug("slicing plan: %s", plan)
    return plan


def _plan_max_t(cost: PipelineCost, slices: Sequence[int], batch: int, num_stages: int) -> float:
    """max_i t_i of a plan on the slowest stage (the closed form's bubble term per stage boundary)."""
    lens = np.asarray(slices, dtype=float)
    ctx = np.concatenate([[0.0], np.cumsum(lens)[:-1]])
    times = _stage_times(cost, lens, ctx, batch)
    comm_factor = 2.0 if num_stages > 1 else 0.0
    return float(np.max([f + bw + comm_factor * c for f, bw, c in times]))


def __getattr__(name: str) -> Any:
    if name == "SCHEDULES":  # kept for callers from before the registry: the registered names, read now
        return schedule_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

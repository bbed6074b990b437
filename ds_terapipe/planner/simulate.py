"""Event simulation of a schedule under a cost model: makespan, bubble, memory in flight, timeline.

The semantics are the runtime's (and :func:`~ds_terapipe.planner.schedule.replay`'s): each stage runs its
stream in order, one compute action at a time; a send is issued when the stream reaches it and costs the stream
nothing (isend); a receive blocks the stream until ``send issue time + comm_ms`` of the sender. F(s,b,i) costs
``cost.chunk(s).forward_ms(slices[i], context=sum(slices[:i]), batch)``; B likewise with ``backward_ms``; a W
(deferred weight gradients) ``weight_ms(sum(slices), batch)`` for a whole micro-batch (one pass over all its
tokens, as the runtime computes it), ``weight_ms(slices[i], batch)`` when the schedule has one W per slice (0 for
cost models without ``weight_ms``). A cost model with a whole-step part (``cost.step``,
:mod:`~ds_terapipe.planner.step_cost`) adds its fixed cost to every action and its tail after the makespan
(``SimResult.step_ms``).

Speed matters (the slicing planner simulates many candidate plans), so the simulation is a lock-step sweep
vectorised across stages with numpy: each sweep advances every stage whose next action's dependency is done, so
the Python loop runs about ``2 * (units + stages)`` times, not once per action. The cost-independent part
(dependency indices) is derived once per schedule object and cached. For the comm lowering the runtime uses
(:func:`~ds_terapipe.planner.schedule.add_communication`) the receives are folded into the compute they precede:
``start F(s,b,i) = max(stage free, end F(s-1,b,i) + comm)``; hand-written comm is simulated action by action.
Example::

    python -c "from ds_terapipe.planner.simulate import *; help(simulate)"
"""
from __future__ import annotations

import logging
import operator
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple, Protocol

import numpy as np

from .schedule import Action, ActionKind, DeadlockError, PairingError, Schedule, add_communication
from .verify import match_messages, replay

logger = logging.getLogger(__name__)

__all__ = ["DeadlockError", "PairingError", "SimResult", "StageCostLike", "TimedAction", "simulate"]

# Node codes in the compiled program (also the row of the cost table). Point-to-point comm and padding cost
# nothing as nodes (a message's time is its receiver's delay); the vocabulary collectives cost their pass.
_F, _B, _COMM, _W = 0, 1, 2, 3
_VF, _VB, _EF, _EB = 4, 5, 6, 7
_CODE = {ActionKind.FORWARD: _F, ActionKind.BACKWARD: _B, ActionKind.WEIGHT: _W, ActionKind.VOCAB_F: _VF,
         ActionKind.VOCAB_B: _VB, ActionKind.VOCAB_EMBED_F: _EF, ActionKind.VOCAB_EMBED_B: _EB}
_COLLECTIVE_ROWS = {_VF: "VF", _VB: "VB", _EF: "EF", _EB: "EB"}
_NEVER = np.iinfo(np.int64).max // 2  # dependency position of a receive that has no send: never ready


class StageCostLike(Protocol):
    """What :func:`simulate` needs from ``cost.chunk(s)`` (``ds_terapipe.planner.cost.StageCost`` fits)."""

    def forward_ms(self, slice_len: Any, context: Any, batch: int = 1) -> Any: ...
    def backward_ms(self, slice_len: Any, context: Any, batch: int = 1) -> Any: ...
    def comm_ms(self, slice_len: Any, batch: int = 1) -> Any: ...
    # optional: weight_ms(tokens, batch) for W actions


class TimedAction(NamedTuple):
    """One compute action placed in time; the common event type of simulated and measured timelines."""

    stage: int
    action: Action
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms


@dataclass(frozen=True)
class _Program:
    """The cost-independent part of a simulation, as flat arrays over nodes.

    Stage s's p-th node has index ``s * W + p`` with ``W = L + 1`` (L: longest stream). Index ``s * W + L`` is a
    sentinel that is done at time 0 (the dependency of nodes that wait on nobody); index ``K * W`` is never
    done (the dependency of a receive that no one sends to).
    """

    num_stages: int
    width: int              # W
    kind: np.ndarray        # (K*W+1,) int8: _F, _B, _W, a collective's code or _COMM (sentinels: _COMM)
    slice_idx: np.ndarray   # (K*W+1,) slice of the node's unit
    dep: np.ndarray         # (K*W+1,) node that must finish first
    delay_stage: np.ndarray  # (K*W+1,) chunk whose comm_ms delays the node after its dependency; -1: none
    chunk: np.ndarray       # (K*W+1,) chunk whose cost the node takes (its rank's row when v = 1)
    length: np.ndarray      # (K,) real nodes per stage
    compute: tuple[tuple[Action, ...], ...]   # compute actions per stage, stream order
    compute_node: tuple[np.ndarray, ...]      # their node indices
    peak_in_flight: tuple[int, ...]
    group: np.ndarray       # (K*W+1,) the collective a node is one rank's part of (-1: none), see _sweep
    group_size: np.ndarray  # (G,) ranks per collective: it starts when all of them stand at it


_programs: dict[int, _Program] = {}


def _program(schedule: Schedule) -> _Program:
    """Compile once per schedule object (builders are memoised, so the planner's repeated sizes hit this)."""
    key = id(schedule)
    prog = _programs.get(key)
    if prog is None:
        prog = _compile(schedule)
        _programs[key] = prog
        weakref.finalize(schedule, _programs.pop, key, None)
    return prog


def _compile(schedule: Schedule) -> _Program:
    """Folded program for compute-only schedules (and the standard lowering); exact nodes for other comm and
    for several chunks per rank (whose lowering may post receives early: each one is a node)."""
    if not schedule.is_one_chunk_per_rank:
        return _compile_full(add_communication(schedule))
    if schedule.has_comm and schedule.stages != add_communication(schedule.compute_only()).stages:
        return _compile_full(schedule)
    K, n = schedule.num_stages, schedule.num_slices
    streams = schedule.compute_only().stages
    W = max(len(st) for st in streams) + 1
    lengths = [len(st) for st in streams]
    flat = [a for st in streams for a in st]
    real = np.arange(W)[None, :] < np.array(lengths)[:, None]  # (K, W) mask of real nodes, stage-major
    kind = np.full((K, W), _COMM, np.int8)
    slice_idx = np.zeros((K, W), np.int64)
    unit = np.zeros((K, W), np.int64)  # microbatch * n + slice: to compare unit orders across stages
    kind[real] = np.fromiter([_CODE[a.kind] for a in flat], np.int8, len(flat))
    slice_idx[real] = np.fromiter([a.slice for a in flat], np.int64, len(flat))
    unit[real] = np.fromiter([a.microbatch for a in flat], np.int64, len(flat)) * n + slice_idx[real]
    fpos = [np.flatnonzero(kind[s] == _F) for s in range(K)]
    bpos = [np.flatnonzero(kind[s] == _B) for s in range(K)]
    for s in range(1, K):
        # "The k-th F waits for the neighbour's k-th F" is FIFO pairing; it means "the same unit" only when
        # neighbours agree on the unit order. If they do not, replay names the mis-paired messages.
        if not (np.array_equal(unit[s, fpos[s]], unit[s - 1, fpos[s - 1]])
                and np.array_equal(unit[s, bpos[s]], unit[s - 1, bpos[s - 1]])):
            _raise_from_replay(schedule)
    node = np.arange(K)[:, None] * W + np.arange(W)
    dep = np.repeat(np.arange(K)[:, None] * W + (W - 1), W, axis=1)  # the stage's done sentinel
    delay_stage = np.full((K, W), -1, np.int64)
    for s in range(K):
        if s > 0:
            dep[s, fpos[s]] = node[s - 1, fpos[s - 1]]
            delay_stage[s, fpos[s]] = s - 1
        if s < K - 1:
            dep[s, bpos[s]] = node[s + 1, bpos[s + 1]]
            delay_stage[s, bpos[s]] = s + 1
    chunk = np.repeat(np.arange(K)[:, None], W, axis=1)
    return _finish(schedule, kind, slice_idx, dep, delay_stage, chunk, lengths, streams)


def _compile_full(schedule: Schedule) -> _Program:
    """Comm as actions: every action is a node; a receive depends on its FIFO-matched send, delayed by the
    sending chunk's comm_ms. Within a rank, stream order carries everything else (local hand-offs too)."""
    K = schedule.num_stages
    matches = match_messages(schedule)  # raises PairingError
    streams = schedule.stages
    W = max(len(st) for st in streams) + 1
    dep = np.repeat(np.arange(K)[:, None] * W + (W - 1), W, axis=1)
    delay_stage = np.full((K, W), -1, np.int64)
    kind = np.full((K, W), _COMM, np.int8)
    slice_idx = np.zeros((K, W), np.int64)
    chunk = np.repeat(np.arange(K)[:, None], W, axis=1)
    code = {k: _CODE.get(k, _COMM) for k in ActionKind}
    for s, st in enumerate(streams):   # per stream: lists, then one numpy assignment (not per element)
        n = len(st)
        kind[s, :n] = [code[a.kind] for a in st]
        slice_idx[s, :n] = [a.slice for a in st]
        chunk[s, :n] = [a.chunk for a in st]
        match = matches[s]
        recvs = [p for p, a in enumerate(st) if a.kind is ActionKind.RECV_F or a.kind is ActionKind.RECV_B]
        if recvs:
            src = [match.get(p) for p in recvs]
            dep[s, recvs] = [K * W if m is None else m[0] * W + m[1] for m in src]
            delay_stage[s, recvs] = [-1 if m is None else streams[m[0]][m[1]].chunk for m in src]
    compute = tuple(tuple(a for a in st if a.is_compute) for st in streams)
    # A collective (VF/VB/EF/EB of one unit) is one node per rank; the nodes of one form a group.
    group = np.full((K, W), -1, np.int64)
    ids: dict[tuple[ActionKind, int, int], int] = {}
    for s, st in enumerate(streams):
        for p, a in enumerate(st):
            if a.is_collective:
                group[s, p] = ids.setdefault((a.kind, a.microbatch, a.slice), len(ids))
    return _finish(schedule, kind, slice_idx, dep, delay_stage, chunk, [len(st) for st in streams], compute, group)


def _finish(schedule: Schedule, kind: np.ndarray, slice_idx: np.ndarray, dep: np.ndarray,
            delay_stage: np.ndarray, chunk: np.ndarray, lengths: list[int],
            compute: tuple[tuple[Action, ...], ...], group: np.ndarray | None = None) -> _Program:
    K, W = kind.shape
    if group is None:
        group = np.full((K, W), -1, np.int64)

    def flat(x: np.ndarray, pad: int) -> np.ndarray:
        return np.append(x.ravel(), np.array([pad], x.dtype))

    compute_node = tuple(s * W + np.flatnonzero((kind[s] != _COMM) & (kind[s] <= _W)) for s in range(K))
    assert all(len(c) == len(a) for c, a in zip(compute_node, compute)), "compute nodes out of sync"
    return _Program(K, W, flat(kind, _COMM), flat(slice_idx, 0), flat(dep, K * W), flat(delay_stage, -1),
                    flat(chunk, 0), np.array(lengths, np.int64), compute, compute_node, _peaks(kind),
                    flat(group, -1), np.bincount(group[group >= 0], minlength=int(group.max(initial=-1)) + 1))


def _peaks(kind: np.ndarray) -> tuple[int, ...]:
    """Max units forwarded but not yet backwarded, per stage: activations (and KV caches) held in memory."""
    change = (kind == _F).astype(np.int64) - (kind == _B)
    return tuple(int(x) for x in np.maximum(np.cumsum(change, axis=1).max(axis=1, initial=0), 0))


def _raise_from_replay(schedule: Schedule) -> None:
    """Let replay produce the error (with its grid); reaching the end means the two executors disagree."""
    replay(schedule)
    raise AssertionError(f"simulate found {schedule.name!r} not executable but replay ran it")


@dataclass(frozen=True)
class SimResult:
    """Predicted timing of one schedule under one cost model.

    ``peak_in_flight[s]`` counts units forwarded but not yet backwarded on stage s: the activation memory the
    schedule needs, in units. ``events`` (compute actions only; comm costs the compute stream nothing) are built
    on first access, since the planner mostly reads the makespan. ``tail_ms``: what the step costs after the
    schedule (``StepCost.tail_ms``; 0 without a step cost); ``step_ms`` = makespan + tail, the whole step.
    """

    makespan_ms: float
    busy_ms: tuple[float, ...]
    bubble_fraction: float
    peak_in_flight: tuple[int, ...]
    _program: _Program = field(repr=False, compare=False)
    _start: np.ndarray = field(repr=False, compare=False)
    _end: np.ndarray = field(repr=False, compare=False)
    tail_ms: float = 0.0

    @property
    def step_ms(self) -> float:
        return self.makespan_ms + self.tail_ms

    @cached_property
    def events(self) -> tuple[TimedAction, ...]:
        out = []
        for s, (actions, nodes) in enumerate(zip(self._program.compute, self._program.compute_node)):
            starts, ends = self._start[nodes].tolist(), self._end[nodes].tolist()
            out.extend(TimedAction(s, a, t0, t1) for a, t0, t1 in zip(actions, starts, ends))
        return tuple(out)


def _cost_table(cost: Any, K: int, slices: Sequence[int], batch: int, weights_per_slice: bool = False,
                virtual_stages: int = 1, collectives: bool = False) -> np.ndarray:
    """(8, K, n) forward, backward, comm and weight-gradient times of the K chunks, then the vocabulary passes
    VF, VB, EF, EB of each slice (the same on every rank: each holds an equal shard); the cost model is asked once
    per chunk, vectorised. Row 3 is the W of slice i, or of the whole micro-batch in every column; 0 without
    weight_ms. ``collectives``: the schedule has vocabulary passes, which ``cost.vocab`` must cost."""
    num = getattr(cost, "num_chunks", K)
    if num != K:
        if virtual_stages == 1:
            raise ValueError(f"cost model has num_chunks={num} but the schedule has {K} stages; "
                             f"build the cost for the same pipeline depth")
        raise ValueError(f"cost model has num_chunks={num} but the schedule has {K} chunks ({K // virtual_stages} "
                         f"ranks x {virtual_stages} virtual stages); a cost model has an entry per chunk: build it "
                         f"for {K} chunks (e.g. analytic_pipeline_cost(model, device, {K}))")
    if not callable(getattr(cost, "chunk", None)):
        raise TypeError(f"cost must have a .chunk(c) method (like PipelineCost), got {type(cost).__name__}")
    lens = np.asarray(slices, dtype=np.int64)
    context = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
    table = np.zeros((8, K, len(lens)))
    if collectives:
        vocab = getattr(cost, "vocab", None)
        if vocab is None:
            raise ValueError("the schedule has vocabulary-parallel collectives (VF/VB/EF/EB) but the cost model has "
                             "no cost for them (cost.vocab is None); give PipelineCost(..., vocab=VocabShareCost(...)) "
                             "or simulate the schedule without its vocabulary passes")
        for row, name in _COLLECTIVE_ROWS.items():
            got = np.broadcast_to(np.asarray(vocab.pass_ms(name, lens, batch), dtype=float), lens.shape)
            if not np.all(np.isfinite(got)) or np.any(got < 0):
                raise ValueError(f"cost.vocab.pass_ms({name!r}) returned {got.tolist()} for slices {list(slices)}; "
                                 "times must be finite and >= 0")
            table[row] = got
    # id of a chunk's cost object -> (the first chunk that has it, the object: held, so no later object takes
    # its id); pipelines share one object between chunks
    done: dict[int, tuple[int, Any]] = {}
    for s in range(K):
        sc = cost.chunk(s)
        if id(sc) in done:
            table[:, s] = table[:, done[id(sc)][0]]
            continue
        done[id(sc)] = (s, sc)
        rows = [(0, "forward_ms", lambda: sc.forward_ms(lens, context=context, batch=batch)),
                (1, "backward_ms", lambda: sc.backward_ms(lens, context=context, batch=batch)),
                (2, "comm_ms", lambda: sc.comm_ms(lens, batch=batch))]
        if callable(getattr(sc, "weight_ms", None)):
            # weight_ms(tokens) is one W pass over that many tokens: the runtime computes a W covering the
            # micro-batch as one GEMM per Linear over all its slices (runtime/slicing/deferred.py), so it reads each
            # weight once, as a slice's W does
            rows.append((3, "weight_ms", (lambda: sc.weight_ms(lens, batch=batch)) if weights_per_slice else
                         (lambda: sc.weight_ms(int(lens.sum()), batch=batch))))
        for row, name, values in rows:
            got = np.broadcast_to(np.asarray(values(), dtype=float), lens.shape)
            if not np.all(np.isfinite(got)) or np.any(got < 0):
                raise ValueError(f"cost.chunk({s}).{name} returned {got.tolist()} for slices {list(slices)}; "
                                 f"times must be finite and >= 0, check the cost model's fit")
            table[row, s] = got
    step = getattr(cost, "step", None)
    if step is not None:   # a fixed cost per F / B / W action (dispatch, buffers, loss, gradient accumulation)
        for row, kind in ((0, "forward"), (1, "backward"), (3, "weight")):
            table[row] += np.array([step.action_ms(kind, s, K) for s in range(K)])[:, None]
    return table


def _tail_ms(cost: Any, num_ranks: int) -> float:
    """The step after the schedule's makespan (end-of-step sync, tied and data-parallel reduction, optimizer)."""
    step = getattr(cost, "step", None)
    return 0.0 if step is None else float(step.tail_ms(num_ranks))


def _check_inputs(schedule: Schedule, slices: Sequence[int], micro_batch_size: int) -> list[int]:
    if not isinstance(schedule, Schedule):
        raise TypeError(f"simulate needs a Schedule, got {type(schedule).__name__}")
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be an int >= 1, got {micro_batch_size!r}")
    try:
        out = [operator.index(x) for x in slices]
    except TypeError:
        raise TypeError(f"slices must be a sequence of ints (tokens per slice), got {slices!r}") from None
    if len(out) != schedule.num_slices:
        raise ValueError(f"slices has {len(out)} entries but schedule {schedule.name!r} has num_slices="
                         f"{schedule.num_slices}; give one length per slice")
    if any(x < 1 for x in out):
        raise ValueError(f"slices must all be >= 1 token, got {out}")
    return out


def simulate(schedule: Schedule, cost: Any, slices: Sequence[int], micro_batch_size: int = 1) -> SimResult:
    """Simulate ``schedule`` under ``cost`` for a sequence cut into ``slices`` (tokens per slice).

    With virtual stages the cost model's stages are the schedule's *chunks* (``cost.num_chunks ==
    schedule.num_chunks``): chunk c's actions cost ``cost.chunk(c)``, a message from chunk c costs its
    ``comm_ms``, and a hand-off between chunks on the same rank costs nothing. ``busy_ms``, ``bubble_fraction``,
    ``peak_in_flight`` and the events' ``stage`` are per rank (a timeline row per rank, actions name chunks).

    ``cost`` is duck-typed like ``PipelineCost``: ``.num_chunks`` and ``.chunk(c)`` returning an object with
    vectorised ``forward_ms``, ``backward_ms`` and ``comm_ms`` (see :class:`StageCostLike`). Raises
    :class:`DeadlockError` / :class:`PairingError` (the classes ``replay`` raises) when the schedule cannot run.
    Per-stage order rules are :func:`~ds_terapipe.planner.schedule.validate`'s, not checked here.
    """
    lens = _check_inputs(schedule, slices, micro_batch_size)
    prog = _program(schedule)
    K = schedule.num_stages
    table = _cost_table(cost, schedule.num_chunks, lens, micro_batch_size, schedule.weights_per_slice,
                        schedule.virtual_stages, prog.group_size.size > 0)  # (8, chunks, n)
    row = np.where(prog.kind == _COMM, 0, prog.kind)
    dur = np.where(prog.kind == _COMM, 0.0, table[row, prog.chunk, prog.slice_idx])
    delay = np.where(prog.delay_stage < 0, 0.0, table[2, prog.delay_stage, prog.slice_idx])
    times = _sweep(prog, dur, delay)
    if times is None:
        _raise_from_replay(schedule)
    start, end = times
    busy = dur[:-1].reshape(K, prog.width).sum(axis=1)
    makespan = float(end.max(initial=0.0))
    # busy time summed in another order than the makespan's path can exceed K * makespan by an ulp: no bubble
    bubble = max(0.0, 1.0 - float(busy.sum()) / (K * makespan)) if makespan > 0 else 0.0
    logger.debug("simulated %s (K=%d, m=%d, slices=%s): makespan %.4g ms, bubble %.3f", schedule.name, K,
                 schedule.num_microbatches, lens, makespan, bubble)
    return SimResult(makespan, tuple(busy.tolist()), bubble, prog.peak_in_flight, prog, start, end,
                     _tail_ms(cost, K))


def _sweep(prog: _Program, dur: np.ndarray, delay: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Lock-step over stages: each sweep runs the next node of every stage whose dependency is done.

    A node's dependency finished in an earlier sweep, so every node is timed after all it waits on, whatever
    the costs. Returns flat (start, end) times per node, or None when no stage can move (deadlock).
    """
    W = prog.width
    group, size = prog.group, prog.group_size
    done = np.zeros(prog.kind.size, bool)
    done[W - 1:-1:W] = True  # the per-stage sentinels
    start = np.zeros(prog.kind.size)
    end = np.zeros(prog.kind.size)
    first = np.arange(prog.num_stages) * W
    active = np.flatnonzero(prog.length > 0)
    cur, last, free = first[active], first[active] + prog.length[active], np.zeros(active.size)
    dep, delay_of, dur_of = prog.dep, delay, dur
    while cur.size:
        d = dep[cur]
        ok = done[d]
        g = group[cur] if size.size else None
        joined = None
        if g is not None and (g >= 0).any():
            # a collective starts when every rank stands at it, all at the latest arrival
            at = g >= 0
            arrived = np.bincount(g[at], minlength=size.size)
            ok[at] &= arrived[g[at]] == size[g[at]]
            joined = np.zeros(size.size)
            np.maximum.at(joined, g[at], free[at])
        if ok.all():
            c = cur
            t0 = np.maximum(free, end[d] + delay_of[c])
            if joined is not None:
                t0 = np.where(g >= 0, joined[np.maximum(g, 0)], t0)
            free = t1 = t0 + dur_of[c]
            cur = cur + 1
        elif ok.any():
            c, d = cur[ok], d[ok]
            t0 = np.maximum(free[ok], end[d] + delay_of[c])
            if joined is not None:
                gk = g[ok]
                t0 = np.where(gk >= 0, joined[np.maximum(gk, 0)], t0)
            free[ok] = t1 = t0 + dur_of[c]
            cur[ok] += 1
        else:
            return None
        start[c], end[c], done[c] = t0, t1, True
        finished = cur == last
        if finished.any():
            keep = ~finished
            cur, last, free = cur[keep], last[keep], free[keep]
    return start, end

"""Sharded data parallelism under a pipeline schedule: how often each chunk's parameters are gathered, what that
costs, and what a rank holds (Breadth-First Pipeline Parallelism's argument, as numbers).

With the model states of every chunk sharded over the ``dp`` data-parallel replicas (fully sharded data
parallelism, ZeRO-3 per chunk), a rank must all-gather a chunk's parameters before it computes with them and may
release them after. The policy this module costs is BFPP's: a rank gathers a chunk when its stream first needs it
after working on another chunk, keeps it for the whole *run* of consecutive actions on that chunk, and releases it
after; while it runs one chunk it prefetches the next run's (so at most two chunks are gathered at once). The
gradients of a run are accumulated unsharded and reduce-scattered when the run ends.

:func:`add_shard_actions` writes this policy into a lowered schedule as actions (``AG`` gathers a chunk, ``RS``
reduce-scatters a run's gradients and frees the chunk, ``RL`` frees it after a run without gradients), so the
runtime executes exactly what is costed here and ``validate`` checks it (``verify.shard_violations``).

So the count of gathers per step is the number of runs in the rank's stream, which is where schedules differ:

* ``looped-bfs`` runs every micro-batch of one chunk before the next chunk: 2 runs per chunk (its forwards, its
  backwards), whatever the number of micro-batches m;
* one chunk per rank (``gpipe``, ``1f1b``): one run, the whole step;
* depth-first schedules with several chunks per rank (``interleaved-1f1b``, ``dualpipev``) switch chunks every few
  units: runs (and gathers and reduce-scatters) grow with m.

Time: a run's gather is prefetched during the previous run on that rank, so it shows only where it takes longer
than that run (the first run's shows whole); each run's reduce-scatter overlaps the rank's next run the same way,
the last one shows whole. The step is the simulated makespan plus the largest such exposed time over the ranks (a
bound from one rank's view: a delayed rank can delay its peers further). Without sharding (ZeRO stage 1 and
replicated parameters) the gradients are reduced once per step after the schedule, as DeepSpeed's pipeline does:
a reduce-scatter and an all-gather of every chunk, after the makespan.

Memory per rank (model states): sharded, ``states / dp`` plus two chunks' parameters (one where a rank holds one
chunk) and one chunk's unsharded gradients (the run in flight and the prefetched one); with ``release="step"`` the
rank's chunks whole with their gradients; replicated, parameters and gradients whole and the optimizer state ``/ dp``
(ZeRO 1). Activations are the schedule's, the same either way, and left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .cost import PipelineCost, comm_time_ms
from .schedule import Action, ActionKind, Schedule, add_communication
from .simulate import simulate

__all__ = ["RELEASE_POLICIES", "ShardingEstimate", "add_shard_actions", "chunk_runs", "estimate_sharding",
           "shard_counts"]


@dataclass(frozen=True)
class ShardingEstimate:
    """One schedule's step with (``sharded``) or without sharded data parallelism; times in ms, memory in bytes
    per rank; counts are the largest over the ranks."""

    schedule: str
    sharded: bool
    makespan_ms: float
    exposed_ms: float
    step_ms: float
    gathers_per_step: int
    reduce_scatters_per_step: int
    memory_bytes: float
    release: str = "run"

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def chunk_runs(schedule: Schedule, events: Sequence[Any]) -> list[list[tuple[int, float, float, bool]]]:
    """Per rank, its maximal runs of consecutive compute actions on one chunk: ``(chunk, start_ms, end_ms,
    computes gradients)``, in stream order (``events``: a simulation's timed compute actions)."""
    runs: list[list[tuple[int, float, float, bool]]] = [[] for _ in range(schedule.num_ranks)]
    for event in sorted(events, key=lambda e: (e.stage, e.start_ms)):
        mine = runs[event.stage]
        grads = event.action.kind in (ActionKind.BACKWARD, ActionKind.WEIGHT)
        if mine and mine[-1][0] == event.action.chunk:
            chunk, start, _, had = mine[-1]
            mine[-1] = (chunk, start, event.end_ms, had or grads)
        else:
            mine.append((event.action.chunk, event.start_ms, event.end_ms, grads))
    return runs


RELEASE_POLICIES = ("run", "step")


def add_shard_actions(schedule: Schedule, prefetch: bool = True, release: str = "run") -> Schedule:
    """``schedule`` (lowered: p2p and collectives in place) with each rank's runs bracketed by sharding actions.

    A *run* is a maximal sequence of a rank's compute actions on one chunk (messages in between do not end it).
    ``AG(c)`` comes before the run's first compute action, or with ``prefetch`` right after the first compute
    action of the rank's previous run (its all-gather then overlaps that run: at most two chunks gathered); the
    run ends, right after its last compute action, with ``RS(c)`` when it computed a gradient (B or W) and
    ``RL(c)`` when it did not. Written with micro-batch and slice 0. A schedule that has them already is
    returned unchanged.

    ``release="step"`` keeps a chunk whole from its first run to its last of the step instead (one gather and one
    reduce-scatter per chunk and step, every chunk of the rank whole at once: what torch's pipelining does with
    FSDP2): fewer collectives for more memory."""
    if release not in RELEASE_POLICIES:
        raise ValueError(f"release={release!r}: use one of {RELEASE_POLICIES}")
    if any(a.is_shard for st in schedule.stages for a in st):
        return schedule
    lowered = add_communication(schedule)
    streams = []
    for stream in lowered.stages:
        runs: list[list[int]] = []   # positions of each run's compute actions
        latest: dict[int, list[int]] = {}   # chunk -> its latest run
        for p, a in enumerate(stream):
            if not a.is_compute:
                continue
            mine = latest.get(a.chunk)
            # per run: only the run in progress continues; per step, a chunk's actions of the step are one run
            if mine is not None and (release == "step" or mine is runs[-1]):
                mine.append(p)
            else:
                runs.append([p])
                latest[a.chunk] = runs[-1]
        before: dict[int, list[Action]] = {}
        after: dict[int, list[Action]] = {}
        for j, run in enumerate(runs):
            chunk = stream[run[0]].chunk
            gather = Action(chunk, ActionKind.GATHER, 0, 0)
            if prefetch and j > 0:
                after.setdefault(runs[j - 1][0], []).append(gather)
            else:
                before.setdefault(run[0], []).append(gather)
            grads = any(stream[p].kind is not ActionKind.FORWARD for p in run)
            end = ActionKind.REDUCE_SCATTER if grads else ActionKind.RELEASE
            after.setdefault(run[-1], []).insert(0, Action(chunk, end, 0, 0))
        out: list[Action] = []
        for p, a in enumerate(stream):
            out += before.get(p, [])
            out.append(a)
            out += after.get(p, [])
        streams.append(out)
    return lowered.with_streams(f"{lowered.name}-sharded", streams)


def shard_counts(schedule: Schedule) -> list[tuple[int, int]]:
    """Per rank, (gathers, reduce-scatters) per step of a schedule with sharding actions."""
    return [(sum(a.kind is ActionKind.GATHER for a in st), sum(a.kind is ActionKind.REDUCE_SCATTER for a in st))
            for st in schedule.stages]


def _spans_by_chunk(runs: list[tuple[int, float, float, bool]]) -> list[tuple[int, float, float, bool]]:
    """One rank's runs merged per chunk, in order of first appearance: (chunk, its first run's start, its last run's
    end, any run computed gradients), what ``release="step"`` gathers once and reduce-scatters once."""
    spans: dict[int, tuple[int, float, float, bool]] = {}
    for chunk, start, end, grads in runs:
        first = spans.get(chunk)
        spans[chunk] = (chunk, start, end, grads) if first is None else (chunk, first[1], end, first[3] or grads)
    return list(spans.values())


def _collective_ms(num_bytes: float, dp: int, link_gbps: float, latency_ms: float) -> float:
    """A ring all-gather or reduce-scatter of ``num_bytes`` (the whole tensor) over ``dp`` ranks: dp - 1 steps,
    (dp - 1) / dp of the tensor through each rank's link."""
    if dp <= 1:
        return 0.0
    return float(comm_time_ms(latency_ms * (dp - 1), link_gbps, num_bytes * (dp - 1) / dp))


def estimate_sharding(schedule: Schedule, cost: PipelineCost, slices: Sequence[int], *,
                      chunk_params: Sequence[float], dp: int, link_gbps: float, link_latency_ms: float = 0.01,
                      sharded: bool = True, param_bytes: int = 2, grad_bytes: int = 2,
                      optimizer_bytes: int = 12, micro_batch_size: int = 1, release: str = "run") -> ShardingEstimate:
    """The step of ``schedule`` (cost per chunk ``cost``, token ``slices``) on ``dp`` replicas, with its model
    states sharded (``sharded``) or replicated under ZeRO 1.

    ``chunk_params``: parameters per chunk; ``param_bytes``/``grad_bytes``: their precision (bf16: 2);
    ``optimizer_bytes`` per parameter (fp32 master copy and Adam's two moments: 12); ``link_gbps`` and
    ``link_latency_ms``: the data-parallel link, in Gbit/s and per ring step; ``release``: as
    :func:`add_shard_actions` (``"step"``: a chunk's runs of the step are one span, gathered once, its gradients
    whole until its one reduce-scatter, every chunk of the rank whole at once)."""
    if len(chunk_params) != schedule.num_chunks:
        raise ValueError(f"chunk_params has {len(chunk_params)} entries but the schedule has {schedule.num_chunks} "
                         "chunks; give the parameter count of every chunk")
    if dp < 1:
        raise ValueError(f"dp = {dp} must be >= 1 data-parallel replicas")
    result = simulate(schedule, cost, list(slices), micro_batch_size=micro_batch_size)
    runs = chunk_runs(schedule, result.events)
    ranks = range(schedule.num_ranks)
    held = [sum(chunk_params[c] for c in schedule.chunks_of(r)) for r in ranks]
    gather = [_collective_ms(p * param_bytes, dp, link_gbps, link_latency_ms) for p in chunk_params]
    reduce = [_collective_ms(p * grad_bytes, dp, link_gbps, link_latency_ms) for p in chunk_params]
    if sharded:
        if release == "step":
            runs = [_spans_by_chunk(mine) for mine in runs]
        exposed = []
        for mine in runs:
            total = 0.0
            for j, (chunk, start, end, grads) in enumerate(mine):
                window = mine[j - 1][2] - mine[j - 1][1] if j else 0.0   # prefetched during the previous run
                total += max(0.0, gather[chunk] - window)
                if grads:   # its gradients leave during the next run (the last run's after the schedule)
                    following = mine[j + 1][2] - mine[j + 1][1] if j + 1 < len(mine) else 0.0
                    total += max(0.0, reduce[chunk] - following)
            exposed.append(total)
        counts = shard_counts(add_shard_actions(schedule, release=release))   # what the runtime executes, counted
        gathers, scatters = [g for g, _ in counts], [r for _, r in counts]
        biggest = max(chunk_params)
        if release == "step":   # the rank's chunks whole, with their whole gradients, all step
            memory = max(h * (param_bytes + grad_bytes + optimizer_bytes) / dp + h * (param_bytes + grad_bytes)
                         for h in held)
        else:   # the run in flight and the prefetched one (one where the rank has one chunk), one's gradients
            memory = max(h * (param_bytes + grad_bytes + optimizer_bytes) / dp
                         + biggest * (min(2, len(schedule.chunks_of(r))) * param_bytes + grad_bytes)
                         for r, h in zip(ranks, held))
        gathers_step, scatters_step = max(gathers), max(scatters)
    else:
        exposed = [sum(reduce[c] + gather[c] for c in schedule.chunks_of(r)) for r in ranks]
        memory = max(h * (param_bytes + grad_bytes + optimizer_bytes / dp) for h in held)
        gathers_step = scatters_step = 0
    worst = max(exposed)
    return ShardingEstimate(schedule.name, sharded, float(result.makespan_ms), float(worst),
                            float(result.makespan_ms + worst), int(gathers_step), int(scatters_step), float(memory),
                            release if sharded else "run")


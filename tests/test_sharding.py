"""Tier a: sharded data parallelism under a schedule (ds_terapipe/planner/sharding.py).

A rank gathers a chunk's parameters once per run of consecutive actions on it: breadth-first (looped-bfs) that is
a fixed number per step whatever the micro-batches, depth-first with several chunks per rank it grows with them;
with one chunk per rank sharding saves no memory (the chunk stays gathered all step). The counts are checked
against the rank streams read independently, and the times against the limits that pin them down.
"""

from __future__ import annotations

import pytest

from ds_terapipe.planner.lowering import lower
from ds_terapipe.planner.presets import analytic_pipeline_cost
from ds_terapipe.planner.registry import get_schedule
from ds_terapipe.planner.roofline import TransformerSpec
from ds_terapipe.planner.schedule import ActionKind
from ds_terapipe.planner.sequence import block_params
from ds_terapipe.planner.sharding import estimate_sharding

P, DP, SLICES = 4, 8, [256, 256, 256, 256]
SPEC = TransformerSpec(num_layers=32, hidden=2048, num_heads=16, vocab=32000, seq_len=1024)
COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT)


def _setup(name: str, m: int):
    v = get_schedule(name).virtual_stages
    cost = analytic_pipeline_cost(SPEC, "a100", P * v, lm_head=False)
    chunk_params = [block_params(SPEC) * SPEC.num_layers / (P * v)] * (P * v)
    return lower(name, P, m, len(SLICES), virtual_stages=v), cost, chunk_params


def _switches(schedule) -> list[int]:
    """Per rank, how many times its stream of compute actions starts on a chunk it was not just running."""
    out = []
    for stream in schedule.stages:
        chunks = [a.chunk for a in stream if a.kind in COMPUTE]
        out.append(sum(1 for i, c in enumerate(chunks) if i == 0 or chunks[i - 1] != c))
    return out


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "dualpipev"])
def test_gathers_are_the_runs_of_each_rank_stream(name: str) -> None:
    counts = {}
    for m in (2, 4, 8):
        schedule, cost, params = _setup(name, m)
        est = estimate_sharding(schedule, cost, SLICES, chunk_params=params, dp=DP, link_gbps=200)
        assert est.gathers_per_step == max(_switches(schedule)), (name, m)
        counts[m] = est.gathers_per_step
    v = get_schedule(name).virtual_stages
    if name == "looped-bfs":   # every micro-batch of a chunk in one run: the same count at every m
        assert counts[2] == counts[4] == counts[8] <= 2 * v
    elif v == 1:   # one chunk per rank: gathered once, kept all step
        assert counts == {2: 1, 4: 1, 8: 1}
    else:   # depth-first over several chunks: grows with m
        assert counts[2] < counts[4] < counts[8]


def test_looped_bfs_reduces_each_chunk_once_and_saves_memory_where_1f1b_cannot() -> None:
    bfs, cost, params = _setup("looped-bfs", 8)
    sharded = estimate_sharding(bfs, cost, SLICES, chunk_params=params, dp=DP, link_gbps=200)
    replicated = estimate_sharding(bfs, cost, SLICES, chunk_params=params, dp=DP, link_gbps=200, sharded=False)
    assert sharded.reduce_scatters_per_step == get_schedule("looped-bfs").virtual_stages
    assert sharded.memory_bytes < replicated.memory_bytes
    one, cost1, params1 = _setup("1f1b", 8)
    sharded1 = estimate_sharding(one, cost1, SLICES, chunk_params=params1, dp=DP, link_gbps=200)
    replicated1 = estimate_sharding(one, cost1, SLICES, chunk_params=params1, dp=DP, link_gbps=200, sharded=False)
    assert sharded1.memory_bytes > replicated1.memory_bytes   # the rank's one chunk stays gathered all step
    # breadth-first hides its few gathers; depth-first over chunks pays one per switch
    deep, cost2, params2 = _setup("interleaved-1f1b", 8)
    sharded2 = estimate_sharding(deep, cost2, SLICES, chunk_params=params2, dp=DP, link_gbps=200)
    assert sharded.step_ms < sharded2.step_ms


def test_free_links_cost_nothing_and_one_replica_has_nothing_to_gather() -> None:
    for name in ("looped-bfs", "interleaved-1f1b"):
        schedule, cost, params = _setup(name, 4)
        for sharded in (True, False):
            free = estimate_sharding(schedule, cost, SLICES, chunk_params=params, dp=DP, link_gbps=1e12,
                                     link_latency_ms=0.0, sharded=sharded)
            assert free.exposed_ms == pytest.approx(0.0, abs=1e-6)
            assert free.step_ms == pytest.approx(free.makespan_ms, abs=1e-6)
            alone = estimate_sharding(schedule, cost, SLICES, chunk_params=params, dp=1, link_gbps=200,
                                      sharded=sharded)
            assert alone.exposed_ms == 0.0
    with pytest.raises(ValueError, match="chunk_params has 3 entries"):
        estimate_sharding(schedule, cost, SLICES, chunk_params=[1.0] * 3, dp=DP, link_gbps=200)

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


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "dualpipev", "zbv"])
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


def test_a_ring_collective_moves_dp_minus_one_over_dp_of_the_tensor_per_link() -> None:
    """The all-gather / reduce-scatter estimate is a ring's: dp - 1 steps, each rank's link carrying (dp - 1) / dp
    of the whole tensor, so on a free-latency link 8 replicas take 7/4 of what 2 take."""
    from ds_terapipe.planner.sharding import _collective_ms

    gbytes = 1e9
    assert _collective_ms(gbytes, 1, 100.0, 0.5) == 0.0
    assert _collective_ms(gbytes, 2, 100.0, 0.0) == pytest.approx(gbytes / 2 * 8 / 100e6)
    assert _collective_ms(gbytes, 8, 100.0, 0.0) == pytest.approx(7 / 4 * _collective_ms(gbytes, 2, 100.0, 0.0))
    assert _collective_ms(gbytes, 8, 100.0, 0.5) == pytest.approx(7 * 0.5 + _collective_ms(gbytes, 8, 100.0, 0.0))


# -- the sharding actions in the IR (planner/sharding.add_shard_actions, verify.shard_violations) ----------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "dualpipev", "zbv"])
@pytest.mark.parametrize("prefetch", [True, False])
def test_shard_actions_bracket_every_run_and_replay(name: str, prefetch: bool) -> None:
    """Released after each run (BFPP's policy): one gather per run, one reduce-scatter per run with gradients."""
    from ds_terapipe.planner.schedule import replay, validate
    from ds_terapipe.planner.sharding import shard_counts

    v = get_schedule(name).virtual_stages
    for m in (2, 5):
        plain = lower(name, 3, m, 3, virtual_stages=v)
        sharded = lower(name, 3, m, 3, virtual_stages=v, shard_params=True, shard_prefetch=prefetch)
        validate(sharded)
        replay(sharded)
        # the same compute and p2p, in the same order: sharding only adds its own actions
        assert [[a for a in st if not a.is_shard] for st in sharded.stages] == [list(st) for st in plain.stages]
        for rank, (gathers, scatters) in enumerate(shard_counts(sharded)):
            assert gathers == _switches(plain)[rank]
            backward_runs = _backward_runs(plain.stages[rank])
            assert scatters == backward_runs, (name, m, rank)
        if prefetch:   # at most two chunks gathered at a time; without prefetch one
            assert _most_gathered(sharded) <= 2
        else:
            assert _most_gathered(sharded) == 1


def _backward_runs(stream) -> int:
    runs, last = [], None
    for a in stream:
        if a.kind in COMPUTE:
            if a.chunk != last:
                runs.append(False)
                last = a.chunk
            runs[-1] = runs[-1] or a.kind is not ActionKind.FORWARD
    return sum(runs)


def _most_gathered(schedule) -> int:
    most = 0
    for stream in schedule.stages:
        live: set[int] = set()
        for a in stream:
            if a.kind is ActionKind.GATHER:
                live.add(a.chunk)
                most = max(most, len(live))
            elif a.kind in (ActionKind.RELEASE, ActionKind.REDUCE_SCATTER):
                live.discard(a.chunk)
    return most


def test_the_validator_refuses_broken_sharding() -> None:
    from ds_terapipe.planner.schedule import Action, ScheduleError, validate

    good = lower("looped-bfs", 2, 2, 2, virtual_stages=2, shard_params=True, shard_prefetch=False)
    stream = list(good.stages[0])

    def broken(edit) -> str:
        streams = [list(s) for s in good.stages]
        streams[0] = edit(list(stream))
        with pytest.raises(ScheduleError) as err:
            validate(good.with_streams("broken", streams))
        return str(err.value)

    first_rs = next(i for i, a in enumerate(stream) if a.kind is ActionKind.REDUCE_SCATTER)
    rs = stream[first_rs]
    assert "it needs RS" in broken(lambda s: s[:first_rs] + [Action(rs.chunk, ActionKind.RELEASE, 0, 0)]
                                   + s[first_rs + 1:])
    assert "not gathered" in broken(lambda s: [a for a in s if a.kind is not ActionKind.GATHER])
    assert "still gathered" in broken(lambda s: [a for a in s if a.kind is not ActionKind.REDUCE_SCATTER
                                                 and a.kind is not ActionKind.RELEASE])
    first_ag = next(i for i, a in enumerate(stream) if a.kind is ActionKind.GATHER)
    assert "gathered already" in broken(lambda s: s[:first_ag + 1] + [s[first_ag]] + s[first_ag + 1:])
    first_rl = next(i for i, a in enumerate(stream) if a.kind is ActionKind.RELEASE)
    rl = stream[first_rl]
    assert "needs RL" in broken(lambda s: s[:first_rl] + [Action(rl.chunk, ActionKind.REDUCE_SCATTER, 0, 0)]
                                + s[first_rl + 1:])
    # the short form reads back
    assert Action.parse("2AG0.0") == Action(2, ActionKind.GATHER, 0, 0) and str(rs) == f"{rs.chunk}RS0.0"


def test_the_estimate_counts_the_actions_the_runtime_executes() -> None:
    from ds_terapipe.planner.sharding import add_shard_actions, shard_counts

    for name in ("looped-bfs", "interleaved-1f1b"):
        schedule, cost, params = _setup(name, 4)
        est = estimate_sharding(schedule, cost, SLICES, chunk_params=params, dp=DP, link_gbps=200)
        counts = shard_counts(add_shard_actions(schedule))
        assert est.gathers_per_step == max(g for g, _ in counts)
        assert est.reduce_scatters_per_step == max(r for _, r in counts)


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "dualpipev", "zbv"])
def test_released_after_the_step_each_chunk_is_gathered_once(name: str) -> None:
    from ds_terapipe.planner.schedule import replay, validate
    from ds_terapipe.planner.sharding import shard_counts

    v = get_schedule(name).virtual_stages
    for m in (2, 5):
        for prefetch in (True, False):
            sharded = lower(name, 3, m, 3, virtual_stages=v, shard_params=True, shard_prefetch=prefetch,
                            shard_release="step")
            validate(sharded)
            replay(sharded)
            assert shard_counts(sharded) == [(v, v)] * 3, (name, m, prefetch)
    with pytest.raises(ValueError, match="release='epoch'"):
        lower(name, 3, 2, 3, virtual_stages=v, shard_params=True, shard_release="epoch")


def test_released_after_the_step_fewer_collectives_more_memory() -> None:
    for name in ("looped-bfs", "interleaved-1f1b"):
        schedule, cost, params = _setup(name, 8)
        v = get_schedule(name).virtual_stages
        per_run = estimate_sharding(schedule, cost, SLICES, chunk_params=params, dp=DP, link_gbps=200)
        per_step = estimate_sharding(schedule, cost, SLICES, chunk_params=params, dp=DP, link_gbps=200,
                                     release="step")
        assert per_step.gathers_per_step == per_step.reduce_scatters_per_step == v
        assert per_step.gathers_per_step < per_run.gathers_per_step
        assert per_step.memory_bytes > per_run.memory_bytes and per_step.release == "step"
    # depth-first over chunks: one gather per chunk instead of one per switch is far cheaper
    assert per_step.step_ms < per_run.step_ms


def _runs_of(stream) -> tuple[list[dict], dict[int, int]]:
    """A sharded rank stream's runs (chunk, positions of its compute actions, whether one computes a gradient) and,
    per gather's position, the position of the compute action before it (-1: none)."""
    runs: list[dict] = []
    before: dict[int, int] = {}
    last = -1
    for p, a in enumerate(stream):
        if a.kind is ActionKind.GATHER:
            before[p] = last
        if a.kind not in COMPUTE:
            continue
        if not runs or runs[-1]["chunk"] != a.chunk:
            runs.append({"chunk": a.chunk, "at": [], "grads": False})
        runs[-1]["at"].append(p)
        runs[-1]["grads"] |= a.kind is not ActionKind.FORWARD
        last = p
    return runs, before


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "dualpipev", "zbv"])
def test_each_run_is_gathered_during_the_previous_one_and_ends_with_its_gradients_reduce_scattered(name: str) -> None:
    """``add_shard_actions``' placement, read off the streams: the gather of every run but the first right after
    the first compute action of the run before it (prefetched), and right after a run's last compute action its
    RS when the run computed a gradient (B, or W alone: deferred weight gradients leave runs of W only), else RL."""
    from ds_terapipe.planner.schedule import Action
    from ds_terapipe.planner.sharding import add_shard_actions

    v = get_schedule(name).virtual_stages
    weight_only_runs = 0
    for deferred in (False, True):
        for m in (2, 5):
            sharded = add_shard_actions(lower(name, 3, m, 3, virtual_stages=v, deferred_weight_grads=deferred))
            for stream in sharded.stages:
                runs, before = _runs_of(stream)
                gathers = sorted(before)
                assert [stream[p].chunk for p in gathers] == [run["chunk"] for run in runs]
                assert before[gathers[0]] == -1 and gathers[0] < runs[0]["at"][0]
                for j in range(1, len(runs)):
                    assert before[gathers[j]] == runs[j - 1]["at"][0], (name, deferred, m, j)
                for run in runs:
                    end = ActionKind.REDUCE_SCATTER if run["grads"] else ActionKind.RELEASE
                    assert stream[run["at"][-1] + 1] == Action(run["chunk"], end, 0, 0), (name, deferred, m)
                    weight_only_runs += all(stream[p].kind is ActionKind.WEIGHT for p in run["at"])
    if name == "dualpipev":
        assert weight_only_runs   # the case the B-or-W rule is there for


def test_model_states_per_rank_are_a_share_of_its_states_plus_its_gathered_chunks() -> None:
    """Sharded, per rank: its chunks' states / dp, plus whole parameters of the run in flight and of the prefetched
    one (one chunk where the rank has only one) and one chunk's whole gradients; bf16 parameters and gradients,
    12 bytes of optimizer state per parameter."""
    for name, gathered in (("1f1b", 1), ("interleaved-1f1b", 2)):
        schedule, cost, params = _setup(name, 4)
        est = estimate_sharding(schedule, cost, SLICES, chunk_params=params, dp=DP, link_gbps=200)
        held = params[0] * len(schedule.chunks_of(0))
        assert est.memory_bytes == pytest.approx(held * 16 / DP + params[0] * (gathered * 2 + 2)), name

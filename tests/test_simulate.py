"""Tier (a): the event simulator against closed forms and an independent per-action reference simulation.

    python -m pytest -q tests/test_simulate.py

The cost model is a local fake with PipelineCost's duck type, so these tests do not depend on cost.py's timing.
"""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from ds_terapipe.planner import schedule as sch
from ds_terapipe.planner.schedule import (
    SCHEDULES, Action, ActionKind, Schedule, add_communication, build_1f1b, build_gpipe, build_schedule,
    schedule_from_strings, stream_strings,
)
from ds_terapipe.planner.simulate import SimResult, TimedAction, simulate

from ds_terapipe.planner.registry import get_schedule

F, B = ActionKind.FORWARD, ActionKind.BACKWARD
#: One chunk per rank: the cost model's stage s is rank s (chunk schedules: tests/test_chunks.py).
ONE_CHUNK = tuple(name for name in SCHEDULES if get_schedule(name).virtual_stages == 1)


class FakeStage:
    """time = base + per_token * slice_len * (1 + per_context * context) * batch; comm = c * slice_len * batch."""

    def __init__(self, f: float, b: float, c: float = 0.0, per_token: float = 0.0, per_context: float = 0.0):
        self.f, self.b, self.c, self.per_token, self.per_context = f, b, c, per_token, per_context
        self.calls: list[tuple[str, list[int], list[int] | None, int]] = []

    def _t(self, base: float, slice_len, context, batch) -> np.ndarray:
        s, ctx = np.asarray(slice_len, float), np.asarray(context, float)
        return (base + self.per_token * s * (1 + self.per_context * ctx)) * batch

    def forward_ms(self, slice_len, context, batch=1):
        self.calls.append(("forward_ms", np.asarray(slice_len).tolist(), np.asarray(context).tolist(), batch))
        return self._t(self.f, slice_len, context, batch)

    def backward_ms(self, slice_len, context, batch=1):
        self.calls.append(("backward_ms", np.asarray(slice_len).tolist(), np.asarray(context).tolist(), batch))
        return self._t(self.b, slice_len, context, batch)

    def comm_ms(self, slice_len, batch=1):
        self.calls.append(("comm_ms", np.asarray(slice_len).tolist(), None, batch))
        return self.c * np.asarray(slice_len, float) * batch


class FakeCost:
    def __init__(self, stages: list[FakeStage]):
        self.stages = stages
        self.num_chunks = len(stages)

    @classmethod
    def uniform(cls, stage: FakeStage, num_stages: int) -> FakeCost:
        return cls([stage] * num_stages)

    def chunk(self, s: int) -> FakeStage:
        return self.stages[s]


def random_cost(rng: random.Random, K: int) -> FakeCost:
    return FakeCost([FakeStage(rng.uniform(0.1, 2), rng.uniform(0.1, 4), rng.uniform(0, 0.3),
                               rng.uniform(0, 0.5), rng.uniform(0, 0.05)) for _ in range(K)])


def reference(schedule: Schedule, cost: FakeCost, slices: list[int], batch: int = 1) -> dict[Action, tuple]:
    """Straightforward per-action simulation over the comm-augmented streams: FIFO channel queues, blocking
    receives, sends that cost nothing (:func:`collective_reference`, which also runs the vocabulary collectives).
    Independent of the library's matching and of its vectorised sweep."""
    times, _ = collective_reference(add_communication(schedule), cost, slices, batch)
    return {a: t for (_, a), t in times.items()}


def assert_matches_reference(result: SimResult, schedule: Schedule, cost: FakeCost, slices: list[int],
                             batch: int = 1) -> None:
    ref = reference(schedule, cost, slices, batch)
    assert len(result.events) == len(ref) == 2 * schedule.num_stages * schedule.num_units
    for ev in result.events:
        t0, t1 = ref[ev.action]
        assert ev.stage == ev.action.chunk
        assert ev.start_ms == pytest.approx(t0, rel=1e-12, abs=1e-9)
        assert ev.end_ms == pytest.approx(t1, rel=1e-12, abs=1e-9)
    assert result.makespan_ms == pytest.approx(max(t1 for _, t1 in ref.values()), rel=1e-12)


# ------------------------------------------------------------------------------------------- closed forms


@pytest.mark.parametrize("name", ONE_CHUNK)
@pytest.mark.parametrize("f,b", [(1, 1), (1, 2), (3, 1)])
def test_equal_unit_costs_reproduce_the_gpipe_closed_form(name, f, b):
    """Bubble (K-1)/(m+K-1) with one slice, (K-1)/(m*n+K-1) with n equal slices; token 1F1B matches GPipe."""
    for K, m, n in itertools.product(range(1, 7), range(1, 6), range(1, 7)):
        N = m * n
        res = simulate(build_schedule(name, K, m, n), FakeCost.uniform(FakeStage(f, b), K), [7] * n)
        assert res.makespan_ms == (N + K - 1) * (f + b)  # exact: integer costs
        assert res.busy_ms == (N * (f + b),) * K
        assert res.bubble_fraction == pytest.approx((K - 1) / (N + K - 1), abs=1e-12)
        if n == 1:
            assert res.bubble_fraction == pytest.approx((K - 1) / (m + K - 1), abs=1e-12)


def test_gpipe_closed_form_with_comm_latency():
    for K, m, n in itertools.product(range(1, 6), range(1, 4), range(1, 5)):
        N = m * n
        res = simulate(build_gpipe(K, m, n), FakeCost.uniform(FakeStage(2, 3, c=1), K), [1] * n)
        assert res.makespan_ms == (N + K - 1) * 5 + 2 * (K - 1) * 1


def test_closed_form_at_planner_scale():
    """K=48, m*n=256: the size the slicing planner simulates many times."""
    K, m, n = 48, 4, 64
    for name in ONE_CHUNK:
        res = simulate(build_schedule(name, K, m, n), FakeCost.uniform(FakeStage(1, 2), K), [16] * n)
        assert res.makespan_ms == (m * n + K - 1) * 3
        assert len(res.events) == 2 * K * m * n


def test_zero_costs_give_zero_makespan_and_no_bubble():
    res = simulate(build_1f1b(3, 2, 2), FakeCost.uniform(FakeStage(0, 0), 3), [4, 4])
    assert res.makespan_ms == 0 and res.bubble_fraction == 0


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_a_bubble_is_never_a_rounding_below_zero(name):
    # one busy stage: its busy time, summed in another order than the makespan's path, came out an ulp over the
    # makespan and the bubble at -2e-15 (printed "-0.0%")
    rng = random.Random(0)
    for _ in range(10):
        stage = FakeStage(rng.uniform(0, 1), rng.uniform(0, 2), per_token=rng.uniform(0, 0.1),
                          per_context=rng.uniform(0, 0.5))
        res = simulate(build_schedule(name, 1, 64, 3), FakeCost.uniform(stage, 1), [7, 11, 13])
        assert 0.0 <= res.bubble_fraction < 1e-12, res.bubble_fraction


# ------------------------------------------------------------------------------------------ vs reference


@pytest.mark.parametrize("name", ONE_CHUNK)
def test_simulation_matches_reference_with_context_dependent_costs_and_comm(name):
    rng = random.Random(1)
    for K, m, n in [(1, 2, 3), (2, 1, 1), (2, 3, 2), (3, 2, 4), (4, 4, 3), (5, 3, 1), (6, 2, 5)]:
        cost = random_cost(rng, K)
        slices = [rng.randint(1, 64) for _ in range(n)]
        batch = rng.randint(1, 3)
        sched = build_schedule(name, K, m, n)
        res = simulate(sched, cost, slices, micro_batch_size=batch)
        assert_matches_reference(res, sched, cost, slices, batch)
        lowered = simulate(add_communication(sched), cost, slices, micro_batch_size=batch)  # same lowering
        assert lowered.makespan_ms == res.makespan_ms and lowered.events == res.events


def test_hand_written_comm_is_simulated_as_written():
    """Receives posted late (after other compute) delay the stream differently from the standard lowering."""
    lines = list(stream_strings(add_communication(build_gpipe(2, 2, 1))))
    assert lines[0] == "0F0.0 0SEND_F0.0 0F1.0 0SEND_F1.0 0RECV_B0.0 0B0.0 0RECV_B1.0 0B1.0"
    lines[0] = "0F0.0 0F1.0 0SEND_F0.0 0SEND_F1.0 0RECV_B0.0 0B0.0 0RECV_B1.0 0B1.0"  # sends held back
    late = schedule_from_strings("gpipe-late", 2, 1, lines)
    sch.validate(late)
    cost = FakeCost([FakeStage(1, 1, c=0.25), FakeStage(2, 2, c=0.5)])
    res = simulate(late, cost, [1])
    assert_matches_reference(res, late, cost, [1])
    standard = simulate(build_gpipe(2, 2, 1), cost, [1])
    start = {str(e.action): e.start_ms for e in res.events}
    assert start["1F0.0"] == 2.25 and {str(e.action): e.start_ms for e in standard.events}["1F0.0"] == 1.25


def test_cached_structure_does_not_leak_costs_between_calls():
    rng = random.Random(2)
    sched = build_1f1b(4, 3, 3)
    for _ in range(3):
        cost, slices = random_cost(rng, 4), [rng.randint(1, 32) for _ in range(3)]
        assert_matches_reference(simulate(sched, cost, slices), sched, cost, slices)


# ------------------------------------------------------------------------------------------------- details


def test_cost_model_is_asked_with_prefix_context_and_batch():
    stage = FakeStage(1, 1, c=1)
    simulate(build_gpipe(2, 1, 3), FakeCost([stage, stage]), [3, 4, 5], micro_batch_size=2)
    assert ("forward_ms", [3, 4, 5], [0, 3, 7], 2) in stage.calls
    assert ("backward_ms", [3, 4, 5], [0, 3, 7], 2) in stage.calls
    assert ("comm_ms", [3, 4, 5], None, 2) in stage.calls


def test_events_keep_stream_order_and_cross_stage_dependencies():
    rng = random.Random(3)
    K, m, n = 4, 3, 3
    cost, slices = random_cost(rng, K), [5, 9, 2]
    for name in ONE_CHUNK:
        sched = build_schedule(name, K, m, n)
        res = simulate(sched, cost, slices)
        assert res.events is res.events and all(isinstance(e, TimedAction) for e in res.events)
        by_action = {e.action: e for e in res.events}
        for s, stream in enumerate(sched.stages):
            evs = [by_action[a] for a in stream]
            assert all(x.end_ms <= y.start_ms for x, y in zip(evs, evs[1:]))
            assert res.busy_ms[s] == pytest.approx(sum(e.duration_ms for e in evs))
            for a in stream:
                comm = lambda src: cost.chunk(src).comm_ms(np.array([slices[a.slice]])).item()
                if a.kind is F and s > 0:
                    assert by_action[a].start_ms >= by_action[Action(s - 1, F, *a.unit)].end_ms + comm(s - 1) - 1e-9
                if a.kind is B and s < K - 1:
                    assert by_action[a].start_ms >= by_action[Action(s + 1, B, *a.unit)].end_ms + comm(s + 1) - 1e-9


def test_peak_in_flight_gpipe_versus_1f1b():
    cost = FakeCost.uniform(FakeStage(1, 2), 4)
    for m, n in [(4, 1), (4, 3), (5, 6)]:
        gp = simulate(build_gpipe(4, m, n), cost, [2] * n)
        one = simulate(build_1f1b(4, m, n), cost, [2] * n)
        assert gp.peak_in_flight == (m * n,) * 4
        assert one.peak_in_flight == tuple(min(n + 3 - s, m * n) for s in range(4))
        assert sum(one.peak_in_flight) < sum(gp.peak_in_flight)


def test_deadlock_and_pairing_errors_are_the_schedule_module_classes():
    base = build_gpipe(3, 2, 2)
    stream = list(base.stages[0])
    stream[3], stream[4] = stream[4], stream[3]
    stuck = Schedule("stuck", 3, 2, 2, (tuple(stream),) + base.stages[1:])
    cost = FakeCost.uniform(FakeStage(1, 1), 3)
    with pytest.raises(sch.DeadlockError, match=r">0RECV_B0\.1<"):
        simulate(stuck, cost, [1, 1])
    lowered = add_communication(stuck)
    with pytest.raises(sch.DeadlockError, match=r"rank 0 blocked at position \d+ on 0RECV_B0\.1"):
        simulate(lowered, cost, [1, 1])
    swapped = list(base.stages[2])
    swapped[:4] = [swapped[2], swapped[3], swapped[0], swapped[1]]
    mispaired = Schedule("mispaired", 3, 2, 2, base.stages[:2] + (tuple(swapped),))
    with pytest.raises(sch.PairingError, match="receive #0 2RECV_F1.0"):
        simulate(mispaired, cost, [1, 1])
    extra = add_communication(base)
    extra = Schedule("extra", 3, 2, 2, extra.stages[:2] + (extra.stages[2] + (Action(2, ActionKind.RECV_F, 0, 0),),))
    with pytest.raises(sch.DeadlockError, match="waits forever"):
        simulate(extra, cost, [1, 1])


def test_simulate_rejects_bad_inputs():
    sched, cost = build_gpipe(2, 1, 2), FakeCost.uniform(FakeStage(1, 1), 2)
    with pytest.raises(ValueError, match="slices has 3 entries but schedule 'gpipe' has num_slices=2"):
        simulate(sched, cost, [1, 2, 3])
    with pytest.raises(ValueError, match=">= 1 token"):
        simulate(sched, cost, [1, 0])
    with pytest.raises(TypeError, match="sequence of ints"):
        simulate(sched, cost, [1.5, 2])
    with pytest.raises(ValueError, match="micro_batch_size"):
        simulate(sched, cost, [1, 1], micro_batch_size=0)
    with pytest.raises(ValueError, match="num_chunks=3 but the schedule has 2"):
        simulate(sched, FakeCost.uniform(FakeStage(1, 1), 3), [1, 1])
    with pytest.raises(ValueError, match=r"cost.chunk\(0\).forward_ms returned \[-1.0, -1.0\]"):
        simulate(sched, FakeCost.uniform(FakeStage(-1, 1), 2), [1, 1])
    with pytest.raises(TypeError, match=r"\.chunk\(c\)"):
        simulate(sched, object(), [1, 1])
    with pytest.raises(TypeError, match="needs a Schedule"):
        simulate("gpipe", cost, [1, 1])


class WeightedStage(FakeStage):
    """FakeStage plus deferred weight-gradient work of ``w`` ms per W pass (any number of tokens)."""

    def __init__(self, f: float, b: float, w: float, c: float = 0.0):
        super().__init__(f, b, c)
        self.w = w

    def weight_ms(self, tokens, batch=1):
        self.calls.append(("weight_ms", np.atleast_1d(tokens).tolist(), None, batch))
        return np.full(np.shape(tokens), self.w * batch)


def test_w_actions_are_timed_with_weight_ms_off_the_gradient_path():
    # K=2, m=1, n=2, F=1, B=2, W=1.5 per pass: stage 1 runs B1 [3,5], B0 [5,7], W [7,8.5]; stage 0 gets gradients
    # at 5 and 7, runs B1 [5,7], B0 [7,9], W [9,10.5]. Unsplit (B=5 with weights): B0 of stage 0 would end at 18.
    cost = FakeCost.uniform(WeightedStage(1.0, 2.0, 1.5), 2)
    sched = sch.defer_weights(build_gpipe(2, 1, 2))
    res = simulate(sched, cost, [4, 4])
    assert res.makespan_ms == pytest.approx(10.5)
    w_events = sorted((e.stage, e.start_ms, e.end_ms) for e in res.events if e.action.kind is ActionKind.WEIGHT)
    assert w_events == [(0, 9.0, 10.5), (1, 7.0, 8.5)]
    assert res.busy_ms == pytest.approx((1 + 1 + 2 + 2 + 1.5, 1 + 1 + 2 + 2 + 1.5))
    # one pass over the micro-batch's 8 tokens (the runtime's one GEMM per Linear), not one per slice
    assert ("weight_ms", [8], None, 1) in cost.chunk(0).calls
    assert not any(c[0] == "weight_ms" and c[1] == [4, 4] for c in cost.chunk(0).calls)
    assert simulate(add_communication(sched), cost, [4, 4]).makespan_ms == pytest.approx(10.5)


def test_w_actions_cost_nothing_without_a_weight_model():
    cost = FakeCost.uniform(FakeStage(1.0, 2.0), 2)
    plain = simulate(build_gpipe(2, 2, 3), cost, [4, 4, 4])
    deferred = simulate(sch.defer_weights(build_gpipe(2, 2, 3)), cost, [4, 4, 4])
    assert deferred.makespan_ms == pytest.approx(plain.makespan_ms)


def test_w_per_slice_is_timed_per_slice_length():
    # K=2, m=1, slices [4, 8], F=1, B=2, W=0.5 per token: stage 1 runs B1 [3,5], W1 [5,9], B0 [9,11], W0 [11,13];
    # stage 0 gets gradients at 5 and 11: B1 [5,7], W1 [7,11], B0 [11,13], W0 [13,15].
    class PerToken(WeightedStage):
        def weight_ms(self, tokens, batch=1):
            return 0.5 * np.asarray(tokens, float) * batch

    cost = FakeCost.uniform(PerToken(1.0, 2.0, 0.0), 2)
    sched = sch.defer_weights(build_gpipe(2, 1, 2), per_slice=True)
    res = simulate(sched, cost, [4, 8])
    assert res.makespan_ms == pytest.approx(15.0)
    w_events = sorted((e.stage, e.action.slice, e.start_ms, e.end_ms) for e in res.events
                      if e.action.kind is ActionKind.WEIGHT)
    assert w_events == [(0, 0, 13.0, 15.0), (0, 1, 7.0, 11.0), (1, 0, 11.0, 13.0), (1, 1, 5.0, 9.0)]


# ------------------------------------------------------------------------------- vocabulary collectives


class FakeVocab:
    """A vocabulary pass costs ``base[kind] + per_token * slice_len`` (the same on every rank)."""

    def __init__(self, rng: random.Random):
        self.base = {k: rng.uniform(0.1, 1.5) for k in ("VF", "VB", "EF", "EB")}
        self.per_token = rng.uniform(0, 0.05)

    def pass_ms(self, kind, slice_len, batch=1):
        return (self.base[kind] + self.per_token * np.asarray(slice_len, float)) * batch


def collective_reference(lowered: Schedule, cost, slices: list[int], batch: int = 1):
    """Per-action simulation of a lowered schedule with collectives, written apart from the library's sweep: a
    rank at a collective waits until every rank stands at the same one (kind, unit), which then runs on all of
    them from the latest arrival for its pass time. Returns {(rank, action): (start, end)} for every compute and
    collective action, and the makespan."""
    ctx = [sum(slices[:i]) for i in range(len(slices))]
    one = lambda x: float(np.asarray(x).reshape(-1)[0])   # noqa: E731
    K = lowered.num_stages
    queues: dict[tuple[int, int], list[tuple[tuple[int, int], float]]] = {}
    taken: dict[tuple[int, int], int] = {}
    arrived: dict[tuple, dict[int, float]] = {}
    finished: dict[tuple, tuple[float, float]] = {}
    ptr, free, times = [0] * K, [0.0] * K, {}
    while any(ptr[r] < len(lowered.stages[r]) for r in range(K)):
        moved = False
        for r in range(K):
            while ptr[r] < len(lowered.stages[r]):
                a = lowered.stages[r][ptr[r]]
                i = a.slice
                if a.is_collective:
                    key = (a.kind, a.unit)
                    arrived.setdefault(key, {})[r] = free[r]
                    if key not in finished:
                        if len(arrived[key]) < K:
                            break
                        t0 = max(arrived[key].values())
                        finished[key] = (t0, t0 + one(cost.vocab.pass_ms(a.kind.value, [slices[i]], batch)))
                    times[(r, a)] = finished[key]
                    free[r] = finished[key][1]
                elif a.kind in (F, B):
                    st = cost.chunk(a.chunk)
                    fn = st.forward_ms if a.kind is F else st.backward_ms
                    start = free[r]
                    free[r] = start + one(fn([slices[i]], [ctx[i]], batch))
                    times[(r, a)] = (start, free[r])
                elif a.kind in (ActionKind.SEND_F, ActionKind.SEND_B):
                    queues.setdefault((a.chunk, a.peer), []).append((a.unit, free[r]))
                else:
                    ch = (a.peer, a.chunk)
                    k = taken.get(ch, 0)
                    if len(queues.get(ch, [])) <= k:
                        break
                    unit, issued = queues[ch][k]
                    assert unit == a.unit, "reference: mis-paired"
                    taken[ch] = k + 1
                    free[r] = max(free[r], issued + one(cost.chunk(a.peer).comm_ms([slices[i]], batch)))
                ptr[r] += 1
                moved = True
        if not moved:
            raise RuntimeError("reference: deadlock")
    return times, max(free)


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("looped-bfs", 2),
                                    ("dualpipev", 2), ("zbv", 2)])
@pytest.mark.parametrize("embedding", [False, True])
def test_vocabulary_collectives_are_costed_and_synchronise_every_rank(name, v, embedding):
    """Each VF/VB/EF/EB costs its pass and starts on every rank at once, when the last rank arrives: the
    simulator's compute events and makespan equal a per-action reference that implements exactly that."""
    from ds_terapipe.planner.vocab import vocab_schedule
    rng = random.Random(f"{name}{v}{embedding}")
    for p, m, n in [(2, 2, 2), (3, 2, 3), (2, 3, 1)]:
        if name == "dualpipev" and m < 2 * p:
            m = 2 * p
        lowered = vocab_schedule(name, p, m, n, embedding=embedding, virtual_stages=v)
        assert any(a.is_collective for st in lowered.stages for a in st)
        cost = random_cost(rng, p * v)
        cost.vocab = FakeVocab(rng)
        slices = [rng.randint(4, 64) for _ in range(n)]
        res = simulate(lowered, cost, slices)
        ref, makespan = collective_reference(lowered, cost, slices)
        assert res.makespan_ms == pytest.approx(makespan, rel=1e-12)
        for ev in res.events:
            assert (ev.start_ms, ev.end_ms) == pytest.approx(ref[(ev.stage, ev.action)], rel=1e-12, abs=1e-9)
        free = FakeVocab(rng)
        free.base = dict.fromkeys(free.base, 0.0)
        free.per_token = 0.0
        cost.vocab = free    # collectives that cost nothing still make every rank wait for the last
        assert simulate(lowered, cost, slices).makespan_ms >= simulate(
            sch.build_schedule(name, p, m, n, virtual_stages=v), cost, slices).makespan_ms - 1e-9
        cost.vocab = None
        with pytest.raises(ValueError, match="no cost for them"):
            simulate(lowered, cost, slices)


def test_chunks_sharing_a_cost_object_are_timed_as_separate_ones():
    """The cost table asks a shared stage object once (presets share the middle stages' object): the timeline is
    the one of a pipeline whose every stage has its own object."""
    import copy

    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.presets import analytic_pipeline_cost
    from ds_terapipe.planner.schedule import build_schedule

    shared = analytic_pipeline_cost("gpt3-1b", "a100", 6)   # embedding, 4 equal middle stages, head
    assert len({id(st) for st in shared.stages}) == 3
    separate = PipelineCost([copy.deepcopy(st) for st in shared.stages])
    for name in ("gpipe", "1f1b"):
        schedule = build_schedule(name, 6, 3, 4)
        a, b = (simulate(schedule, cost, [128, 256, 64, 64], micro_batch_size=2) for cost in (shared, separate))
        assert (a.makespan_ms, a.busy_ms, [e[1:] for e in a.events]) == (b.makespan_ms, b.busy_ms,
                                                                         [e[1:] for e in b.events])


def test_a_cost_that_builds_each_chunks_object_anew_is_timed_per_chunk():
    """A cost whose ``chunk(s)`` makes a new object per call (freed after use: Python may give the next one the
    same id) is timed chunk by chunk, not taken for a shared object."""
    import copy

    from ds_terapipe.planner.presets import analytic_pipeline_cost
    from ds_terapipe.planner.schedule import build_schedule

    base = analytic_pipeline_cost("gpt3-1b", "a100", 6, lm_head=True)   # embedding, middle stages, head

    class Fresh:
        def __getattr__(self, name):
            return getattr(base, name)

        def chunk(self, s: int):
            return copy.deepcopy(base.stages[s])

    schedule = build_schedule("gpipe", 6, 2, 2)
    a, b = (simulate(schedule, cost, [128, 128]) for cost in (Fresh(), base))
    assert (a.makespan_ms, a.busy_ms) == (b.makespan_ms, b.busy_ms)

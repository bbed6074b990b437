"""Tier (a): the slicing planner against brute force, plus plans, batch split, memory cap and errors.

    python -m pytest -q tests/test_slicing.py
"""
from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from ds_terapipe.planner.cost import MeasuredCost, PipelineCost, StageCost
from ds_terapipe.planner.presets import analytic_pipeline_cost, resolve_model
from ds_terapipe.planner.slicing import MemoryModel, SlicingPlan, plan_slicing


class TableCost(StageCost):
    """Random times on the granularity grid, increasing in slice length and in context.

    forward/backward are independent random tables (backward is *not* proportional to forward), scaled by
    batch ** 0.9 so splitting a batch trades a smaller bubble for more, less efficient units. ``integer`` makes
    every time a small integer, so many plans tie.
    """

    def __init__(self, rng: np.random.Generator, n: int, g: int, *, integer: bool = False, comm: bool = False,
                 context: float = 1.0, overhead: float = 1.0):
        def table() -> np.ndarray:
            step = rng.integers(0, 3, (n + 1, n + 1)).astype(float) if integer else rng.uniform(0.0, 1.0, (n + 1, n + 1))
            step[:, 1:] *= context   # how fast time grows with the context (column) vs with the length (row)
            # overhead per slice + growth with length (axis 0) and with context (axis 1)
            base = rng.integers(1, 4) if integer else rng.uniform(0.5, 3.0) * overhead
            return base + np.cumsum(np.cumsum(step, 0), 1)

        self.g, self.fwd, self.bwd = g, table(), table()
        self.comm = (rng.integers(0, 2) + np.arange(n + 2) if integer else rng.uniform(0, 0.5) + rng.uniform(0, 0.3)
                     * np.arange(n + 2)) if comm else np.zeros(n + 2)

    def _lookup(self, tab: np.ndarray, s, c, batch) -> np.ndarray:
        s, c, b = np.broadcast_arrays(np.asarray(s, float), np.asarray(c, float), np.asarray(batch, float))
        return tab[(s // self.g).astype(int), (c // self.g).astype(int)] * b ** 0.9

    def forward_ms(self, slice_len, context, batch=1):
        return self._lookup(self.fwd, slice_len, context, batch)

    def backward_ms(self, slice_len, context, batch=1):
        return self._lookup(self.bwd, slice_len, context, batch)

    def comm_ms(self, slice_len, batch=1):
        s, b = np.broadcast_arrays(np.asarray(slice_len, float), np.asarray(batch, float))
        return self.comm[(s // self.g).astype(int)] * b


def slice_times(cost: PipelineCost, slices, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Per slice (w, t) of the slowest stage, straight from the cost model (no planner code)."""
    k = cost.num_chunks
    w, t = [], []
    ctx = 0
    for s in slices:
        per_stage = [(float(st.forward_ms(s, ctx, batch)), float(st.backward_ms(s, ctx, batch)),
                      float(st.comm_ms(s, batch))) for st in cost.stages]
        w.append(max(f + b for f, b, _ in per_stage))
        t.append(max(f + b + (2 * c if k > 1 else 0.0) for f, b, c in per_stage))
        ctx += s
    return np.array(w), np.array(t)


def closed_form(cost: PipelineCost, slices, units: int, batch: int) -> float:
    w, t = slice_times(cost, slices, batch)
    return units * float(w.sum()) + (cost.num_chunks - 1) * float(t.max())


def pair_tables(cost: PipelineCost, n: int, g: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """(w, t)[a, b] of slice [a*g, b*g) on the slowest stage, from the cost model (inf where a >= b)."""
    w = np.full((n + 1, n + 1), np.inf)
    t = np.full((n + 1, n + 1), np.inf)
    stages = list({id(st): st for st in cost.stages}.values())
    for a in range(n):
        lens = g * np.arange(1, n - a + 1)
        per = [(st.forward_ms(lens, g * a, batch), st.backward_ms(lens, g * a, batch), st.comm_ms(lens, batch))
               for st in stages]
        w[a, a + 1:] = np.max([f + b for f, b, _ in per], axis=0)
        t[a, a + 1:] = np.max([f + b + (2 * c if cost.num_chunks > 1 else 0) for f, b, c in per], axis=0)
    return w, t


def brute_force(cost: PipelineCost, seq_len: int, g: int, units: int, batch: int, n_min: int = 1,
                n_max: int | None = None) -> float:
    """min over ALL compositions of seq_len into multiples of g with n_min..n_max parts, vectorised over them."""
    n = seq_len // g
    n_max = n if n_max is None else n_max
    w, t = pair_tables(cost, n, g, batch)
    masks = np.arange(2 ** (n - 1))
    bits = ((masks[:, None] >> np.arange(n - 1)) & 1).astype(bool)              # bit j: cut at boundary j+1
    cut = np.concatenate([np.ones((len(masks), 1), bool), bits, np.ones((len(masks), 1), bool)], axis=1)
    inside = np.concatenate([np.zeros((len(masks), 1), int), np.cumsum(bits, axis=1)], axis=1)  # cuts in 1..j
    total = np.zeros(len(masks))
    top = np.full(len(masks), -np.inf)
    for a in range(n):
        for b in range(a + 1, n + 1):
            used = cut[:, a] & cut[:, b] & (inside[:, b - 1] == inside[:, a])   # no cut strictly inside
            total += np.where(used, w[a, b], 0.0)
            top = np.where(used, np.maximum(top, t[a, b]), top)
    count = bits.sum(axis=1) + 1
    value = units * total + (cost.num_chunks - 1) * top
    value[(count < n_min) | (count > n_max)] = np.inf
    return float(value.min())


def reference_thresholds(cost: PipelineCost, seq_len: int, g: int, units: int, batch: int) -> float:
    """Every threshold, no pruning: min over tau of units * minsum(tau) + (K-1) * tau. For N too big to brute force."""
    n = seq_len // g
    w, t = pair_tables(cost, n, g, batch)
    best = math.inf
    for tau in np.unique(t[np.isfinite(t)]):
        wm = np.where(t <= tau, w, np.inf)
        f = np.full(n + 1, np.inf)
        f[0] = 0
        for b in range(1, n + 1):
            f[b] = (f[:b] + wm[:b, b]).min()
        best = min(best, units * f[n] + (cost.num_chunks - 1) * tau)
    return best


def random_instance(seed: int):
    rng = np.random.default_rng(seed)
    g = int(rng.integers(1, 5))
    n = int(rng.integers(1, 17)) if seed % 40 else int(rng.integers(17, 19))
    k = int(rng.integers(1, 9))
    m = int(rng.integers(1, 5))
    context = (0.0, 0.02, 0.1, 1.0)[seed % 4]   # from "slicing is free" to "context dominates"
    overhead = (0.1, 1.0, 3.0)[seed % 3]
    cost = PipelineCost.uniform(TableCost(rng, n, g, integer=bool(seed % 5 == 0), comm=bool(seed % 2),
                                          context=context, overhead=overhead), k)
    max_slices = int(rng.integers(1, n + 1)) if seed % 4 == 1 else None
    return cost, g * n, g, m, max_slices


# --------------------------------------------------------------------------------------------------------------
# Exactness

@pytest.mark.parametrize("block", range(8))
def test_dp_equals_brute_force_on_random_instances(block):
    num_sliced = 0
    for seed in range(block * 30, block * 30 + 30):      # 240 instances in all
        cost, seq_len, g, m, max_slices = random_instance(seed)
        plan = plan_slicing(cost, seq_len, num_microbatches=m, granularity=g, max_slices=max_slices)
        expect = brute_force(cost, seq_len, g, m, 1, n_max=max_slices)
        assert plan.predicted_ms == pytest.approx(expect, rel=1e-9), f"seed {seed}"
        # the returned slices really achieve it, and respect the grid and the cap
        assert closed_form(cost, plan.slices, m, 1) == pytest.approx(plan.predicted_ms, rel=1e-9), f"seed {seed}"
        assert sum(plan.slices) == seq_len and all(s % g == 0 for s in plan.slices)
        assert max_slices is None or plan.num_slices <= max_slices
        assert plan.unsliced_ms == pytest.approx(closed_form(cost, [seq_len], m, 1), rel=1e-12)
        num_sliced += plan.num_slices > 1
    assert num_sliced >= 5, "the instances must exercise the slicing trade-off, not only the unsliced plan"


@pytest.mark.parametrize("seed", [1001, 1002, 1003])
def test_pruned_search_equals_every_threshold_at_larger_n(seed):
    rng = np.random.default_rng(seed)
    n, g = 40, 2
    cost = PipelineCost.uniform(TableCost(rng, n, g, integer=seed == 1002, comm=True), int(rng.integers(2, 9)))
    m = int(rng.integers(1, 5))
    plan = plan_slicing(cost, n * g, num_microbatches=m, granularity=g)
    assert plan.predicted_ms == pytest.approx(reference_thresholds(cost, n * g, g, m, 1), rel=1e-9)


def test_single_stage_minimises_the_sum_only():
    rng = np.random.default_rng(7)
    cost = PipelineCost.uniform(TableCost(rng, 10, 4, comm=True), 1)
    plan = plan_slicing(cost, 40, num_microbatches=3, granularity=4)
    assert plan.predicted_ms == pytest.approx(brute_force(cost, 40, 4, 3, 1), rel=1e-12)
    assert plan.bubble_fraction == 0.0


# --------------------------------------------------------------------------------------------------------------
# Agreement with the simulator

def proportional_cost() -> PipelineCost:
    """Measured-style cost with backward = 2 x forward and no comm: the closed form is the simulator's makespan."""
    pts = [{"slice": s, "context": c, "forward_ms": 0.2 + 0.01 * s + 0.000002 * s * c,
            "backward_ms": 2 * (0.2 + 0.01 * s + 0.000002 * s * c)} for s in (8, 64, 512) for c in (0, 512, 2048)]
    return PipelineCost.uniform(MeasuredCost(pts), 6)


def test_closed_form_equals_the_simulated_gpipe_makespan():
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate

    cost = proportional_cost()
    plan = plan_slicing(cost, 1024, num_microbatches=3, granularity=32)
    assert plan.num_slices > 1 and plan.speedup > 1
    res = simulate(build_schedule("gpipe", 6, 3, plan.num_slices), cost, plan.slices, micro_batch_size=1)
    assert res.makespan_ms == pytest.approx(plan.predicted_ms, rel=1e-9)
    assert res.bubble_fraction == pytest.approx(plan.bubble_fraction, rel=1e-9)
    full = simulate(build_schedule("gpipe", 6, 3, 1), cost, [1024], micro_batch_size=1)
    assert full.makespan_ms == pytest.approx(plan.unsliced_ms, rel=1e-9)


def test_closed_form_equals_the_simulation_with_a_constant_comm_latency():
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate

    stage = proportional_cost().chunk(0)
    cost = PipelineCost.uniform(MeasuredCost(stage.to_dict()["points"], comm={"latency_ms": 0.7}), 5)
    plan = plan_slicing(cost, 1024, num_microbatches=2, granularity=32)
    res = simulate(build_schedule("gpipe", 5, 2, plan.num_slices), cost, plan.slices, micro_batch_size=1)
    assert plan.num_slices > 1 and res.makespan_ms == pytest.approx(plan.predicted_ms, rel=1e-9)


def test_closed_form_is_a_lower_bound_of_the_simulation_with_comm():
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate

    rng = np.random.default_rng(3)
    cost = PipelineCost.uniform(TableCost(rng, 16, 8, comm=True), 4)
    plan = plan_slicing(cost, 128, num_microbatches=2, granularity=8)
    res = simulate(build_schedule("gpipe", 4, 2, plan.num_slices), cost, plan.slices, micro_batch_size=1)
    assert plan.predicted_ms <= res.makespan_ms * (1 + 1e-12)


def test_unequal_stages_are_scored_by_the_simulator():
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate

    rng = np.random.default_rng(11)
    n, g, k, m = 12, 8, 4, 2
    stages = [TableCost(rng, n, g, comm=True) for _ in range(k)]
    cost = PipelineCost(stages)
    plan = plan_slicing(cost, n * g, num_microbatches=m, granularity=g)

    def sim(slices) -> float:
        return simulate(build_schedule("gpipe", k, m, len(slices)), cost, list(slices), 1).makespan_ms

    assert plan.predicted_ms == pytest.approx(sim(plan.slices), rel=1e-12)
    assert plan.unsliced_ms == pytest.approx(sim([n * g]), rel=1e-12) and plan.speedup >= 1.0
    # the closed-form optimum of the slowest stage is among the candidates, so the winner is at least as good
    slowest = PipelineCost.uniform(_MaxCost(stages), k)
    assert plan.predicted_ms <= sim(plan_slicing(slowest, n * g, num_microbatches=m, granularity=g).slices) + 1e-9


class _MaxCost(StageCost):
    def __init__(self, stages):
        self.stages = stages

    def forward_ms(self, s, c, batch=1):
        return np.max([st.forward_ms(s, c, batch) for st in self.stages], axis=0)

    def backward_ms(self, s, c, batch=1):
        return np.max([st.forward_ms(s, c, batch) + st.backward_ms(s, c, batch) for st in self.stages], axis=0) \
            - self.forward_ms(s, c, batch)

    def comm_ms(self, s, batch=1):
        return np.zeros(np.shape(s))


def test_1f1b_prediction_is_the_simulated_makespan():
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate

    cost = proportional_cost()
    plan = plan_slicing(cost, 1024, num_microbatches=4, granularity=64, schedule="1f1b")
    res = simulate(build_schedule("1f1b", 6, 4, plan.num_slices), cost, plan.slices, micro_batch_size=1)
    assert plan.schedule == "1f1b" and res.makespan_ms == pytest.approx(plan.predicted_ms, rel=1e-12)
    assert plan.speedup > 1


def test_preset_plan_pays_off_for_a_deep_pipeline():
    plan = plan_slicing(analytic_pipeline_cost("gpt3-175b", "v100", 8), 2048, granularity=64)
    assert plan.num_slices > 4 and plan.speedup > 2 and plan.predicted_ms < plan.unsliced_ms


# --------------------------------------------------------------------------------------------------------------
# Batch split

def test_batch_split_only_equal_divisors_and_matches_brute_force():
    for seed in range(12):
        rng = np.random.default_rng(100 + seed)
        n, g, k, m, batch = int(rng.integers(2, 10)), 2, int(rng.integers(2, 7)), int(rng.integers(1, 3)), 6
        cost = PipelineCost.uniform(TableCost(rng, n, g, comm=bool(seed % 2)), k)
        plan = plan_slicing(cost, n * g, num_microbatches=m, micro_batch_size=batch, granularity=g, split_batch=True)
        q = len(plan.batch_splits)
        assert batch % q == 0 and plan.batch_splits == (batch // q,) * q
        expect = min(brute_force(cost, n * g, g, m * d, batch // d) for d in (1, 2, 3, 6))
        assert plan.predicted_ms == pytest.approx(expect, rel=1e-9), f"seed {seed}"
        assert closed_form(cost, plan.slices, m * q, batch // q) == pytest.approx(plan.predicted_ms, rel=1e-9)
        assert plan.unsliced_ms == pytest.approx(closed_form(cost, [n * g], m, batch), rel=1e-12)
        unsplit = plan_slicing(cost, n * g, num_microbatches=m, micro_batch_size=batch, granularity=g)
        assert unsplit.batch_splits == (batch,) and unsplit.predicted_ms >= plan.predicted_ms * (1 - 1e-12)


def test_batch_split_is_chosen_when_it_pays():
    # times proportional to tokens (no overhead, no context), so splitting costs nothing and shrinks the bubble
    pts = [{"batch": 1, "slice": s, "context": c, "forward_ms": 0.01 * s, "backward_ms": 0.02 * s}
           for s in (8, 64) for c in (0, 64)]
    plan = plan_slicing(PipelineCost.uniform(MeasuredCost(pts), 4), 64, micro_batch_size=4, granularity=64,
                        split_batch=True)
    assert plan.batch_splits == (1, 1, 1, 1) and plan.slices == (64,)


# --------------------------------------------------------------------------------------------------------------
# Memory

def test_memory_estimate_formula():
    mem = MemoryModel(num_layers_per_stage=(3, 2), hidden=64, bytes_per_element=2, activation_factor=34)
    per_token_layer = 64 * (34 + 4)
    gp = mem.peak_bytes(schedule="gpipe", num_stages=2, num_microbatches=3, micro_batch_size=4, num_splits=2,
                        seq_len=128, num_slices=5)
    assert gp == 3 * 3 * 4 * 128 * per_token_layer                      # all m*B*L tokens alive, 3 layers
    # 1F1B: stage 0 of 4 holds (n + 3) / n sub-batches' worth of tokens (n slices), capped at m * q
    one = [MemoryModel(1, 64).peak_bytes(schedule="1f1b", num_stages=4, num_microbatches=8, micro_batch_size=1,
                                         num_splits=1, seq_len=128, num_slices=n) / (128 * per_token_layer)
           for n in (1, 2, 3, 8)]
    assert one == [4, 2.5, 2, 11 / 8]
    assert MemoryModel(1, 64).live_subbatches("1f1b", 0, 4, 2, 1) == 2        # only m * q = 2 exist
    assert MemoryModel(1, 64).live_subbatches("1f1b", 3, 4, 8, 5) == 1        # the last stage: one at a time
    # the busiest stage decides: stage 1 has more layers than stage 0 holds extra units
    two = MemoryModel((1, 4), 64).peak_bytes(schedule="1f1b", num_stages=2, num_microbatches=8, micro_batch_size=1,
                                             num_splits=1, seq_len=128, num_slices=2)
    assert two == 4 * 1 * 128 * per_token_layer
    fp32 = MemoryModel(1, 64, bytes_per_element=4).peak_bytes(
        schedule="gpipe", num_stages=1, num_microbatches=1, micro_batch_size=1, num_splits=1, seq_len=1, num_slices=1)
    assert fp32 == 64 * (34 * 2 + 8)


def test_memory_cap_accepts_and_rejects():
    cost = proportional_cost()
    mem = MemoryModel(4, 256)
    need = mem.peak_bytes(schedule="gpipe", num_stages=6, num_microbatches=2, micro_batch_size=1, num_splits=1,
                          seq_len=1024, num_slices=1)
    ok = plan_slicing(cost, 1024, num_microbatches=2, granularity=64, memory=mem, memory_limit_bytes=need)
    assert ok.memory_bytes == need
    with pytest.raises(ValueError, match=r"memory_limit_bytes = .* cannot be met: the smallest estimated peak is "):
        plan_slicing(cost, 1024, num_microbatches=2, granularity=64, memory=mem, memory_limit_bytes=need * 0.999)


def _engine_with_cap(memory_limit_gb: float, *, interval: int = 0, schedule: str = "1f1b", **terapipe):
    """What ``solve_slicing`` reads of an engine: 2 stages of 2 layers (hidden 64, 16 bits), micro-batches 2 x 2."""
    from types import SimpleNamespace

    from ds_terapipe.config import parse_terapipe_config

    cfg = parse_terapipe_config({"terapipe": {"enabled": True, "slices": "auto", "seq_len": 256, "granularity": 32,
                                              "schedule": schedule, "memory_limit_gb": memory_limit_gb, **terapipe}})
    engine = SimpleNamespace(terapipe=cfg, num_stages=2, num_chunks=2, placement=[0, 1], micro_batches=2,
                             micro_batch_size=2, module=SimpleNamespace(activation_checkpoint_interval=interval))
    return engine, [{"layers": 2, "hidden": 64, "bytes": 2}] * 2


def test_the_engine_plans_a_length_too_fine_for_its_granularity_on_a_coarser_grid(monkeypatch, caplog):
    """More units than the planner searches (seq_len / granularity > MAX_UNITS; 2048, made 16 here) is planned on
    the finest multiple of the granularity that fits, logged, where the planner's own API refuses it."""
    import logging

    from ds_terapipe.planner import _checks
    from ds_terapipe.planner._checks import fitting_granularity
    from ds_terapipe.runtime.planning.plan import solve_slicing

    assert (fitting_granularity(32768, 8), fitting_granularity(65536, 8), fitting_granularity(16384, 8)) == (16, 32, 8)
    assert fitting_granularity(8 * 4099, 8) == 8 * 4099   # a prime count of units: one slice is the only grid
    monkeypatch.setattr(_checks, "MAX_UNITS", 16)
    cost = PipelineCost.uniform(MeasuredCost([{"slice": s, "context": c, "forward_ms": 0.2 + 0.01 * s,
                                               "backward_ms": 0.4 + 0.02 * s} for s in (8, 256) for c in (0, 248)]), 2)
    with pytest.raises(ValueError, match="32 slice units, more than the 16"):
        plan_slicing(cost, 256, granularity=8)
    engine, meta = _engine_with_cap(None, granularity=8)
    with caplog.at_level(logging.INFO, logger="ds_terapipe.runtime.planning.plan"):
        plan = solve_slicing(engine, cost, meta, 256)
    assert sum(plan.slices) == 256 and len(plan.slices) > 1 and all(s % 16 == 0 for s in plan.slices), plan.slices
    assert "seq_len 256 is 32 slice units of terapipe.granularity=8, more than the 16 the planner searches: " \
           "planning it on a grid of 16 tokens" in caplog.text


def test_the_engine_refuses_an_unmet_memory_cap_in_config_terms():
    """terapipe.memory_limit_gb no plan meets: the key, its value and the smallest estimate in GB, and config
    actions as the fixes (not the planner's memory_limit_bytes / split_batch / MemoryModel.activation_factor)."""
    from ds_terapipe.runtime.planning.plan import solve_slicing

    cost = PipelineCost.uniform(MeasuredCost([{"slice": s, "context": c, "forward_ms": 0.2 + 0.01 * s,
                                               "backward_ms": 0.4 + 0.02 * s} for s in (32, 256) for c in (0, 224)]), 2)
    engine, meta = _engine_with_cap(1e-5)
    smallest = MemoryModel(2, 64, 2).peak_bytes(schedule="1f1b", num_stages=2, num_microbatches=2, micro_batch_size=2,
                                                num_splits=1, seq_len=256, num_slices=8) / 2**30
    with pytest.raises(ValueError) as err:
        solve_slicing(engine, cost, meta, 256)
    message = str(err.value)
    assert message.startswith(f"terapipe.memory_limit_gb = 1e-05 cannot be met: the smallest activation estimate of "
                              f"any plan the planner may choose is {smallest:.3g} GB on the busiest stage; "), message
    enough = float(f"{smallest * 1.01:.3g}")
    assert enough >= smallest
    for fix in (f"raise terapipe.memory_limit_gb to {enough:g} or more",
                "lower train_micro_batch_size_per_gpu (now 2)", "terapipe.seq_len; this batch's: 256 tokens",
                "turn on activation checkpointing (activation_checkpoint_interval=1 on the pipeline module",
                'docs/configuration.md, "Activation checkpointing with slices"', "use more pipeline stages (now 2)"):
        assert fix in message, (fix, message)
    for planner_word in ("memory_limit_bytes", "split_batch", "MemoryModel", "activation_factor"):
        assert planner_word not in message, message
    # a cap the estimate meets plans as before
    engine, meta = _engine_with_cap(smallest * 1.01)
    assert solve_slicing(engine, cost, meta, 256).memory_bytes <= smallest * 1.01 * 2**30


def test_the_engine_s_memory_refusal_suggests_only_what_lowers_the_estimate():
    from ds_terapipe.planner.slicing import MemoryShortfall
    from ds_terapipe.runtime.planning.plan import memory_limit_refusal

    short = MemoryShortfall(smallest_bytes=3 * 2**29, lower_schedule="gpipe", split_batch_helps=True,
                            more_slices_help=True)
    engine, _ = _engine_with_cap(0.5, interval=2, max_slices=2)
    message = memory_limit_refusal(engine.terapipe, short, seq_len=256, micro_batch_size=1, num_stages=4,
                                   checkpoint_interval=2)
    assert "terapipe.memory_limit_gb = 0.5 cannot be met" in message and "is 1.5 GB" in message, message
    assert "use terapipe.schedule 'gpipe'" in message and "raise terapipe.max_slices (now 2)" in message, message
    # checkpointing is on already; one sequence per micro-batch and no batch split in the engine: nothing to offer
    for absent in ("checkpoint", "micro_batch_size", "split"):
        assert absent not in message, (absent, message)
    assert message.endswith("or raise terapipe.max_slices (now 2)"), message
    # gpipe defers the weight gradients to the micro-batch's end: they keep what checkpointing would free
    engine, _ = _engine_with_cap(0.5, schedule="gpipe")
    deferred = memory_limit_refusal(engine.terapipe, short, seq_len=256, micro_batch_size=1, num_stages=4,
                                    checkpoint_interval=0)
    assert "set terapipe.deferred_weight_grads to false and turn on activation checkpointing (" in deferred, deferred
    on = memory_limit_refusal(engine.terapipe, short, seq_len=256, micro_batch_size=1, num_stages=4,
                              checkpoint_interval=1)
    assert "set terapipe.deferred_weight_grads to false (it keeps what activation checkpointing frees)" in on, on


def test_memory_cap_forces_more_slices_under_1f1b_exactly():
    rng = np.random.default_rng(5)
    n, g, k, m = 12, 4, 6, 3
    cost = PipelineCost.uniform(TableCost(rng, n, g), k)
    mem = MemoryModel(1, 16)

    def peak(num_slices: int) -> float:
        return mem.peak_bytes(schedule="1f1b", num_stages=k, num_microbatches=m, micro_batch_size=1, num_splits=1,
                              seq_len=n * g, num_slices=num_slices)

    free = plan_slicing(cost, n * g, num_microbatches=m, granularity=g, schedule="1f1b")
    limit = peak(free.num_slices + 2)
    assert limit < peak(free.num_slices), "the test needs a binding cap"
    n_min = min(c for c in range(1, n + 1) if peak(c) <= limit)
    capped = plan_slicing(cost, n * g, num_microbatches=m, granularity=g, schedule="1f1b", memory=mem,
                          memory_limit_bytes=limit)
    assert capped.num_slices >= n_min and capped.memory_bytes <= limit
    with pytest.raises(ValueError, match="cannot be met"):
        plan_slicing(cost, n * g, num_microbatches=m, granularity=g, schedule="1f1b", memory=mem,
                     memory_limit_bytes=limit, max_slices=n_min - 1)


def test_slice_count_limited_dps_equal_brute_force():
    # uniform gpipe with a memory cap is slicing-independent, so drive the count-limited DPs directly
    from ds_terapipe.planner.slicing import _Dp, _tables, _thresholds

    above_min = 0
    for seed in range(24):
        rng = np.random.default_rng(300 + seed)
        n, g, k, m = int(rng.integers(4, 13)), 2, int(rng.integers(4, 9)), int(rng.integers(1, 3))
        cost = PipelineCost.uniform(TableCost(rng, n, g, integer=bool(seed % 2), comm=True, context=0.02), k)
        n_min = int(rng.integers(2, 4))
        n_max = int(rng.integers(n_min, n + 1)) if seed % 3 == 0 else n
        value, cuts, _, _ = _thresholds(_Dp(*_tables(cost, n, g, 1), n_min, n_max), m, k)
        assert value == pytest.approx(brute_force(cost, n * g, g, m, 1, n_min, n_max), rel=1e-9), f"seed {seed}"
        slices = [g * (b - a) for a, b in zip(cuts[:-1], cuts[1:])]
        assert closed_form(cost, slices, m, 1) == pytest.approx(value, rel=1e-9) and n_min <= len(slices) <= n_max
        above_min += len(slices) > n_min
    assert above_min >= 5, "instances must exercise plans with more slices than the minimum"


def test_simulated_choice_is_the_best_candidate():
    # white box: the winner must be the best simulated plan of the candidate set, whatever the pruning skipped
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate
    from ds_terapipe.planner.slicing import _SIM_MAX, _SIM_WINDOW, _Dp, _tables, _thresholds

    for seed in range(6):
        rng = np.random.default_rng(500 + seed)
        n, g, k, m = 10, 4, int(rng.integers(2, 6)), int(rng.integers(1, 4))
        cost = PipelineCost([TableCost(rng, n, g, comm=True) for _ in range(k)])
        schedule = ("gpipe", "1f1b")[seed % 2]
        plan = plan_slicing(cost, n * g, num_microbatches=m, granularity=g, schedule=schedule)
        candidates = [c for _, c in _thresholds(_Dp(*_tables(cost, n, g, 1), 1, n), m, k, _SIM_WINDOW, _SIM_MAX)[3]]
        candidates += [[0, n]]
        sims = [simulate(build_schedule(schedule, k, m, len(c) - 1), cost, [g * (b - a) for a, b in zip(c, c[1:])],
                         1).makespan_ms for c in candidates]
        assert plan.predicted_ms == pytest.approx(min(sims), rel=1e-12), f"seed {seed}"


def reference_search(cost: PipelineCost, seq_len: int, g: int, m: int, batch: int, schedule: str, *,
                     skip_by_bound: bool = False) -> tuple[float, tuple[int, ...], tuple[int, ...]]:
    """plan_slicing's search as one plain loop: every batch split, every candidate of it simulated (or, for equal
    stages under gpipe, the exact closed form), in the planner's order; the first strictly best wins.
    ``skip_by_bound``: skip a candidate whose lower bound is at least the best so far (nothing pruned without)."""
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate
    from ds_terapipe.planner.slicing import _SIM_MAX, _SIM_WINDOW, _Dp, _Simulated, _tables, _thresholds

    n, k = seq_len // g, cost.num_chunks
    best: tuple[float, tuple[int, ...], tuple[int, ...]] | None = None
    for q in [d for d in range(1, batch + 1) if batch % d == 0]:
        units, sub = m * q, batch // q
        dp = _Dp(*_tables(cost, n, g, sub), 1, n)
        if schedule == "gpipe" and cost.is_uniform():
            value, cuts = _thresholds(dp, units, k)[:2]
            scored = [(value, cuts)]
        else:
            plans = [c for _, c in _thresholds(dp, units, k, _SIM_WINDOW, _SIM_MAX)[3]]
            plans += [] if [0, n] in plans else [[0, n]]
            slicings = [[g * (b - a) for a, b in zip(c, c[1:])] for c in plans]
            bounds = _Simulated(cost, schedule, seq_len).lower_bounds(slicings, units, sub)
            scored = [(simulate(build_schedule(schedule, k, units, len(c) - 1), cost, slices, sub).makespan_ms, c)
                      for c, slices, bound in zip(plans, slicings, bounds)
                      if not (skip_by_bound and best is not None and bound >= best[0])]
        for value, cuts in scored:
            if best is None or value < best[0]:
                best = (value, tuple(g * (b - a) for a, b in zip(cuts, cuts[1:])), (sub,) * q)
    assert best is not None
    return best


# model, stages, micro-batch size, schedule, LM head: instances where a 10% over-prune changes the plan (asserted)
PRUNING_CASES = [("gpt3-1b", 4, 24, "gpipe", True), ("gpt3-1b", 4, 12, "1f1b", True),
                 ("gpt3-1b", 4, 24, "gpipe", False), ("gpt3-13b", 2, 36, "1f1b", False),
                 ("gpt3-13b", 4, 12, "gpipe", True), ("gpt3-1b", 2, 36, "gpipe", False)]


def _pruning_plans() -> list[tuple[float, tuple[int, ...], tuple[int, ...]]]:
    out = []
    for model, k, batch, schedule, head in PRUNING_CASES:
        plan = plan_slicing(analytic_pipeline_cost(model, "a100", k, lm_head=head), 512, micro_batch_size=batch,
                            granularity=32, schedule=schedule, split_batch=True)
        out.append((plan.predicted_ms, plan.slices, plan.batch_splits))
    return out


def test_pruned_split_search_equals_the_unpruned_search():
    """The splits skipped by their bound, the candidates skipped by theirs and the order they are simulated in
    change nothing: the plan is the unpruned search's, bit for bit."""
    for case, got in zip(PRUNING_CASES, _pruning_plans()):
        model, k, batch, schedule, head = case
        cost = analytic_pipeline_cost(model, "a100", k, lm_head=head)
        assert got == reference_search(cost, 512, 32, 1, batch, schedule), case


def assert_over_pruning_changes(monkeypatch, make_plans, plans) -> None:
    """Bounds 10% too high (a split's, or a candidate's) change some of ``make_plans()`` (``plans`` with the true
    bounds): cases the pruning decides, so comparing them with the unpruned search catches an over-prune."""
    from ds_terapipe.planner import slicing

    with monkeypatch.context() as patch:
        patch.setattr(slicing, "_BOUND_SLACK", -0.1)   # every split's bound x 1.1
        assert make_plans() != plans
    bounds = slicing._Simulated.lower_bounds
    with monkeypatch.context() as patch:
        patch.setattr(slicing._Simulated, "lower_bounds", lambda self, *args: 1.1 * bounds(self, *args))
        assert make_plans() != plans


def test_the_pruning_cases_decide_the_plan(monkeypatch):
    """The cases above are ones the pruning decides, so the test above would catch an over-prune."""
    assert_over_pruning_changes(monkeypatch, _pruning_plans, _pruning_plans())


def _tied_splits(seed: int, batch: int) -> tuple[PipelineCost, int]:
    """One rank, costs linear in the batch: every split's makespan is the same up to rounding."""
    rng = np.random.default_rng(seed)
    pts = [{"slice": s, "context": c, "forward_ms": float(0.1 + 0.01 * s * rng.uniform(0.5, 2) + 1e-5 * s * c),
            "backward_ms": float(0.2 + 0.02 * s * rng.uniform(0.5, 2) + 2e-5 * s * c)}
           for s in (32, 64, 256) for c in (0, 64)]
    return PipelineCost.uniform(MeasuredCost(pts), 1), batch


TIED_CASES = [_tied_splits(27, 6), _tied_splits(27, 12), _tied_splits(59, 6), _tied_splits(59, 12)]


def _tied_plans() -> list[tuple[float, tuple[int, ...], tuple[int, ...]]]:
    plans = [plan_slicing(cost, 256, micro_batch_size=batch, granularity=32, schedule="1f1b", split_batch=True)
             for cost, batch in TIED_CASES]
    return [(p.predicted_ms, p.slices, p.batch_splits) for p in plans]


def test_splits_tied_to_the_last_bits_go_as_in_the_plain_loop(monkeypatch):
    """A bound can exceed its plan's makespan by an ulp, and the plain loop then skips a plan that ties the best
    to the last bits. The plan is still the plain loop's, not whichever one the bound-ordered search met first
    (the cases need that: without the replay of the near ties the plans differ)."""
    from ds_terapipe.planner import slicing

    plans = _tied_plans()
    assert plans == [reference_search(cost, 256, 32, 1, batch, "1f1b", skip_by_bound=True)
                     for cost, batch in TIED_CASES]
    monkeypatch.setattr(slicing._Candidates, "finish", lambda self: self.run(math.inf))
    assert _tied_plans() != plans


# --------------------------------------------------------------------------------------------------------------
# Plans and errors

def test_plan_round_trips_through_json_and_prints_briefly():
    plan = plan_slicing(proportional_cost(), 1024, num_microbatches=2, granularity=32, memory=MemoryModel(2, 64))
    again = SlicingPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again == plan and isinstance(again.slices, tuple)
    text = str(plan)
    assert "gpipe K=6 m=2" in text and f"{plan.num_slices} slices" in text and "x" in text and "\n" not in text
    assert plan.speedup == pytest.approx(plan.unsliced_ms / plan.predicted_ms)
    with pytest.raises(ValueError, match="must be positive and sum to seq_len = 1024"):
        SlicingPlan.from_dict({**plan.to_dict(), "slices": [512, 256]})
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        SlicingPlan.from_dict({**plan.to_dict(), "extra": 1})
    with pytest.raises(ValueError, match=r"batch_splits = \(1, 1\) must be positive and sum to micro_batch_size"):
        SlicingPlan.from_dict({**plan.to_dict(), "batch_splits": [1, 1]})


def test_extrapolation_is_logged(caplog):
    pts = [{"slice": s, "context": c, "forward_ms": 0.1 * s, "backward_ms": 0.2 * s} for s in (64, 128)
           for c in (0, 128)]
    with caplog.at_level(logging.WARNING, logger="ds_terapipe.planner.slicing"):
        plan_slicing(PipelineCost.uniform(MeasuredCost(pts), 2), 1024, granularity=64)
    assert "extrapolated" in caplog.text


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_no_slice_shorter_than_min_slice_len(schedule):
    # measured from 256 tokens up, no fixed cost per slice in the fit: extrapolated, 8-token slices look free
    pts = [{"slice": s, "context": c, "forward_ms": 0.01 * s + 1e-5 * s * (c + s / 2),
            "backward_ms": 0.02 * s + 2e-5 * s * (c + s / 2)} for s in (256, 512, 1024, 2048) for c in (0, 1024)]
    cost = PipelineCost.uniform(MeasuredCost(pts), 2)
    blind = plan_slicing(cost, 2048, num_microbatches=4, granularity=8, schedule=schedule)
    assert min(blind.slices) < 256
    for floor in (256, 200, 4096):
        plan = plan_slicing(cost, 2048, num_microbatches=4, granularity=8, schedule=schedule, min_slice_len=floor)
        assert min(plan.slices) >= min(floor, 2048) and sum(plan.slices) == 2048, (floor, plan.slices)
        assert plan.predicted_ms >= blind.predicted_ms


@pytest.mark.parametrize("kwargs, exc, needle", [
    ({"seq_len": 4, "granularity": 8}, ValueError, "seq_len = 4 is smaller than granularity = 8"),
    ({"min_slice_len": 0}, ValueError, "min_slice_len = 0 must be >= 1"),
    ({"granularity": 0}, ValueError, "granularity = 0 must be >= 1"),
    ({"granularity": 2.0}, TypeError, "granularity = 2.0 must be an int"),
    ({"seq_len": 100, "granularity": 8}, ValueError, r"seq_len = 100 is not a multiple of granularity = 8.*e\.g\. 4"),
    ({"num_microbatches": 0}, ValueError, "num_microbatches = 0 must be >= 1"),
    ({"micro_batch_size": 0}, ValueError, "micro_batch_size = 0 must be >= 1"),
    ({"micro_batch_size": True}, TypeError, "micro_batch_size = True must be an int"),
    ({"schedule": "interleaved"}, ValueError, "schedule = 'interleaved' is unknown; valid: gpipe, 1f1b"),
    ({"max_slices": 0}, ValueError, "max_slices = 0 must be >= 1"),
    ({"memory_limit_bytes": 1e9}, ValueError, r"memory_limit_bytes = 1000000000\.0 needs memory=MemoryModel"),
    ({"memory_limit_bytes": -1.0, "memory": MemoryModel(1, 8)}, ValueError, "memory_limit_bytes = -1.0 must be"),
    ({"memory": MemoryModel((1, 2, 3), 8)}, ValueError, "num_layers_per_stage has 3 entries but the cost has 6"),
    ({"memory": {"hidden": 8}}, TypeError, "memory must be a MemoryModel, got dict"),
    # a grid too fine to search: refused with the granularity that fits, before any table is allocated
    ({"seq_len": 65536, "granularity": 8}, ValueError,
     "seq_len = 65536 at granularity = 8 is 8192 slice units, more than the 2048 .*; use granularity = 32"),
    ({"seq_len": 2 ** 20, "granularity": 1}, ValueError, "is 1048576 slice units.*; use granularity = 512"),
])
def test_user_errors_name_the_argument(kwargs, exc, needle):
    args = {"seq_len": 1024, "granularity": 32, **kwargs}
    with pytest.raises(exc, match=needle):
        plan_slicing(proportional_cost(), **args)


def test_cost_must_be_a_pipeline_cost_and_models_must_be_sane():
    with pytest.raises(TypeError, match="cost must be a PipelineCost, got dict"):
        plan_slicing({"points": []}, 64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"MemoryModel\.hidden = 0 must be >= 1"):
        MemoryModel(1, 0)
    with pytest.raises(ValueError, match=r"MemoryModel\.activation_factor = -1 must be"):
        MemoryModel(1, 8, activation_factor=-1)

    class Broken(TableCost):
        def backward_ms(self, slice_len, context, batch=1):
            return np.full(np.shape(slice_len), np.nan)

    with pytest.raises(ValueError, match="stage 0 cost model returned a negative or non-finite backward_ms"):
        plan_slicing(PipelineCost.uniform(Broken(np.random.default_rng(0), 4, 4), 2), 16, granularity=4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_deferred_weight_grads_are_planned_by_simulating_w_actions(schedule):
    from ds_terapipe.planner.schedule import build_schedule, defer_weights
    from ds_terapipe.planner.simulate import simulate

    points = [{"slice": s, "context": c, "forward_ms": 0.2 + 0.01 * s * (1 + c / 512),
               "backward_ms": 0.3 + 0.012 * s * (1 + c / 512)} for s in (16, 64, 256) for c in (0, 256 - s)]
    cost = PipelineCost.from_dict({"points": points, "weight_ms_per_token": 0.01}, num_stages=2)
    plan = plan_slicing(cost, 256, num_microbatches=1, granularity=16, schedule=schedule,
                        deferred_weight_grads=True)
    sched = defer_weights(build_schedule(schedule, 2, 1, plan.num_slices))
    assert plan.predicted_ms == pytest.approx(simulate(sched, cost, list(plan.slices)).makespan_ms)
    unsliced = simulate(defer_weights(build_schedule(schedule, 2, 1, 1)), cost, [256]).makespan_ms
    assert plan.unsliced_ms == pytest.approx(unsliced)
    assert plan.num_slices > 1 and plan.predicted_ms < unsliced


def test_a_cost_with_weight_terms_is_refused_without_deferred_weight_grads():
    """Its backward times leave the weight gradients out: planned without W actions, that work would vanish
    from every predicted step (the CLI did that once), so the planner refuses, saying how to fix it."""
    points = [{"slice": s, "context": c, "forward_ms": 0.01 * s, "backward_ms": 0.02 * s}
              for s in (16, 64, 256) for c in (0, 256 - s)]
    cost = PipelineCost.from_dict({"points": points, "weight_ms_per_token": 0.01}, num_stages=2)
    assert cost.has_weight_terms and not PipelineCost.from_dict({"points": points}, num_stages=2).has_weight_terms
    with pytest.raises(ValueError, match="measured with deferred weight gradients.*pass deferred_weight_grads=True"):
        plan_slicing(cost, 256, granularity=16)
    assert plan_slicing(cost, 256, granularity=16, deferred_weight_grads=True).num_slices >= 1


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_the_vocabulary_share_is_planned_on_every_chunk(schedule, v):
    """With ``cost.vocab`` the slicer plans as if each chunk carried 1/v of its rank's share per slice: the plan
    equals the one for the folded cost, and the share makes it slower than without (the passes are work)."""
    from ds_terapipe.planner.cost import VocabShareCost

    points = [{"slice": s, "context": c, "forward_ms": 0.2 + 0.01 * s * (1 + c / 512),
               "backward_ms": 0.3 + 0.012 * s * (1 + c / 512)} for s in (16, 64, 256) for c in (0, 256 - s)]
    head = [{"slice": s, "context": 0, "forward_ms": 0.5 + 0.02 * s, "backward_ms": 1.0 + 0.04 * s}
            for s in (16, 64, 256)]
    base = PipelineCost.from_dict({"points": points}, num_stages=2 * v)
    share = VocabShareCost(MeasuredCost(head), 2, 64, link_latency_ms=0.05, link_gbps=10.0, head_is_shard=True)
    with_vocab = PipelineCost(base.stages, vocab=share)
    kw = dict(num_microbatches=2 * v, granularity=16, schedule=schedule, virtual_stages=v)
    plan = plan_slicing(with_vocab, 256, **kw)
    folded = plan_slicing(with_vocab.folded_vocab(v), 256, **kw)
    assert plan.slices == folded.slices and plan.predicted_ms == pytest.approx(folded.predicted_ms)
    assert plan.predicted_ms > plan_slicing(base, 256, **kw).predicted_ms


# --------------------------------------------------------------------------------------------------------------
# Sliding windows: a slice's attention stops growing with its prefix past the window; nothing in the search
# assumes it keeps growing

def windowed_instance(seed: int) -> tuple[PipelineCost, PipelineCost, int, int, int]:
    """A small analytic model with sliding windows (none, short, long, or per layer) on a toy device where
    attention, per-layer overhead and the bubble trade off; and the same model with full attention."""
    from ds_terapipe.planner.cost import DeviceSpec, TransformerSpec

    rng = np.random.default_rng(seed)
    g, n = 4, int(rng.integers(6, 15))
    layers = int(rng.integers(2, 7))
    stages = int(rng.integers(2, min(layers, 4) + 1))
    window = [None, int(rng.integers(1, 6)), int(rng.integers(6, g * n)),
              tuple(None if rng.random() < 0.4 else int(rng.integers(1, g * n)) for _ in range(layers))][seed % 4]
    device = DeviceSpec("toy", peak_tflops=1e-4, mem_bw_gbps=10.0, efficiency=1.0, link_gbps=1.0,
                        per_layer_overhead_ms=float(rng.choice([5.0, 20.0, 50.0])),
                        link_latency_ms=float(rng.uniform(0, 5)), attention_efficiency=float(rng.choice([0.01, 0.03])))
    costs = [analytic_pipeline_cost(TransformerSpec(num_layers=layers, hidden=64, num_heads=4, vocab=100,
                                                    seq_len=g * n, window=w), device, stages, lm_head=False)
             for w in (window, None)]
    return costs[0], costs[1], g * n, g, int(rng.integers(1, 4))


def test_windowed_models_plan_as_the_plain_search_does():
    """Equal stages under gpipe: the bound-ordered threshold search equals brute force over every slicing.
    Stages holding different windows: the plan is the plain loop's (every candidate simulated, none skipped by
    its bound). The windows change many of the plans."""
    num_changed = 0
    for seed in range(40):
        cost, full, seq_len, g, m = windowed_instance(seed)
        plan = plan_slicing(cost, seq_len, num_microbatches=m, granularity=g)
        if cost.is_uniform():
            assert plan.predicted_ms == pytest.approx(brute_force(cost, seq_len, g, m, 1), rel=1e-9), f"seed {seed}"
            assert closed_form(cost, plan.slices, m, 1) == pytest.approx(plan.predicted_ms, rel=1e-9)
        else:
            best_ms, slices = reference_search(cost, seq_len, g, m, 1, "gpipe")[:2]
            # the plain loop's time; a tie may keep another slicing (its sums in another order differ in the last bit)
            assert plan.predicted_ms == pytest.approx(best_ms, rel=1e-12), (seed, plan.slices, slices)
        num_changed += plan.slices != plan_slicing(full, seq_len, num_microbatches=m, granularity=g).slices
    assert num_changed >= 10, "the windows must change the plans the test checks"


# Mistral-like (a window on every layer) and Gemma-2-like (full attention on every second) layers: window, full
# attention every k layers, schedule, sequence length, granularity, micro-batch size
WINDOWED_CASES = [(64, None, "gpipe", 512, 32, 12), (128, 2, "1f1b", 512, 32, 12), (128, None, "gpipe", 2048, 64, 6),
                  (256, 2, "1f1b", 2048, 128, 4)]


def _windowed_plans() -> list[tuple[float, tuple[int, ...], tuple[int, ...]]]:
    out = []
    for window, full_every, schedule, seq_len, g, batch in WINDOWED_CASES:
        model = resolve_model("gpt3-1b" if full_every is None else "gpt3-13b", window=window, full_every=full_every)
        plan = plan_slicing(analytic_pipeline_cost(model, "a100", 4), seq_len, micro_batch_size=batch, granularity=g,
                            schedule=schedule, split_batch=True)
        out.append((plan.predicted_ms, plan.slices, plan.batch_splits))
    return out


def test_windowed_pruned_searches_equal_the_unpruned_ones(monkeypatch):
    """At sizes past brute force: the threshold search against every threshold, and the batch splits and
    candidates skipped by their bounds against the plain loop; bounds 10% too high change these plans."""
    cost = analytic_pipeline_cost(resolve_model("gpt3-1b", window=96), "a100", 4, lm_head=False)
    assert cost.is_uniform()
    plan = plan_slicing(cost, 320, num_microbatches=3, granularity=8)
    assert plan.predicted_ms == pytest.approx(reference_thresholds(cost, 320, 8, 3, 1), rel=1e-9)
    plans = _windowed_plans()
    for (window, full_every, schedule, seq_len, g, batch), got in zip(WINDOWED_CASES, plans):
        model = resolve_model("gpt3-1b" if full_every is None else "gpt3-13b", window=window, full_every=full_every)
        expect = reference_search(analytic_pipeline_cost(model, "a100", 4), seq_len, g, 1, batch, schedule)
        assert got == expect, (window, full_every, schedule)
    assert any(len(slices) > 1 for _, slices, _ in plans)
    assert_over_pruning_changes(monkeypatch, _windowed_plans, plans)


def test_a_window_evens_out_the_slices_past_it():
    """Full attention makes later slices dearer, so the plan shortens them; past a window they all cost alike,
    so they are one length (up to the grid), and the step is faster."""
    g, seq_len, window = 128, 8192, 2048
    full, windowed = (plan_slicing(analytic_pipeline_cost(resolve_model("gpt3-1b", window=w), "h100", 8), seq_len,
                                   granularity=g) for w in (None, window))
    assert full.slices[0] - full.slices[-1] > 2 * g
    starts = np.cumsum((0,) + windowed.slices[:-1])
    past = np.asarray(windowed.slices)[starts >= window]
    assert len(past) >= 3 and past.max() - past.min() <= g, windowed.slices
    assert windowed.predicted_ms < full.predicted_ms

"""Tier (a): cost models, the cost file format and presets. Pure Python, no torch.

    python -m pytest -q tests/test_cost.py
"""
from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest

from ds_terapipe.planner.cost import (
    AnalyticCost, DeviceSpec, MeasuredCost, PipelineCost, TransformerSpec, load_cost_file,
)
from ds_terapipe.planner.presets import (
    DEVICE_PRESETS, MODEL_PRESETS, analytic_layer_costs, analytic_pipeline_cost, get_device_preset,
    get_model_preset, preset_memory_model, resolve_model, split_layers,
)
from ds_terapipe.planner.roofline import MAX_CHUNK_BLOCKS, Chunked, computed_pairs, visible_keys, visible_pairs
from ds_terapipe.planner.schedule import ActionKind, build_gpipe, defer_weights
from ds_terapipe.planner.simulate import simulate
from ds_terapipe.planner.slicing import plan_slicing

A = (0.3, 0.011, 0.0023, 1.7e-5)   # a0 + a1*s + a2*c + a3*s*c


def bilinear(s: float, c: float, scale: float = 1.0) -> float:
    return scale * (A[0] + A[1] * s + A[2] * c + A[3] * s * c)


def grid_points(batch: int = 1, scale: float = 1.0) -> list[dict]:
    return [{"batch": batch, "slice": s, "context": c, "forward_ms": bilinear(s, c, scale),
             "backward_ms": bilinear(s, c, 2.1 * scale)}
            for s in (64, 128, 256, 512) for c in (0, 256, 512, 1024)]


def file_obj() -> dict:
    return {"points": grid_points(), "comm": {"latency_ms": 0.05, "gbps": 10.0}, "hidden": 2048,
            "bytes_per_element": 2}


# --------------------------------------------------------------------------------------------------------------
# MeasuredCost fit

def test_context_zero_returns_measured_time_exactly_even_when_t0_is_nonlinear():
    rng = np.random.default_rng(0)
    lens = [16, 48, 64, 200, 512]
    t0 = {s: float(v) for s, v in zip(lens, np.sort(rng.uniform(0.1, 5.0, len(lens))) ** 1.5)}
    pts = [{"slice": s, "context": 0, "forward_ms": t0[s], "backward_ms": 2 * t0[s]} for s in lens]
    # context points with a large intercept: must not leak into c = 0 (the reference code's double count)
    pts += [{"slice": s, "context": c, "forward_ms": t0[s] + 3.0 + 0.01 * c, "backward_ms": 2 * t0[s] + 7.0}
            for s in lens for c in (128, 1024)]
    cost = MeasuredCost(pts)
    for s in lens:
        assert cost.forward_ms(s, 0) == pytest.approx(t0[s], rel=1e-14)
        assert cost.backward_ms(s, 0) == pytest.approx(2 * t0[s], rel=1e-14)
    assert cost.forward_ms(64, 512) == pytest.approx(t0[64] + 3.0 + 5.12, rel=1e-9)
    assert cost.backward_ms(200, 128) == pytest.approx(2 * t0[200] + 7.0, rel=1e-9)


def test_duplicate_context_zero_points_are_averaged():
    pts = [{"slice": 64, "context": 0, "forward_ms": 1.0, "backward_ms": 2.0},
           {"slice": 64, "context": 0, "forward_ms": 3.0, "backward_ms": 4.0},
           {"slice": 128, "context": 0, "forward_ms": 4.0, "backward_ms": 8.0}]
    cost = MeasuredCost(pts)
    assert cost.forward_ms(64, 0) == 2.0 and cost.backward_ms(64, 0) == 3.0
    assert cost.forward_ms(96, 0) == pytest.approx(3.0)           # interpolated between 2 and 4


def test_fits_a_bilinear_model_exactly_inside_and_outside_the_measured_range():
    cost = MeasuredCost(grid_points())
    s = np.array([8.0, 64, 100, 333, 512, 2048, 4000])
    c = np.array([0.0, 7, 256, 900, 3000, 0, 8192])
    np.testing.assert_allclose(cost.forward_ms(s, c), [bilinear(*x) for x in zip(s, c)], rtol=1e-10)
    np.testing.assert_allclose(cost.backward_ms(s, c), [bilinear(*x, 2.1) for x in zip(s, c)], rtol=1e-10)


def test_broadcasting_and_scalar_results():
    cost = MeasuredCost(grid_points())
    out = cost.forward_ms(np.array([64, 128])[:, None], np.array([0, 256, 512])[None, :])
    assert out.shape == (2, 3)
    assert out[1, 2] == pytest.approx(bilinear(128, 512))
    scalar = cost.forward_ms(64, 256)
    assert isinstance(scalar, float) and np.ndim(scalar) == 0


def test_single_slice_length_scales_proportionally():
    cost = MeasuredCost([{"slice": 100, "context": 0, "forward_ms": 2.0, "backward_ms": 4.0}])
    assert cost.forward_ms(50, 0) == pytest.approx(1.0)
    assert cost.backward_ms(300, 0) == pytest.approx(12.0)


def test_extrapolation_never_goes_negative():
    pts = [{"slice": 64, "context": 0, "forward_ms": 1.0, "backward_ms": 1.0},
           {"slice": 128, "context": 0, "forward_ms": 5.0, "backward_ms": 5.0}]
    cost = MeasuredCost(pts)
    assert cost.forward_ms(8, 0) == 0.0                  # the line through the points is negative there
    assert cost.forward_ms(32, 0) == 0.0


def test_separate_fit_per_batch_and_linear_scaling_for_unmeasured_batches():
    cost = MeasuredCost(grid_points(batch=1) + grid_points(batch=4, scale=3.0))
    assert cost.forward_ms(128, 256, batch=1) == pytest.approx(bilinear(128, 256))
    assert cost.forward_ms(128, 256, batch=4) == pytest.approx(bilinear(128, 256, 3.0))
    assert cost.forward_ms(128, 256, batch=8) == pytest.approx(2 * bilinear(128, 256, 3.0))   # nearest: 4
    assert cost.forward_ms(128, 256, batch=2) == pytest.approx(2 * bilinear(128, 256))        # nearest: 1
    # a tie (distance 1.5 to both 1 and 4... use 2.5) goes to the larger measured batch
    assert cost.forward_ms(128, 256, batch=2.5) == pytest.approx(2.5 / 4 * bilinear(128, 256, 3.0))
    batches = np.array([1, 2, 4, 8])
    vec = cost.backward_ms(128, 256, batch=batches)
    np.testing.assert_allclose(vec, [cost.backward_ms(128, 256, batch=int(b)) for b in batches])


def test_fit_report_is_leave_one_out():
    exact = MeasuredCost(grid_points()).fit_report()
    assert exact["method"] == "leave-one-out" and exact["num_held_out"] == 16 and exact["num_skipped"] == 0
    assert exact["forward"]["max_rel_err"] < 1e-9 and exact["backward"]["max_rel_err"] < 1e-9
    rng = np.random.default_rng(1)
    noisy = grid_points()
    for p in noisy:
        p["forward_ms"] *= 1 + 0.05 * rng.standard_normal()
    rep = MeasuredCost(noisy).fit_report()
    assert 0.005 < rep["forward"]["mean_rel_err"] < 0.5
    assert rep["forward"]["max_rel_err"] >= rep["forward"]["mean_rel_err"]
    # a point whose removal leaves no context-0 point for its batch is skipped, not crashed on
    lone = [{"slice": 64, "context": 0, "forward_ms": 1.0, "backward_ms": 2.0},
            {"slice": 64, "context": 64, "forward_ms": 1.5, "backward_ms": 3.0}]
    assert MeasuredCost(lone).fit_report()["num_skipped"] == 1


def test_comm_time_formula_and_missing_comm():
    cost = MeasuredCost(grid_points(), comm={"latency_ms": 0.05, "gbps": 10.0}, hidden=2048)
    nbytes = 3 * 128 * 2048 * 2
    assert cost.comm_ms(128, batch=3) == pytest.approx(0.05 + nbytes / (10e9 / 8) * 1e3)
    assert MeasuredCost(grid_points()).comm_ms(128) == 0.0
    latency_only = MeasuredCost(grid_points(), comm={"latency_ms": 0.2})
    np.testing.assert_allclose(latency_only.comm_ms(np.array([8, 4096])), [0.2, 0.2])


def test_covers_measured_range_only():
    cost = MeasuredCost(grid_points())
    assert cost.covers(64, 0) and cost.covers(512, 1024) and cost.covers(np.array([64, 300]), 100)
    assert not cost.covers(32, 0)
    assert not cost.covers(1024, 0)
    assert not cost.covers(128, 2048)
    assert not PipelineCost([cost, MeasuredCost(grid_points()[:4])]).covers(128, 256)  # stage 1: contexts 0 only


# --------------------------------------------------------------------------------------------------------------
# File format

def test_uniform_file_round_trips_and_predicts_identically():
    pc = PipelineCost.from_dict(file_obj(), num_stages=4)
    assert pc.num_chunks == 4 and pc.is_uniform()
    again = PipelineCost.from_dict(json.loads(json.dumps(pc.to_dict())))
    assert again.to_dict() == pc.to_dict() and again.num_chunks == 4
    s, c = np.array([8, 100, 600]), np.array([0, 300, 5000])
    for k in range(4):
        np.testing.assert_array_equal(again.chunk(k).forward_ms(s, c), pc.chunk(k).forward_ms(s, c))
        np.testing.assert_array_equal(again.chunk(k).comm_ms(s, 2), pc.chunk(k).comm_ms(s, 2))


def test_points_only_defaults_to_one_stage_and_file_num_stages_must_agree():
    assert PipelineCost.from_dict({"points": grid_points()}).num_chunks == 1
    assert PipelineCost.from_dict({"points": grid_points(), "num_stages": 3}).num_chunks == 3
    with pytest.raises(ValueError, match="num_stages"):
        PipelineCost.from_dict({"points": grid_points(), "num_stages": 3}, num_stages=2)


def test_per_stage_keys_override_top_level_and_round_trip():
    obj = {"stages": [{"points": grid_points()}, {"points": grid_points(scale=2.0), "hidden": 1024,
                                                  "comm": {"latency_ms": 1.0, "gbps": 1.0}}],
           "comm": {"latency_ms": 0.1, "gbps": 100.0}, "hidden": 4096, "meta": {"device": "test"}}
    pc = PipelineCost.from_dict(obj, num_stages=2)
    assert not pc.is_uniform()
    assert pc.chunk(0).comm_ms(10) == pytest.approx(0.1 + 10 * 4096 * 2 * 8 / 100e6)
    assert pc.chunk(1).comm_ms(10) == pytest.approx(1.0 + 10 * 1024 * 2 * 8 / 1e6)
    assert pc.chunk(1).forward_ms(100, 100) == pytest.approx(bilinear(100, 100, 2.0))
    d = pc.to_dict()
    assert d["meta"] == {"device": "test"} and PipelineCost.from_dict(d).to_dict() == d


def test_equal_stage_objects_are_recognised_as_uniform():
    pc = PipelineCost.from_dict({"stages": [{"points": grid_points()}, {"points": grid_points()}]})
    assert pc.is_uniform()
    assert "stages" not in pc.to_dict() and pc.to_dict()["num_stages"] == 2


def test_load_cost_file(tmp_path):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(file_obj()))
    assert load_cost_file(path, num_stages=2).num_chunks == 2
    path.write_text('{"points": [\n  {"slice": 64,, }]}')
    with pytest.raises(ValueError) as err:
        load_cost_file(path)
    assert str(path) in str(err.value) and "line 2 column" in str(err.value)
    with pytest.raises(ValueError, match="cannot read the file"):
        load_cost_file(tmp_path / "missing.json")
    bad = file_obj()
    bad["points"][3]["forward_ms"] = -1
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match=r"cost\.json: cost\.points\[3\]\.forward_ms"):
        load_cost_file(path)


def _mutate(path: tuple, value, delete: bool = False) -> dict:
    obj = copy.deepcopy(file_obj())
    target = obj
    for key in path[:-1]:
        target = target[key]
    if delete:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return obj


@pytest.mark.parametrize("path, value, delete, needle", [
    (("points", 2, "forward_ms"), -0.5, False, r"points\[2\]\.forward_ms = -0\.5"),
    (("points", 2, "backward_ms"), math.nan, False, r"points\[2\]\.backward_ms = nan is not finite"),
    (("points", 2, "forward_ms"), math.inf, False, r"points\[2\]\.forward_ms = inf"),
    (("points", 2, "forward_ms"), "1.2", False, r"points\[2\]\.forward_ms = '1.2' is not a number"),
    (("points", 2, "forward_ms"), True, False, r"points\[2\]\.forward_ms = True is not a number"),
    (("points", 2, "slice"), 0, False, r"points\[2\]\.slice = 0 must be >= 1"),
    (("points", 2, "slice"), 12.5, False, r"points\[2\]\.slice = 12\.5 must be an integer"),
    (("points", 2, "context"), -8, False, r"points\[2\]\.context = -8 must be >= 0"),
    (("points", 2, "batch"), 0, False, r"points\[2\]\.batch = 0 must be >= 1"),
    (("points", 2, "fwd_ms"), 1.0, False, r"points\[2\] has unknown key 'fwd_ms'"),
    (("points", 2, "backward_ms"), None, True, r"points\[2\] is missing 'backward_ms'"),
    (("points",), [], False, r"cost\.points = \[\] must be a non-empty list"),
    (("hidden",), None, True, r"cost\.comm\.gbps = 10\.0 needs .*hidden"),
    (("hidden",), 0, False, r"cost\.hidden = 0 must be >= 1"),
    (("bytes_per_element",), "2", False, r"cost\.bytes_per_element = '2'"),
    (("comm", "gbps"), 0, False, r"cost\.comm\.gbps = 0 must be > 0"),
    (("comm", "latency_ms"), -1, False, r"cost\.comm\.latency_ms = -1"),
    (("comm", "bandwidth"), 1, False, r"cost\.comm has unknown key 'bandwidth'"),
    (("extra",), 1, False, r"cost has unknown key 'extra'; valid keys: points, stages"),
    (("meta",), [1], False, r"cost\.meta = \[1\] must be a JSON object"),
    (("stages",), [], False, r"exactly one of \"points\""),
])
def test_file_errors_name_the_field(path, value, delete, needle):
    with pytest.raises(ValueError, match=needle):
        PipelineCost.from_dict(_mutate(path, value, delete), num_stages=2)


def test_no_context_zero_points_is_refused_per_batch():
    pts = grid_points() + [p for p in grid_points(batch=2) if p["context"] > 0]
    with pytest.raises(ValueError, match="no context = 0 point for batch 2"):
        PipelineCost.from_dict({"points": pts})


def test_only_token_mixing_costs_warn_about_points_at_context_0_alone(caplog):
    """A stage without points at context > 0 never saw attention over the prefix: a warning. The output layer's
    vocabulary share mixes no tokens and is profiled at context 0 only: read from a cost file (every plan-cache hit
    with vocab_parallel) it must not warn."""
    import logging

    from ds_terapipe.planner.cost import VocabShareCost

    flat = [p for p in grid_points() if p["context"] == 0]
    with caplog.at_level(logging.WARNING, logger="ds_terapipe.planner.cost"):
        PipelineCost.from_dict({"points": flat})
    assert "no point with context > 0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ds_terapipe.planner.cost"):
        VocabShareCost.from_dict({"points": flat, "num_ranks": 2, "hidden": 8, "latency_ms": 0.01, "gbps": 10.0,
                                  "bytes_per_element": 2, "split_embedding": False})
    assert "no point with context > 0" not in caplog.text, caplog.text


def test_stage_file_errors_name_the_stage():
    obj = {"stages": [{"points": grid_points()}, {"points": grid_points(), "oops": 1}]}
    with pytest.raises(ValueError, match=r"cost\.stages\[1\] has unknown key 'oops'"):
        PipelineCost.from_dict(obj)
    with pytest.raises(ValueError, match=r"cost\.stages has 2 entries but num_stages = 3"):
        PipelineCost.from_dict({"stages": obj["stages"][:1] * 2}, num_stages=3)
    with pytest.raises(ValueError, match=r"cost\.stages\[0\] has no \"points\""):
        PipelineCost.from_dict({"stages": [{"hidden": 8}]})
    with pytest.raises(TypeError, match=r"cost\.stages\[0\] must be a JSON object"):
        PipelineCost.from_dict({"stages": [[1, 2]]})
    with pytest.raises(TypeError, match="cost must be a JSON object"):
        PipelineCost.from_dict([1])


def test_pipeline_cost_api_errors():
    with pytest.raises(ValueError, match="num_stages = 0 must be >= 1"):
        PipelineCost.uniform(MeasuredCost(grid_points()), 0)
    with pytest.raises(TypeError, match=r"stages\[0\] is a str"):
        PipelineCost(["x"])
    with pytest.raises(TypeError, match="to_dict needs MeasuredCost stages, stage 0 is AnalyticCost"):
        analytic_pipeline_cost("gpt3-1b", "v100", 2).to_dict()
    with pytest.raises(IndexError):
        PipelineCost.uniform(MeasuredCost(grid_points()), 2).chunk(2)


# --------------------------------------------------------------------------------------------------------------
# AnalyticCost and presets

def test_analytic_cost_grows_with_slice_and_context():
    # never cheaper for more tokens or a longer prefix; flat where a kernel sits on its launch floor or on its
    # weight read (a short slice's attention, every GEMM below a few hundred tokens), growing past it
    cost = AnalyticCost(get_model_preset("gpt3-1b"), get_device_preset("v100"), num_layers=3)
    s = np.arange(8, 4097, 8, dtype=float)
    c = np.arange(0, 8193, 256, dtype=float)
    for grid in (cost.forward_ms(s[:, None], c[None, :]), cost.backward_ms(s[:, None], c[None, :])):
        assert np.all(np.diff(grid, axis=0) >= 0) and np.all(np.diff(grid, axis=1) >= 0)
        assert np.all(np.diff(grid[s >= 512], axis=0) > 0) and np.all(np.diff(grid[s >= 512], axis=1) > 0)
    # the backward does the forward's GEMMs twice (input and weight gradients) and adds into .grad
    assert np.all(cost.backward_ms(s[:, None], c[None, :]) > 2 * cost.forward_ms(s[:, None], c[None, :]) * 0.9)
    assert np.all(np.diff(cost.comm_ms(s)) > 0)
    assert cost.forward_ms(1024, 0, batch=4) > cost.forward_ms(1024, 0, batch=1)


@pytest.mark.parametrize("deferred", [False, True])
def test_analytic_cost_on_a_grid_equals_its_scalar_values(deferred):
    """A (1, N) row of lengths against an (N, 1) column of contexts (the planner's table) gives every slice's
    scalar time exactly, in a fresh array of the full shape, whatever the argument shapes."""
    lens, ctx = 64.0 * np.arange(1, 5)[None, :], 64.0 * np.arange(3)[:, None]
    for embedding, lm_head in ((False, False), (True, False), (False, True)):
        cost = AnalyticCost(get_model_preset("gpt3-1b"), get_device_preset("a100"), 2, embedding=embedding,
                            lm_head=lm_head, deferred_weight_grads=deferred)
        for batch in (1, np.array([[1.0], [2.0], [3.0]])):
            for method in (cost.forward_ms, cost.backward_ms):
                grid = method(lens, ctx, batch)
                each = [[float(method(s, c, np.broadcast_to(batch, (3, 1))[i, 0])) for s in lens[0]]
                        for i, c in enumerate(ctx[:, 0])]
                assert grid.shape == (3, 4) and grid.flags.writeable and grid.tolist() == each
            weight = cost.weight_ms(lens, batch)
            assert weight.shape == np.broadcast_shapes(lens.shape, np.shape(batch)) and weight.flags.writeable
    assert np.ndim(cost.forward_ms(64, 0)) == 0 and np.ndim(cost.weight_ms(64)) == 0


def test_analytic_cost_matches_the_documented_flop_count_when_compute_bound():
    spec = TransformerSpec(num_layers=2, hidden=1024, num_heads=8, vocab=1000, seq_len=4096)
    dev = DeviceSpec("toy", peak_tflops=1.0, mem_bw_gbps=1e9, per_layer_overhead_ms=0.5, efficiency=0.5,
                     link_gbps=8.0, link_latency_ms=0.25)
    cost = AnalyticCost(spec, dev, num_layers=2, bytes_per_element=4)
    b, s, c, h = 2, 256, 512, 1024
    flops = 24 * b * s * h * h + 4 * b * h * (s * c + s * (s + 1) / 2)
    assert cost.forward_ms(s, c, b) == pytest.approx(2 * (flops / (0.5e12) * 1e3 + 0.5))
    head = AnalyticCost(spec, dev, num_layers=2, bytes_per_element=4, lm_head=True)
    assert head.forward_ms(s, c, b) - cost.forward_ms(s, c, b) == pytest.approx(2 * b * s * h * 1000 / 0.5e12 * 1e3)
    assert cost.comm_ms(s, b) == pytest.approx(0.25 + b * s * h * 4 * 8 / 8e6)


def _visible_pairs(s: int, c: int, window: int | None) -> int:
    """The (query, key) pairs slice [c, c + s) attends over, one by one: query t sees key k iff k <= t and, with a
    sliding window, t - k < window."""
    return sum(1 for t in range(c, c + s) for k in range(t + 1) if window is None or t - k < window)


def _visible_keys(s: int, c: int, window: int | None) -> int:
    """The keys some query of slice [c, c + s) sees, one by one."""
    return len({k for t in range(c, c + s) for k in range(t + 1) if window is None or t - k < window})


def _computed_pairs(s: int, c: int, window: int | None, block: int = 256) -> int:
    """The scores the runtime computes for slice [c, c + s): the visible pairs on the causal paths (no key hidden by
    the window from any query of the slice), else per block of max(window, block) queries, all its queries against
    every key some query of the block sees (band mask)."""
    hides = window is not None and any(t - k >= window for t in range(c, c + s) for k in range(t + 1))
    if not hides:
        return _visible_pairs(s, c, window)
    size = max(window, block)
    return sum(min(size, c + s - q0) * _visible_keys(min(size, c + s - q0), q0, window) for q0 in range(c, c + s, size))


def test_blocked_band_scores_count_as_the_runtime_runs_them():
    """computed_pairs against the block-by-block count, blocks of the window's size and longer (and the visible
    pairs and keys it starts from, windows hiding keys included)."""
    for s, c, w in WINDOW_GRID:
        assert (visible_pairs(s, c, w), visible_keys(s, c, w)) == (_visible_pairs(s, c, w), _visible_keys(s, c, w))
        for block in (1, 2, 4, 256):
            assert computed_pairs(s, c, w, block=block) == _computed_pairs(s, c, w, block), (s, c, w, block)
    assert computed_pairs(40, 100, 3, block=4) == 10 * 4 * 6    # every block over its own window


WINDOW_GRID = [(s, c, w) for s in (1, 2, 3, 5, 8) for c in (0, 1, 2, 4, 6, 7, 12, 19)
               for w in (None, 1, 2, 3, 7, 8, 9, 30)]


def test_windowed_attention_counts_the_query_key_pairs_the_runtime_scores():
    """Attention of a slice with a sliding window costs 4 h FLOPs per (query, key) pair the runtime scores (the
    visible ones while the window hides no key from the slice, else every query against every key the slice reads:
    the band-masked call), 2.5 times that backward, and reads the keys and values some query sees, both counted
    pair by pair here; the window of
    each layer comes from the spec (every layer's, or the layer's own)."""
    b, h, layers = 2, 64, 2
    compute = DeviceSpec("compute", peak_tflops=1.0, mem_bw_gbps=1e12, per_layer_overhead_ms=0.0, efficiency=0.5,
                         link_gbps=8.0, link_latency_ms=0.0)
    memory = DeviceSpec("memory", peak_tflops=1e9, mem_bw_gbps=1.0, per_layer_overhead_ms=0.0, efficiency=0.5,
                        link_gbps=8.0, link_latency_ms=0.0)
    rate = 0.5e9   # FLOPs per ms
    for s, c, w in WINDOW_GRID:
        spec = TransformerSpec(num_layers=layers, hidden=h, num_heads=4, vocab=100, seq_len=64, window=w)
        per_layer = TransformerSpec(num_layers=3, hidden=h, num_heads=4, vocab=100, seq_len=64, window=(None, w, w))
        linear_flops = 24 * b * s * h * h
        pairs = _computed_pairs(s, c, w)
        assert AnalyticCost(spec, compute, layers, bytes_per_element=4).forward_ms(s, c, b) == pytest.approx(
            layers * (linear_flops + 4 * b * h * pairs) / rate, rel=1e-12), (s, c, w)
        # the same two windowed layers as the last two of a model whose first layer attends fully
        assert AnalyticCost(per_layer, compute, 2, first_layer=1).forward_ms(s, c, b) == pytest.approx(
            AnalyticCost(spec, compute, layers).forward_ms(s, c, b), rel=1e-12), (s, c, w)
        full = dict(spec.__dict__, window=None)
        extra = 2.5 * 4 * b * h * (pairs - _visible_pairs(s, c, None)) / rate
        assert AnalyticCost(spec, compute, 1).backward_ms(s, c, b) - AnalyticCost(
            TransformerSpec(**full), compute, 1).backward_ms(s, c, b) == pytest.approx(extra, rel=1e-9, abs=1e-12)
        # bound by bytes: the attention reads queries and outputs, and the visible keys and values
        keys = _visible_keys(s, c, w)
        delta = AnalyticCost(spec, memory, 1).forward_ms(s, c, b) - AnalyticCost(
            TransformerSpec(**full), memory, 1).forward_ms(s, c, b)
        assert delta == pytest.approx(2 * b * (keys - (c + s)) * h * 2 / 1e6, rel=1e-9, abs=1e-12), (s, c, w)


def test_a_window_covering_the_sequence_costs_what_full_attention_does():
    """A window of at least L keys hides nothing from a sequence of L tokens: every cost equals full causal
    attention's (and so does the plan). A shorter window w costs the same while a slice ends within w, less once
    its prefix is long enough that the band's s (s + w - 1) scores are fewer than causal attention's, and nothing
    more for a longer prefix past w - 1."""
    dev = get_device_preset("h100")
    full = get_model_preset("gpt3-1b")
    length = full.seq_len
    s = np.arange(8, length + 1, 8, dtype=float)[None, :]
    c = np.arange(0, length, 8, dtype=float)[:, None]
    inside = s + c <= length
    for w in (length, length + 1, 10 * length):
        windowed = TransformerSpec(**dict(full.__dict__, window=w))
        for deferred in (False, True):
            a, b = (AnalyticCost(spec, dev, 3, embedding=True, deferred_weight_grads=deferred)
                    for spec in (full, windowed))
            assert np.array_equal(a.forward_ms(s, c)[inside], b.forward_ms(s, c)[inside])
            assert np.array_equal(a.backward_ms(s, c)[inside], b.backward_ms(s, c)[inside])
    plans = [plan_slicing(analytic_pipeline_cost(spec, dev, 4), length, num_microbatches=2)
             for spec in (full, windowed)]
    assert plans[0] == plans[1]
    w, cpu = 512, get_device_preset("cpu")   # no launch floor: attention is its FLOPs or bytes at any size
    short = AnalyticCost(TransformerSpec(**dict(full.__dict__, window=w)), cpu, 3)
    whole = AnalyticCost(full, cpu, 3)
    for method in ("forward_ms", "backward_ms"):
        mine, theirs = getattr(short, method)(s, c), getattr(whole, method)(s, c)
        assert np.array_equal(mine[s + c <= w], theirs[s + c <= w])
        fewer = (s * (s + w - 1) < s * c + s * (s + 1) / 2) & (c >= w)   # the band scores fewer pairs than causal
        assert fewer.sum() > 100 and np.all(mine[fewer & inside] < theirs[fewer & inside])
        past = mine[c[:, 0] >= w - 1]
        assert np.array_equal(past, np.broadcast_to(past[0], past.shape))   # flat in the prefix past w - 1


def test_windows_are_priced_per_layer():
    """Gemma 2's layout (full attention on every second layer): each stage adds up its own layers, stages holding
    the same windows are one model to the planner, and the per-layer costs partition.py cuts add up to a stage."""
    from ds_terapipe.planner.partition import ChunkCost

    spec = resolve_model("gpt3-1b", window=256, full_every=2)
    assert spec.layer_windows[:4] == (256, None, 256, None)
    assert resolve_model("gpt3-1b", window=256, full_every=6).layer_windows[:6] == (256,) * 5 + (None,)
    assert resolve_model("gpt3-1b", window=256).window == 256
    dev, full = get_device_preset("a100"), get_model_preset("gpt3-1b")
    one = {w: AnalyticCost(TransformerSpec(**dict(full.__dict__, window=w)), dev, 1) for w in (None, 256)}
    pc = analytic_pipeline_cost(spec, dev, 5, lm_head=False)   # 24 layers: 5, 5, 5, 5, 4
    s, c = np.array([64, 256, 512]), np.array([0, 1024, 1536])
    for k, first in enumerate((0, 5, 10, 15, 20)):
        layers = spec.layer_windows[first:first + pc.stages[k].num_layers]
        for method in ("forward_ms", "backward_ms"):
            expect = sum(getattr(one[w], method)(s, c) for w in layers)
            np.testing.assert_allclose(getattr(pc.stages[k], method)(s, c), expect, rtol=1e-12)
    assert pc.stages[0] is pc.stages[2] and pc.stages[1] is pc.stages[3]      # 3 sliding + 2 full, 2 + 3
    assert pc.stages[0].cache_key() != pc.stages[1].cache_key()
    per_layer = analytic_layer_costs(spec, dev)   # embedding, 24 blocks, head
    assert per_layer[1] is per_layer[3] and per_layer[1].windows == ((256, 1),) and per_layer[2].windows == ((None, 1),)
    np.testing.assert_allclose(ChunkCost(per_layer[6:11]).forward_ms(s, c), pc.stages[1].forward_ms(s, c), rtol=1e-12)


@pytest.mark.parametrize("build, needle", [
    (lambda: TransformerSpec(2, 64, 4, 10, 64, window=0), r"TransformerSpec\.window = 0 must be >= 1"),
    (lambda: TransformerSpec(2, 64, 4, 10, 64, window=(8,)), "window has 1 entries for num_layers = 2"),
    (lambda: TransformerSpec(2, 64, 4, 10, 64, window=(8, 2.5)), r"TransformerSpec\.window\[1\] = 2\.5"),
    (lambda: AnalyticCost(TransformerSpec(2, 64, 4, 10, 64, window=(8, None)), get_device_preset("cpu"), 2,
                          first_layer=1), r"layers \[1, 3\) are not all among the 2 layers"),
    (lambda: resolve_model("gpt3-1b", full_every=2), "full_every = 2 .* neither is given; pass window=W or "
     "attention_chunk=C"),
    (lambda: resolve_model("gpt3-1b", window=256, attention_chunk=512), "a layer attends within a sliding window or "
     "within chunks; pass one of them"),
    (lambda: resolve_model("gpt3-1b", attention_chunk=0), "attention_chunk = 0 must be >= 1"),
    (lambda: TransformerSpec(2, 64, 4, 10, 64, window=(Chunked(0), None)), r"Chunked\.size = 0 must be >= 1"),
    (lambda: resolve_model("gpt3-1b", window=256, full_every=0), "full_every = 0 must be >= 1"),
])
def test_window_errors_name_the_rule_and_the_fix(build, needle):
    with pytest.raises(ValueError, match=needle):
        build()


CHUNK_GRID = [(s, c, size) for s in (1, 2, 3, 5, 8, 13) for c in (0, 1, 2, 4, 6, 7, 12, 19)
              for size in (1, 2, 3, 5, 8, 64)]


def test_chunked_attention_counts_the_pairs_and_keys_of_its_chunks():
    """Chunked attention of C tokens (query t sees key k iff k <= t and k // C == t // C), counted pair by pair: the
    visible pairs, the keys the slice reads (from the start of its first query's chunk, where the runtime's chunks
    as documents start it), and the scores the runtime computes: causal blocks per chunk (the visible pairs), or
    where the runtime's documents give no blocks (over its MAX_BLOCKS chunks) every query against every key read."""
    import torch

    from ds_terapipe.runtime.slicing.blocks import MAX_BLOCKS
    from ds_terapipe.runtime.slicing.documents import chunked_documents
    assert MAX_CHUNK_BLOCKS == MAX_BLOCKS
    dense = 0
    for s, c, size in CHUNK_GRID + [(s, c, size) for s in (31, 32, 33, 40, 70) for c in (0, 1, 5)
                                    for size in (1, 2, 3)]:
        seen = [(t, k) for t in range(c, c + s) for k in range(t + 1) if k // size == t // size]
        keys = len({k for _, k in seen})
        counted = visible_pairs(s, c, Chunked(size)), visible_keys(s, c, Chunked(size))
        assert counted == (len(seen), keys), (s, c, size)
        docs = chunked_documents(None, size, 1, c + s, torch.device("cpu"))   # None: one chunk holds the sequence
        first = 0 if docs is None else docs.first_visible(c)
        assert c + s - first == keys, (s, c, size)
        blocked = docs is None or docs.blocks(c, c + s, first) is not None
        dense += not blocked
        assert computed_pairs(s, c, Chunked(size)) == (len(seen) if blocked else s * keys), (s, c, size)
    assert dense > 0


def test_chunked_layers_are_priced_per_layer_and_plan_cheaper_than_causal():
    """Llama 4's layout (chunks of C on three layers of four, full attention on the fourth): each layer its own
    attention; at 32K tokens a step with chunks of 8192 is cheaper than causal attention everywhere, and the
    chunked-everywhere one cheaper still; a chunk covering the sequence costs what causal attention does; a slice's
    chunked attention costs the same at the same place in any chunk."""
    spec = resolve_model("gpt3-1b", attention_chunk=8192, full_every=4)
    assert spec.layer_windows[:8] == (Chunked(8192),) * 3 + (None,) + (Chunked(8192),) * 3 + (None,)
    assert resolve_model("gpt3-1b", attention_chunk=8192).window == Chunked(8192)
    dev = get_device_preset("h100")
    steps = [plan_slicing(analytic_pipeline_cost(resolve_model("gpt3-1b", attention_chunk=chunk, full_every=every),
                                                 dev, 8), 32768, num_microbatches=1, granularity=128).predicted_ms
             for chunk, every in ((None, None), (8192, 4), (8192, None), (32768, None))]
    assert steps[2] < steps[1] < steps[0] and steps[3] == pytest.approx(steps[0], rel=1e-12)
    cpu = get_device_preset("cpu")   # no launch floor: attention is its FLOPs or bytes at any size
    one = AnalyticCost(TransformerSpec(**dict(get_model_preset("gpt3-1b").__dict__, window=Chunked(1024))), cpu, 1)
    for method in ("forward_ms", "backward_ms"):
        assert getattr(one, method)(256, 512) == getattr(one, method)(256, 3 * 1024 + 512)
        assert getattr(one, method)(256, 512) > getattr(one, method)(256, 0)
    counts = spec.window_counts(0, 8)
    assert counts == ((None, 2), (Chunked(8192), 6))


def test_small_slices_are_memory_bound_on_weights():
    cost = AnalyticCost(get_model_preset("gpt3-175b"), get_device_preset("v100"), num_layers=1)
    weight_ms = 12 * 12288 ** 2 * 2 / 900e6 + 0.10
    assert cost.forward_ms(8, 0) == pytest.approx(weight_ms, rel=0.01)       # FLOPs would say ~0.1 ms
    assert cost.forward_ms(8, 0) / 8 > 5 * cost.forward_ms(1024, 0) / 1024   # per token, tiny slices waste it


def test_spec_validation():
    with pytest.raises(ValueError, match="hidden = 100 is not divisible by num_heads = 3"):
        TransformerSpec(2, 100, 3, 10, 64)
    with pytest.raises(ValueError, match=r"TransformerSpec\.num_layers = 0"):
        TransformerSpec(0, 128, 1, 10, 64)
    with pytest.raises(ValueError, match=r"DeviceSpec\.efficiency = 1\.5 must be in \(0, 1\]"):
        DeviceSpec("x", 1.0, 1.0, 0.0, 1.5, 1.0, 0.0)
    with pytest.raises(ValueError, match=r"DeviceSpec\.peak_tflops = 0"):
        DeviceSpec("x", 0.0, 1.0, 0.0, 0.5, 1.0, 0.0)
    with pytest.raises(TypeError, match="model must be a TransformerSpec"):
        AnalyticCost("gpt3-1b", get_device_preset("cpu"), 1)  # type: ignore[arg-type]


def test_model_presets_follow_the_paper():
    expect = {"gpt3-1b": (24, 2048), "gpt3-13b": (40, 5120), "gpt3-44b": (96, 6144), "gpt3-175b": (96, 12288)}
    assert set(MODEL_PRESETS) == set(expect)
    for name, (layers, hidden) in expect.items():
        spec = get_model_preset(name.upper())
        assert (spec.num_layers, spec.hidden, spec.num_heads) == (layers, hidden, hidden // 128)
        assert (spec.vocab, spec.seq_len) == (50257, 2048)
    with pytest.raises(ValueError, match="model preset 'gpt2' is unknown; valid names: gpt3-1b, gpt3-13b"):
        get_model_preset("gpt2")


def test_device_presets():
    assert {k: (d.peak_tflops, d.mem_bw_gbps) for k, d in DEVICE_PRESETS.items()} == {
        "v100": (125.0, 900.0), "a100": (312.0, 1555.0), "h100": (989.0, 3350.0), "h200": (989.0, 4800.0),
        "cpu": (0.2, 20.0)}
    with pytest.raises(ValueError, match="device preset 'tpu' is unknown; valid names: v100, a100, h100, h200, cpu"):
        get_device_preset("tpu")


def test_analytic_pipeline_cost_splits_layers_and_puts_the_head_last():
    assert split_layers(10, 4) == [3, 3, 2, 2]
    pc = analytic_pipeline_cost("gpt3-13b", "a100", 3)       # 40 layers: 14, 13, 13 + head
    times = [pc.chunk(k).forward_ms(256, 0) for k in range(3)]
    assert times[0] > times[1] and times[2] > times[1] and not pc.is_uniform()
    assert analytic_pipeline_cost("gpt3-1b", "v100", 4, lm_head=False).is_uniform()
    assert not analytic_pipeline_cost("gpt3-1b", "v100", 5, lm_head=False).is_uniform()
    with pytest.raises(ValueError, match="num_stages = 25 exceeds the model's 24 layers"):
        analytic_pipeline_cost("gpt3-1b", "v100", 25)
    mem = preset_memory_model("gpt3-13b", 3)
    assert mem.num_layers_per_stage == (14, 13, 13) and mem.hidden == 5120


def test_weight_ms_per_token_round_trips_and_defaults_to_zero():
    points = [{"slice": 8, "context": 0, "forward_ms": 1.0, "backward_ms": 2.0},
              {"slice": 16, "context": 0, "forward_ms": 2.0, "backward_ms": 4.0}]
    plain = MeasuredCost(points)
    assert float(plain.weight_ms(64, 2)) == 0.0 and "weight_ms_per_token" not in plain.to_dict()
    cost = PipelineCost.from_dict({"points": points, "weight_ms_per_token": 0.25}, num_stages=2)
    assert float(cost.chunk(1).weight_ms(64, 2)) == pytest.approx(0.25 * 64 * 2)
    again = PipelineCost.from_dict(cost.to_dict())
    assert float(again.chunk(0).weight_ms(10)) == pytest.approx(2.5)
    with pytest.raises(ValueError, match="weight_ms_per_token"):
        PipelineCost.from_dict({"points": points, "weight_ms_per_token": "fast"})


def test_weight_ms_per_slice_is_paid_once_per_w_pass() -> None:
    # W of one pass = per_slice + per_token * s (per sequence); gpipe's one W per micro-batch is one pass over all
    # its slices' tokens (the runtime's one GEMM per Linear), so it pays the fixed part once, not once per slice
    points = [{"slice": 8, "context": 0, "forward_ms": 1.0, "backward_ms": 2.0},
              {"slice": 16, "context": 0, "forward_ms": 2.0, "backward_ms": 4.0}]
    cost = PipelineCost.from_dict({"points": points, "weight_ms_per_token": 0.25, "weight_ms_per_slice": 3.0},
                                  num_stages=2)
    assert float(cost.chunk(1).weight_ms(64, 2)) == pytest.approx((3.0 + 0.25 * 64) * 2)
    assert cost.chunk(0).weight_ms(np.array([8, 0]), 1) == pytest.approx([5.0, 0.0])   # no tokens, no W
    assert PipelineCost.from_dict(cost.to_dict()).chunk(0).to_dict()["weight_ms_per_slice"] == 3.0
    sched = defer_weights(build_gpipe(2, 1, 4))
    one_w = [e for e in simulate(sched, cost, [16] * 4).events if e.action.kind is ActionKind.WEIGHT]
    assert [e.duration_ms for e in one_w] == pytest.approx([3.0 + 0.25 * 64] * 2)   # one W per stage, one pass
    with pytest.raises(ValueError, match="weight_ms_per_slice"):
        PipelineCost.from_dict({"points": points, "weight_ms_per_slice": -1.0})


def test_a_noisy_context_fit_never_makes_a_prefix_free():
    # Measured on a shared 2-core machine: short slices got *faster* with a long prefix (noise), so the least
    # squares context part has a large negative intercept. Without a floor the model said t(8, 8) = 0 and the
    # planner cut 1024 tokens into 30 slices of 8 that cost 2x in reality.
    points = [{"slice": 8, "context": 0, "forward_ms": 14.7, "backward_ms": 18.5},
              {"slice": 8, "context": 512, "forward_ms": 12.7, "backward_ms": 16.6},
              {"slice": 8, "context": 1016, "forward_ms": 15.2, "backward_ms": 24.0},
              {"slice": 128, "context": 0, "forward_ms": 49.7, "backward_ms": 52.8},
              {"slice": 128, "context": 448, "forward_ms": 58.8, "backward_ms": 71.8},
              {"slice": 128, "context": 896, "forward_ms": 68.1, "backward_ms": 93.0},
              {"slice": 512, "context": 0, "forward_ms": 196.1, "backward_ms": 232.8},
              {"slice": 512, "context": 256, "forward_ms": 255.5, "backward_ms": 320.5},
              {"slice": 512, "context": 512, "forward_ms": 234.7, "backward_ms": 326.7}]
    cost = MeasuredCost(points)
    for s in (8, 16, 64, 128):
        for c in (8, 64, 256):
            assert float(cost.forward_ms(s, c)) >= float(cost.forward_ms(s, 0)) > 0
            assert float(cost.backward_ms(s, c)) >= float(cost.backward_ms(s, 0)) > 0


def _share(split: bool = True):
    from ds_terapipe.planner.cost import VocabShareCost
    points = [{"batch": 1, "slice": s, "context": c, "forward_ms": 0.5 + 0.01 * s, "backward_ms": 1.0 + 0.02 * s}
              for s in (8, 32, 64) for c in (0, 64)]
    return VocabShareCost(MeasuredCost(points), 4, 256, link_latency_ms=0.05, link_gbps=20.0,
                          bytes_per_element=2, head_is_shard=True, split_embedding=split)


@pytest.mark.parametrize("split", [False, True])
def test_vocab_passes_add_up_to_the_share(split):
    """VF + EF is the share's forward, VB + EB its backward: the simulator's passes and the slicer's folded
    share charge the same time; without a split embedding EF and EB cost nothing."""
    share = _share(split)
    s = np.array([8, 24, 64])
    fwd = share.pass_ms("VF", s) + share.pass_ms("EF", s)
    bwd = share.pass_ms("VB", s) + share.pass_ms("EB", s)
    np.testing.assert_allclose(fwd, share.forward_ms(s, 0), rtol=1e-12)
    np.testing.assert_allclose(bwd, share.backward_ms(s, 0), rtol=1e-12)
    assert (np.all(share.pass_ms("EF", s) > 0) and np.all(share.pass_ms("EB", s) > 0)) == split
    with pytest.raises(ValueError, match="not a vocabulary pass"):
        share.pass_ms("F", s)


def test_a_cost_with_a_vocab_share_round_trips_and_folds_into_the_chunks():
    share = _share()
    pc = PipelineCost.from_dict(file_obj(), num_stages=4)
    pc = PipelineCost(pc.stages, meta=pc.meta, step=pc.step, vocab=share)
    again = PipelineCost.from_dict(json.loads(json.dumps(pc.to_dict())))
    assert again.to_dict() == pc.to_dict() and again.vocab is not None
    np.testing.assert_allclose(again.vocab.pass_ms("VF", [16, 48]), share.pass_ms("VF", [16, 48]), rtol=1e-12)
    folded = pc.folded_vocab(2)
    assert folded.vocab is None and folded.num_chunks == 4 and pc.folded_vocab(1) is not pc
    got = folded.chunk(1).forward_ms(32, 64)
    assert got == pytest.approx(float(pc.chunk(1).forward_ms(32, 64)) + 0.5 * float(share.forward_ms(32, 64)))
    assert PipelineCost(pc.stages).folded_vocab(2).stages == pc.stages   # nothing to fold: unchanged
    bad = dict(pc.to_dict(), vocab={**pc.to_dict()["vocab"], "gbsp": 1.0})
    with pytest.raises(ValueError, match="cost.vocab has unknown key 'gbsp'"):
        PipelineCost.from_dict(bad)


def test_cost_views_keep_the_chunks_deferred_weight_gradient_work() -> None:
    """A view of a chunk's cost (the vocabulary share added, contexts read per document, tokens split over
    sequence ranks) keeps the chunk's W work: with deferred weight gradients the planner and simulator would
    otherwise plan a W of zero cost under vocabulary parallelism or packed rows."""
    import pickle

    from ds_terapipe.planner.cost import MeasuredCost, VocabShareCost, WithVocabShare
    from ds_terapipe.planner.documents import WithinDocuments
    from ds_terapipe.planner.sequence import SequenceParallelCost

    points = [{"batch": 1, "slice": s, "context": c, "forward_ms": 1.0 + 0.01 * s + 0.001 * c,
               "backward_ms": 2.0 + 0.02 * s} for s in (8, 16, 32) for c in (0, 16, 32)]
    chunk = MeasuredCost(points, weight_ms_per_token=0.5, weight_ms_per_slice=1.0)
    share = VocabShareCost(MeasuredCost(points), 2, 64, link_latency_ms=0.01, link_gbps=10.0)
    views = [WithVocabShare(chunk, share), WithinDocuments(chunk, np.zeros(4), 8)]
    for view in views + [copy.deepcopy(v) for v in views] + [pickle.loads(pickle.dumps(v)) for v in views]:
        assert float(view.weight_ms(16)) == float(chunk.weight_ms(16)) == 9.0, type(view).__name__
        assert view.weight_ms_per_token == 0.5   # and the chunk's attributes
    split = SequenceParallelCost(chunk, 2, layers=1, hidden=64, link_gbps=100.0)
    assert float(split.weight_ms(16)) == 4.5   # each sequence rank's token share

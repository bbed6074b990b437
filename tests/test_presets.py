"""Tier (a): the device presets' physics, and the h100 preset against the H100 measurements it was calibrated on.

    python -m pytest -q tests/test_presets.py
"""
from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest

from ds_terapipe.cli import _DEFAULT_GRANULARITY
from ds_terapipe.planner.cost import AnalyticCost, DeviceSpec, TransformerSpec
from ds_terapipe.planner.presets import analytic_pipeline_cost, get_device_preset, get_model_preset
from ds_terapipe.planner.slicing import plan_slicing

H100 = get_device_preset("h100")
TOLERANCE = 0.20
# The deferred runs of the Llama-8B-shaped stage at 8 and 16 slices (no per-slice sync) took 1.5-1.8x the
# forward time of the synchronised sliced run of the same stage and slices; no per-slice model fits both, so the
# sliced run (which has every slice) is the one held to.
INCONSISTENT_DEFERRED = {("llama-8b", "8"), ("llama-8b", "16")}


def measured() -> dict:
    text = resources.files("ds_terapipe.planner").joinpath("data/h100_measured.json").read_text()
    return json.loads(text)


def stage_cost(m: dict, deferred: bool = False) -> AnalyticCost:
    spec = TransformerSpec(num_layers=m["layers"], hidden=m["hidden"], num_heads=m["num_heads"], vocab=32000,
                           seq_len=m["seq_len"], ffn_hidden=m["ffn_hidden"], num_kv_heads=m["num_kv_heads"],
                           block=m["block"])
    return AnalyticCost(spec, H100, m["layers"], deferred_weight_grads=deferred)


def comparisons(device: DeviceSpec = H100) -> list[tuple[str, float, float]]:
    """(what, predicted, measured) for every figure the h100 preset is held to.

    Sliced runs: the mean forward and backward per slice of each run (the planner adds per-slice costs up). The
    backward run first (the last slice's) found ``.grad`` empty and took the gradient instead of adding it, so it
    is predicted without ``accumulate_ms``. Deferred runs: the micro-batch's F and B totals, and W of the
    one-slice run (one GEMM per Linear over all tokens, what a W covering a micro-batch now runs; it also found
    ``.grad`` empty).
    """
    out = []
    for m in measured()["models"]:
        cost = stage_cost(m)
        cost = AnalyticCost(cost.model, device, m["layers"])
        deferred = AnalyticCost(cost.model, device, m["layers"], deferred_weight_grads=True)
        seq_len, acc = m["seq_len"], cost.accumulate_ms()
        for n, run in m["sliced"].items():
            s = seq_len // int(n)
            context = np.arange(int(n)) * s
            fwd = cost.forward_ms(s, context)
            bwd = cost.backward_ms(s, context) - np.where(np.arange(int(n)) == int(n) - 1, acc, 0.0)
            out.append((f"{m['name']} n={n} F per slice", fwd.mean(), np.mean(run["forward_ms"])))
            out.append((f"{m['name']} n={n} B per slice", bwd.mean(), np.mean(run["backward_ms"])))
        for n, run in m.get("deferred", {}).items():
            if (m["name"], n) in INCONSISTENT_DEFERRED:
                continue
            s = seq_len // int(n)
            context = np.arange(int(n)) * s
            out.append((f"{m['name']} deferred n={n} F", deferred.forward_ms(s, context).sum(), run["F"]))
            out.append((f"{m['name']} deferred n={n} B", deferred.backward_ms(s, context).sum(), run["B"]))
            if n == "1":
                out.append((f"{m['name']} deferred W", float(deferred.weight_ms(seq_len)) - acc, run["W"]))
    return out


def test_the_data_names_the_four_large_shapes_and_every_slice_count():
    data = measured()
    assert data["device"] == "NVIDIA H100 80GB HBM3" and data["dtype"] == "bfloat16" and data["batch"] == 1
    assert [m["name"] for m in data["models"]] == ["llama-8b", "gpt3-13b", "llama-70b", "gpt3-175b"]
    for m in data["models"]:
        assert sorted(map(int, m["sliced"])) == [1, 2, 4, 8, 16, 32]
        for n, run in m["sliced"].items():
            assert len(run["forward_ms"]) == len(run["backward_ms"]) == int(n)
        spec = stage_cost(m).model   # the measured stages had these parameters (Linears; norms and biases small)
        linear = sum(k * n for k, n in spec.linears) * m["layers"]
        assert 0.995 < linear / m["params"] <= 1.0


def test_h100_preset_predicts_the_measured_layers_within_20_percent():
    rows = comparisons()
    assert len(rows) == 4 * 6 * 2 + (3 * 2 + 1) + (5 * 2 + 1)   # every sliced run; the deferred runs kept
    bad = [f"{what}: predicted {p:.3g} ms, measured {t:.3g} ms ({p / t - 1:+.0%})" for what, p, t in rows
           if abs(p / t - 1) > TOLERANCE]
    assert not bad, "\n".join(bad)


def test_single_slices_scatter_but_stay_near_the_prediction():
    # Slices of one run scatter around their median by up to ~30% (allocations, the first forward's warm-up,
    # clocks); the model predicts their typical time. Only the first forward of a run is left out.
    worst = 0.0
    for m in measured()["models"]:
        cost = stage_cost(m)
        for n, run in m["sliced"].items():
            s = m["seq_len"] // int(n)
            context = np.arange(int(n)) * s
            bwd = cost.backward_ms(s, context)
            bwd[-1] -= cost.accumulate_ms()
            fwd = cost.forward_ms(s, context)
            err = np.concatenate([fwd[1:] / run["forward_ms"][1:], bwd / run["backward_ms"]]) - 1
            worst = max(worst, float(np.abs(err).max()))
    assert worst < 0.4


def test_small_slices_cost_a_read_of_the_weights():
    # a GPT-3-175B layer: 3.6 GB of bf16 weights, so a forward of 64-256 tokens costs about one read (1.6-1.9 ms
    # measured), however few FLOPs it has; the backward reads them, writes their gradient and adds it into .grad
    cost = AnalyticCost(get_model_preset("gpt3-175b"), H100, 1)
    weights = 12 * 12288 ** 2 * 2
    read_ms = weights / (H100.mem_bw_gbps * H100.bandwidth_efficiency * 1e6)
    for s in (8, 64, 128, 256):
        assert read_ms < cost.forward_ms(s, 0) < 1.4 * read_ms
    flops_ms = 24 * 64 * 12288 ** 2 / (H100.peak_tflops * H100.efficiency * 1e9)
    assert cost.forward_ms(64, 0) > 4 * flops_ms
    add_ms = 3 * weights / (H100.mem_bw_gbps * H100.stream_efficiency * 1e6)
    assert cost.accumulate_ms() == pytest.approx(add_ms, rel=0.02)   # and the norms' few launches
    assert cost.backward_ms(64, 0) > 2 * read_ms + add_ms


def test_weight_ms_is_one_pass_over_all_its_tokens():
    gpt = get_model_preset("gpt3-175b")
    deferred = AnalyticCost(gpt, H100, 2, deferred_weight_grads=True)
    plain = AnalyticCost(gpt, H100, 2)
    # one W over a 2048-token micro-batch: a GEMM per Linear; cut into 8 per-slice GEMMs it would cost more
    assert deferred.weight_ms(2048) < 0.6 * 8 * deferred.weight_ms(256)
    # large token counts are FLOP-bound: 2 FLOPs per parameter per token
    flops_ms = 2 * 8192 * 2 * 12 * 12288 ** 2 / (H100.peak_tflops * H100.efficiency * 1e9)
    assert flops_ms < deferred.weight_ms(8192) < 1.2 * flops_ms
    # small ones write the whole gradient and add it into .grad
    grad_bytes = 2 * 12 * 12288 ** 2 * 2
    floor_ms = grad_bytes / (H100.mem_bw_gbps * 1e6) * (1 / H100.bandwidth_efficiency + 3 / H100.stream_efficiency)
    assert floor_ms < deferred.weight_ms(8) < 1.1 * floor_ms
    np.testing.assert_allclose(deferred.weight_ms(np.array([0, 64]), batch=2)[0], 0.0)
    assert deferred.weight_ms(64, batch=2) == pytest.approx(deferred.weight_ms(128))
    # without deferral the same work sits in the backward
    assert float(plain.weight_ms(2048)) == 0.0
    for s in (64, 512, 2048):
        assert plain.backward_ms(s, 0) > deferred.backward_ms(s, 0) + 0.8 * deferred.weight_ms(s)
    assert analytic_pipeline_cost(gpt, H100, 4, deferred_weight_grads=True).has_weight_terms
    assert not analytic_pipeline_cost(gpt, H100, 4).has_weight_terms


def test_cli_plan_of_gpt3_175b_on_8_h100s():
    # `ds-terapipe plan --model gpt3-175b --device h100 --stages 8 --seq-len 2048`: what the CLI builds and asks
    # (analytic cost, W not deferred since it has no weight terms, the CLI's default granularity). The plan the
    # measured sliced runs make predicts 1.83x with 5 slices; FLOPs alone promised 4.5x with 11 slices of ~190.
    cost = analytic_pipeline_cost("gpt3-175b", "h100", 8)
    assert not cost.has_weight_terms
    plan = plan_slicing(cost, 2048, granularity=_DEFAULT_GRANULARITY, deferred_weight_grads=cost.has_weight_terms)
    assert 1.5 <= plan.speedup <= 2.6
    assert 4 <= plan.num_slices <= 8 and min(plan.slices) >= 256


def test_h200_preset_predicts_the_h200_micro_batches_within_12_percent():
    """``h200`` (``h100``'s fractions at the H200's data-sheet bandwidth, nothing fitted to H200 data) against the
    committed H200 run of ``benchmarks/gpu_slices.py``: the 175B- and 70B-shaped layers' whole micro-batches, 1 to 16
    slices, weight gradients in the backward (autograd's accumulation) and deferred (one W pass). At the H100's
    bandwidth the same fractions are off by up to 35%."""
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    report = json.loads((root / "benchmarks" / "results" / "gpu_slices.json").read_text())
    assert "H200" in report["machine"]["device"]
    sys.path.insert(0, str(root / "benchmarks"))
    try:
        from gpu_slices import preset_prediction
    finally:
        sys.path.remove(str(root / "benchmarks"))
    rows = []
    for name, rec in report["shapes"].items():
        for row in rec["rows"]:
            if row["variant"] in ("unsynced", "fused"):
                predicted = preset_prediction(rec, report["machine"]["device"], row["n"], row["variant"])
                rows.append((f"{name} n={row['n']} {row['variant']}", predicted, row["total_ms"]))
    assert len(rows) == 2 * 5 * 2
    bad = [f"{what}: predicted {p:.3g} ms, measured {t:.3g} ms ({p / t - 1:+.0%})" for what, p, t in rows
           if abs(p / t - 1) > 0.12]
    assert not bad, "\n".join(bad)


def test_llama_blocks_have_a_gated_mlp_and_grouped_query_attention():
    llama = TransformerSpec(num_layers=1, hidden=8192, num_heads=64, vocab=128256, seq_len=8192,
                            ffn_hidden=28672, num_kv_heads=8, block="llama")
    assert llama.kv_width == 1024 and len(llama.linears) == 7
    assert sum(k * n for k, n in llama.linears) == 2 * 8192 ** 2 + 2 * 8192 * 1024 + 3 * 8192 * 28672
    gpt = get_model_preset("gpt3-13b")
    assert (gpt.ffn, gpt.kv_width, gpt.block) == (4 * 5120, 5120, "gpt")
    assert sum(k * n for k, n in gpt.linears) == 12 * 5120 ** 2
    # fewer K/V heads: less to read per cached token, so a long prefix costs less
    mha = TransformerSpec(1, 8192, 64, 128256, 8192, ffn_hidden=28672, block="llama")
    long = [AnalyticCost(spec, H100, 1).forward_ms(256, 8000) for spec in (llama, mha)]
    assert long[0] < long[1]
    with pytest.raises(ValueError, match="num_kv_heads = 6 does not divide num_heads = 64"):
        TransformerSpec(1, 8192, 64, 10, 64, num_kv_heads=6)
    with pytest.raises(ValueError, match="block = 'mamba' is unknown; valid blocks: gpt, llama"):
        TransformerSpec(1, 8192, 64, 10, 64, block="mamba")
    with pytest.raises(ValueError, match=r"ffn_hidden = 0 must be >= 1"):
        TransformerSpec(1, 8192, 64, 10, 64, ffn_hidden=0)


def test_device_spec_refuses_fractions_above_one_and_negative_floors():
    base = dict(name="x", peak_tflops=1.0, mem_bw_gbps=1.0, per_layer_overhead_ms=0.0, efficiency=0.5,
                link_gbps=1.0, link_latency_ms=0.0)
    DeviceSpec(**base)   # the new fields have defaults: the roofline of peak and bandwidth alone
    for field in ("bandwidth_efficiency", "stream_efficiency", "attention_efficiency"):
        with pytest.raises(ValueError, match=rf"DeviceSpec\.{field} = 1\.2 must be in \(0, 1\]"):
            DeviceSpec(**base, **{field: 1.2})
    with pytest.raises(ValueError, match=r"DeviceSpec\.kernel_launch_ms = -0\.01 must be >= 0"):
        DeviceSpec(**base, kernel_launch_ms=-0.01)

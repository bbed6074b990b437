"""What a token slice costs on an accelerator, measured beside what the planner predicts for it.

    python benchmarks/gpu_slices.py                          # on the accelerator DeepSpeed picks (a GPU: the
                                                             # five shapes below; a CPU: two small ones)
    python benchmarks/gpu_slices.py --shapes gpt3-175b-x1 --slices 1,8
    python benchmarks/gpu_slices.py --report benchmarks/results/gpu_slices.json   # re-print a report (no device):
                                                             # the prediction columns from the current code

One process, one device, bf16 on a GPU (fp32 on a CPU), batch as listed. Each shape is a stage of decoder
layers; one micro-batch is cut into n equal slices and run as a stage runs them (slice context, KV buffers,
backwards later slices first). Four variants, alternated round by round, medians of ``--rounds``:

* ``sliced``: weight gradients in the backward (accumulated into ``.grad``), a device sync after every slice,
  so each slice's F and B are known (the per-slice table);
* ``fused``: deferred weight gradients, no per-slice sync (as the runtime runs): F, B, then one W pass over the
  micro-batch's slices, one GEMM per Linear (gpipe's W per micro-batch);
* ``per-slice W``: the same, W computed slice by slice (a W per slice, as 1f1b places it): a GEMM per slice;
* ``unsynced``: not deferred, no per-slice sync, autograd adding each weight gradient into ``.grad``;
* ``in-gemm``: the same with each Linear's weight gradient added into ``.grad`` inside its GEMM (``addmm_``), as
  the runtime runs a backward that is not deferred where nothing hooks the accumulation.

Beside each: what the engine's own profile predicts (``profile_stage`` points fitted as ``slices: "auto"``
fits them, plus the measured accumulation into ``.grad`` per backward); on an accelerator (or with
``--steady``) also the same from points whose burst start is taken out (``steady``: bursts of 3 and of 6 copies,
the difference per extra copy; :func:`steady_points`) and from points timed after an untimed lead-in copy on
device events (``lead-in``: the timed copies start on a busy device, as a slice in a run of slices does); and,
where the device has a preset, the analytic preset's prediction. ``W(n)/W(1)`` shows whether a W pass over n
slices reads the weights once.

Why: the planner cuts a micro-batch as finely as its cost model says pays. On a GPU a small slice is bound by
reading the weights and by kernel launches, not by FLOPs; a model that misses either cuts too fine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from benchlib.launch import pin_one_core
from benchlib.slices import VARIANTS, bounds, graphed_ms, run_variant
from benchlib.tables import machine_info, markdown_table, results_path, write_report

NAME = "gpu_slices"

#: name -> shape of a stage (decoder layers) and its micro-batch
SHAPES: dict[str, dict[str, Any]] = {
    "trainer-gpt-8x1024": dict(kind="gpt", hidden=1024, heads=16, layers=8, seq_len=1024, batch=8),
    "llama8b-x2": dict(kind="llama", hidden=4096, heads=32, kv_heads=8, ffn=14336, layers=2, seq_len=8192, batch=1),
    "gpt3-13b-x2": dict(kind="gpt", hidden=5120, heads=40, layers=2, seq_len=2048, batch=1),
    "llama70b-x1": dict(kind="llama", hidden=8192, heads=64, kv_heads=8, ffn=28672, layers=1, seq_len=8192,
                        batch=1),
    "gpt3-175b-x1": dict(kind="gpt", hidden=12288, heads=96, layers=1, seq_len=2048, batch=1),
}
#: copies of a profile point between two syncs on an accelerator (``profile_stage``'s default there)
PROFILE_BURST = 3
#: shapes a CPU runs in a minute (the script's own smoke test)
SMALL_SHAPES: dict[str, dict[str, Any]] = {
    "tiny-gpt": dict(kind="gpt", hidden=128, heads=4, layers=2, seq_len=256, batch=2),
    "tiny-llama": dict(kind="llama", hidden=128, heads=4, kv_heads=2, ffn=256, layers=2, seq_len=256, batch=1),
}


def build_stage(shape: dict[str, Any]) -> torch.nn.Module:
    """The shape's decoder layers, built on the host (their initialisers seed host generators)."""
    if shape["kind"] == "gpt":
        from ds_terapipe.models.gpt import GPTBlock, GPTConfig
        cfg = GPTConfig(num_layers=shape["layers"], hidden=shape["hidden"], num_heads=shape["heads"], vocab_size=256,
                        max_seq_len=shape["seq_len"])
        return torch.nn.Sequential(*[GPTBlock(cfg, i) for i in range(shape["layers"])])
    from transformers import LlamaConfig
    from ds_terapipe.models.hf import causal_lm_specs
    cfg = LlamaConfig(hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], intermediate_size=shape["ffn"],
                      num_hidden_layers=shape["layers"], vocab_size=256, max_position_embeddings=shape["seq_len"])
    specs = causal_lm_specs(cfg)
    return torch.nn.Sequential(*[s.build() for s in specs[1:1 + shape["layers"]]])


def _slice_lengths(seq_len: int, counts: list[int], granularity: int) -> list[int]:
    """The profile's slice lengths: every length the measured runs use, at least one granule."""
    return sorted({max(granularity, seq_len // n // granularity * granularity) for n in counts})


def measure_shape(shape: dict[str, Any], counts: list[int], rounds: int, device: torch.device,
                  dtype: torch.dtype, steady: bool | None = None) -> dict[str, Any]:
    """Profile points (as the engine's profile takes them), accumulation terms, and the four variants' medians.
    ``steady`` (default: on an accelerator): also the points of :func:`steady_points` and the lead-in points."""
    from ds_terapipe.runtime.slicing.deferred import (enable_deferred_weight_grads, enable_fused_grad_accumulation,
                                                      fused_parameters)
    from ds_terapipe.runtime.planning.profile import profile_stage
    from ds_terapipe.runtime.planning.step_profile import time_grad_accumulation
    started = time.perf_counter()
    stage = build_stage(shape).to(device, dtype)
    enable_deferred_weight_grads(stage)   # defers only under a slice context with a stash (fused, per-slice W)
    enable_fused_grad_accumulation(stage)  # adds in the GEMMs only where the state asks (in-gemm)
    built_s = time.perf_counter() - started
    seq_len, batch = shape["seq_len"], shape["batch"]
    x0 = torch.randn(batch, seq_len, shape["hidden"], device=device, dtype=dtype)
    params = [p for p in stage.parameters() if p.requires_grad]
    linear = {id(t) for m in stage.modules() if isinstance(m, torch.nn.Linear) for t in (m.weight, m.bias)
              if t is not None}
    granularity = 64 if seq_len >= 1024 else 16
    lengths = _slice_lengths(seq_len, counts, granularity)
    out: dict[str, Any] = {"shape": shape, "params": sum(p.numel() for p in params), "build_s": built_s}
    t = time.perf_counter()
    steady = device.type != "cpu" if steady is None else steady
    burst = PROFILE_BURST if steady else None   # None: profile_stage's own (3 on an accelerator, 1 on a CPU)
    grid = dict(slice_lengths=lengths, num_contexts=3, warmup=1, repeats=3)
    # the three passes the engine profiles: weight gradients in the backward, deferred, added in the GEMMs
    passes = {"profile": {}, "profile_deferred": {"deferred": True},
              "profile_in_gemm": {"fused": fused_parameters(stage)}}
    for key, kind in passes.items():
        out[key] = profile_stage(stage, params, x0, seq_len, granularity, batch, burst=burst, **kind, **grid)
    if steady:   # bursts of twice the copies: the cost of the extra copies, without the burst's start
        out["profile_steady"] = steady_points(out["profile"], profile_stage(
            stage, params, x0, seq_len, granularity, batch, burst=2 * PROFILE_BURST, **grid))
        out["profile_deferred_steady"] = steady_points(out["profile_deferred"], profile_stage(
            stage, params, x0, seq_len, granularity, batch, deferred=True, burst=2 * PROFILE_BURST, **grid))
        # the burst timed after an untimed lead-in copy, on device events: the timed copies start on a busy device
        for key, kind in passes.items():
            out[key + "_lead_in"] = profile_stage(stage, params, x0, seq_len, granularity, batch, burst=PROFILE_BURST,
                                                  lead_in=True, **kind, **grid)
    out["accumulate_ms"] = {
        "all": time_grad_accumulation(params),
        "not_linear": time_grad_accumulation([p for p in params if id(p) not in linear]),
        "linear": time_grad_accumulation([p for p in params if id(p) in linear])}
    out["profile_s"] = time.perf_counter() - t
    samples: dict[tuple[int, str], list[dict[str, Any]]] = {(n, v): [] for n in counts for v in VARIANTS}
    for rnd in range(rounds + 1):   # round 0 warms every variant up
        for n in counts:
            for variant in VARIANTS:
                took = run_variant(stage, x0, n, variant)
                if rnd:
                    samples[(n, variant)].append(took)
    rows = []
    for (n, variant), runs in samples.items():
        totals = [_total(r) for r in runs]
        med = statistics.median(totals)
        pick = runs[min(range(len(runs)), key=lambda k: abs(totals[k] - med))]
        rows.append({"n": n, "variant": variant, "total_ms": med, "min_ms": min(totals), "max_ms": max(totals),
                     "F": pick["F"], "B": pick["B"], "W": pick["W"]})
    out["rows"] = rows
    if device.type == "cuda":   # the ceiling without the host: each n's micro-batch as one CUDA graph
        out["graphed"] = {}
        for n in counts:
            try:
                out["graphed"][str(n)] = graphed_ms(stage, x0, n)
            except Exception as exc:   # a capture that fails is recorded, not fatal
                out["graphed"][str(n)] = f"{type(exc).__name__}: {exc}"[:300]
                break
    del stage, x0
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def steady_points(short: list[dict[str, Any]], long: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Profile points with the burst's fixed start taken out: ``short`` timed in bursts of ``PROFILE_BURST``
    copies (the engine's default on an accelerator), ``long`` in bursts of twice that, each a per-copy mean; the
    extra copies' time per copy is ``2 * long - short``. A stage that issues its slices back to back pays that,
    not the start (the host's head start and the sync) that a burst shares over its copies. Differences of
    medians are noisy: a value is kept at no less than half the long burst's mean."""
    steady = []
    for a, b in zip(short, long):
        assert (a["slice"], a["context"]) == (b["slice"], b["context"]), (a, b)
        steady.append({k: (max(2 * b[k] - a[k], b[k] / 2) if k.endswith("_ms") else a[k]) for k in a})
    return steady


def _total(r: dict[str, Any]) -> float:
    return sum(r["F"]) + sum(r["B"]) + r["W"] if isinstance(r["F"], list) else r["F"] + r["B"] + r["W"]


def profile_prediction(rec: dict[str, Any], n: int, variant: str, steady: bool = False,
                       lead_in: bool = False) -> dict[str, float]:
    """What the engine's profile says the micro-batch takes: per-slice F and B from the fitted points, plus the
    measured accumulation into ``.grad`` for every backward that adds to a gradient already there (the first one
    of the micro-batch, here slice n-1's, finds none: the runs start from ``.grad = None``), W from the deferred
    fit (one pass, one GEMM per Linear over the W's tokens). ``steady``: from :func:`steady_points` instead;
    ``lead_in``: from the points timed after a lead-in copy (``profile_stage``'s ``lead_in``)."""
    from ds_terapipe.planner.cost import MeasuredCost
    from ds_terapipe.runtime.planning.profile import weight_cost
    shape = rec["shape"]
    seq_len, batch = shape["seq_len"], shape["batch"]
    cuts = bounds(seq_len, n)
    deferred = variant in ("fused", "per-slice W")
    if variant == "in-gemm":   # the Linears' weights add into .grad inside the profiled backward (no steady points)
        points = rec["profile_in_gemm" + ("_lead_in" if lead_in else "")]
    else:
        suffix = "_steady" if steady else "_lead_in" if lead_in else ""
        points = rec[("profile_deferred" if deferred else "profile") + suffix]
    cost = MeasuredCost([{k: v for k, v in p.items() if k != "weight_ms"} for p in points])
    acc = rec["accumulate_ms"]["not_linear"] + (0.0 if deferred or variant == "in-gemm" else
                                                rec["accumulate_ms"]["linear"])
    f = [float(cost.forward_ms(b - a, a, batch)) for a, b in cuts]
    bw = [float(cost.backward_ms(b - a, a, batch)) + (acc if i < n - 1 else 0.0) for i, (a, b) in enumerate(cuts)]
    w = 0.0
    if deferred:
        per_pass, per_token = weight_cost(points, batch)
        if variant == "fused":   # one pass; its gradients find .grad empty
            w = (per_pass + per_token * seq_len) * batch
        else:                    # a pass per slice, each after the first adding to .grad
            w = sum((per_pass + per_token * (b - a)) * batch for a, b in cuts) + (n - 1) * rec["accumulate_ms"][
                "linear"]
    return {"F": f, "B": bw, "W": w, "total_ms": sum(f) + sum(bw) + w}


def preset_prediction(rec: dict[str, Any], device_name: str, n: int, variant: str) -> float | None:
    """The analytic device preset's micro-batch time, where the device has a preset (None otherwise)."""
    from ds_terapipe.planner.cost import AnalyticCost, TransformerSpec
    from ds_terapipe.planner.presets import DEVICE_PRESETS
    key = next((k for k in DEVICE_PRESETS if k != "cpu" and k in device_name.lower()), None)
    if key is None:
        return None
    shape = rec["shape"]
    spec = TransformerSpec(num_layers=shape["layers"], hidden=shape["hidden"], num_heads=shape["heads"], vocab=256,
                           seq_len=shape["seq_len"], ffn_hidden=shape.get("ffn"), num_kv_heads=shape.get("kv_heads"),
                           block=shape["kind"])
    deferred = variant in ("fused", "per-slice W")
    cost = AnalyticCost(spec, DEVICE_PRESETS[key], shape["layers"], deferred_weight_grads=deferred)
    cuts = bounds(shape["seq_len"], n)
    total = sum(float(cost.forward_ms(b - a, a, shape["batch"])) + float(cost.backward_ms(b - a, a, shape["batch"]))
                for a, b in cuts)
    if variant == "fused":
        total += float(cost.weight_ms(shape["seq_len"], shape["batch"]))
    elif variant == "per-slice W":
        total += sum(float(cost.weight_ms(b - a, shape["batch"])) for a, b in cuts)
    return total


def render(report: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """The tables (lines) and the checks, from a report's measurements and the current cost code."""
    lines, checks = [], []
    device = report.get("device_name", "cpu")
    for name, rec in report["shapes"].items():
        if "error" in rec:
            lines += [f"\n{name}: {rec['error']}"]
            continue
        s = rec["shape"]
        lines += [f"\n{name}: {s['layers']} layer(s), hidden {s['hidden']}, L = {s['seq_len']}, batch {s['batch']} "
                  f"({rec['params'] / 1e9:.2f} B parameters; profile {rec['profile_s']:.1f} s)"]
        rows = {(r["n"], r["variant"]): r for r in rec["rows"]}
        counts = sorted({r["n"] for r in rec["rows"]})
        w1 = rows.get((1, "fused"), {}).get("W")
        table = []
        for n in counts:
            sl = rows[(n, "sliced")]
            fu, ps, un = rows[(n, "fused")], rows[(n, "per-slice W")], rows[(n, "unsynced")]
            pred = {v: profile_prediction(rec, n, v)["total_ms"] for v in ("unsynced", "fused")}
            steady = {v: profile_prediction(rec, n, v, steady=True)["total_ms"] if "profile_steady" in rec else None
                      for v in ("unsynced", "fused")}
            preset = {v: preset_prediction(rec, device, n, v) for v in ("unsynced", "fused")}
            gemm = rows.get((n, "in-gemm"))   # (reports before the variant existed have none)
            gemm_pred = profile_prediction(rec, n, "in-gemm")["total_ms"] if "profile_in_gemm" in rec else None
            lead = {v: profile_prediction(rec, n, v, lead_in=True)["total_ms"] if "profile_lead_in" in rec else None
                    for v in ("unsynced", "fused", "in-gemm")}   # (reports before the lead-in have none)
            table.append([str(n), f"{statistics.median(sl['F']):.2f}", f"{statistics.median(sl['B']):.2f}",
                          f"{un['total_ms']:.1f}", f"{pred['unsynced']:.1f}", _ms(steady["unsynced"]),
                          _ms(lead["unsynced"]), _ms(preset["unsynced"]), _ms(gemm and gemm["total_ms"]),
                          _ms(gemm_pred), _ms(lead["in-gemm"]),
                          f"{fu['F']:.1f} / {fu['B']:.1f} / {fu['W']:.1f}", f"{fu['total_ms']:.1f}",
                          f"{pred['fused']:.1f}", _ms(steady["fused"]), _ms(lead["fused"]), _ms(preset["fused"]),
                          f"{ps['W']:.1f}", "-" if not w1 else f"{fu['W'] / w1:.2f}",
                          "-" if not w1 else f"{ps['W'] / w1:.2f}"])
            if gemm is not None and gemm_pred is not None:
                checks.append({"shape": name, "n": n, "variant": "in-gemm", "what": "profile-predicted micro-batch",
                               "measured_ms": gemm["total_ms"], "predicted_ms": gemm_pred,
                               "rel_err": gemm_pred / gemm["total_ms"] - 1, "vs_unsynced": gemm["total_ms"] /
                               un["total_ms"]})
            for variant, measured in (("unsynced", un["total_ms"]), ("fused", fu["total_ms"])):
                err = pred[variant] / measured - 1
                checks.append({"shape": name, "n": n, "variant": variant, "what": "profile-predicted micro-batch",
                               "measured_ms": measured, "predicted_ms": pred[variant], "rel_err": err})
                if steady[variant] is not None:
                    checks.append({"shape": name, "n": n, "variant": variant,
                                   "what": "steady-profile-predicted micro-batch", "measured_ms": measured,
                                   "predicted_ms": steady[variant], "rel_err": steady[variant] / measured - 1})
            for variant, row in (("unsynced", un), ("fused", fu), ("in-gemm", gemm)):
                if lead[variant] is not None and row is not None:
                    checks.append({"shape": name, "n": n, "variant": variant,
                                   "what": "lead-in-profile-predicted micro-batch", "measured_ms": row["total_ms"],
                                   "predicted_ms": lead[variant], "rel_err": lead[variant] / row["total_ms"] - 1})
            if w1:
                checks.append({"shape": name, "n": n, "variant": "fused", "what": "W(n)/W(1)",
                               "ratio": fu["W"] / w1, "per_slice_ratio": ps["W"] / w1})
        if rec.get("graphed"):
            lines += ["CUDA graph of the not-deferred micro-batch (no host in the way), ms: " + ", ".join(
                f"n = {n}: {v:.1f} (eager {rows[(int(n), 'unsynced')]['total_ms']:.1f})" if isinstance(v, float)
                else f"n = {n}: {v}" for n, v in rec["graphed"].items())]
        lines += markdown_table(
            ["n", "F/slice", "B/slice", "not deferred", "profile", "steady", "lead-in", "preset", "in GEMM", "profile",
             "lead-in", "deferred F / B / W", "deferred", "profile", "steady", "lead-in", "preset", "W per slice",
             "W(n)/W(1)", "per-slice W(n)/W(1)"], table)
    return lines, checks


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=None, help="comma-separated names (default: all five on a GPU, two small "
                                                    f"ones on a CPU); known: {', '.join([*SHAPES, *SMALL_SHAPES])}")
    ap.add_argument("--slices", default="1,2,4,8,16", help="slice counts, comma-separated")
    ap.add_argument("--rounds", type=int, default=5, help="rounds after one warm-up round")
    ap.add_argument("--device", default=None, help="default: the DeepSpeed accelerator's device")
    ap.add_argument("--dtype", default=None, choices=("bf16", "fp16", "fp32"), help="default: bf16 on a GPU")
    ap.add_argument("--steady", action="store_true",
                    help="also the steady and lead-in profiles on a CPU (an accelerator always takes them)")
    ap.add_argument("--report", default=None, help="re-print this report with the current code's predictions")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.report:
        report = json.loads(Path(args.report).read_text())
        lines, report["checks"] = render(report)
        print("\n".join(lines))
        return
    if args.device is None:
        from deepspeed.accelerator import get_accelerator
        args.device = get_accelerator().device_name()
    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    if on_cpu:   # one pinned core, as the other CPU benchmarks
        pin_one_core()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("fp32" if on_cpu else "bf16")]
    known = {**SHAPES, **SMALL_SHAPES}
    names = args.shapes.split(",") if args.shapes else list(SMALL_SHAPES if on_cpu else SHAPES)
    unknown = [n for n in names if n not in known]
    if unknown:
        sys.exit(f"unknown shape(s) {unknown}; known: {', '.join(known)}")
    counts = sorted({int(c) for c in args.slices.split(",")} | {1})
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict[str, Any] = {"device_name": device_name, "dtype": str(dtype), "options": vars(args), "shapes": {}}
    path = Path(args.json) if args.json else results_path(NAME)
    for name in names:
        try:
            report["shapes"][name] = measure_shape(known[name], counts, args.rounds, device, dtype,
                                                   steady=True if args.steady else None)
        except Exception as exc:   # record it and go on: one shape that does not fit must not lose the others
            report["shapes"][name] = {"error": f"{type(exc).__name__}: {exc}"}
        write_report(report, path, machine=machine_info(device=device_name))   # what is measured so far survives
        print(f"measured {name}", flush=True)
    lines, report["checks"] = render(report)
    print(f"\n{device_name}, {dtype}; medians of {args.rounds} rounds; ms. F/slice, B/slice: medians over the "
          "slices of the per-slice-synchronised run (B with weight gradients into .grad); 'not deferred' and "
          "'deferred' are whole micro-batches run without per-slice syncs; 'profile': the engine's profile's "
          "prediction; 'steady': the same from points without the burst's start; 'preset': the analytic device "
          "preset's")
    print("\n".join(lines))
    path = write_report(report, path, machine=machine_info(device=device_name))
    print(f"\nreport: {path}")


if __name__ == "__main__":
    main()

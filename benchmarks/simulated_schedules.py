"""Where each schedule wins at scale: simulated step times for GPT-3 175B on 48 x V100 (TeraPipe's setting).

    python benchmarks/simulated_schedules.py            # the table; report: benchmarks/results/simulated_schedules.json
    python benchmarks/simulated_schedules.py --json out.json --microbatches 1 4 8

Nothing runs on a GPU: every row is the event simulator (``planner/simulate.py``) under the analytic roofline
cost of the presets (``planner/presets.py``: GPT-3 175B, 96 layers; V100), with the LM head on the last chunk.
48 pipeline ranks; schedules with virtual stages cut the model into 48·v chunks (v = 2: one layer each; v = 4
would need 192 chunks of a 96-layer model and is listed as not runnable). Rows per sequence length L and
micro-batch count m:

* stock-style ``1f1b`` and Megatron-style ``interleaved-1f1b`` with whole sequences (slices = 1): what
  pipelines without token slicing get;
* TeraPipe ``gpipe``, token ``1f1b`` and each schedule with virtual stages (``interleaved-1f1b``, ``looped-bfs``,
  ``dualpipev``), with the slicing the planner chooses for that schedule (``plan_slicing``, granularity 16 at
  L = 2048 and 64 at L = 8192).

The analytic cost has no separate weight-gradient time, so ``dualpipev`` runs without deferred W here (its
backward does the weight gradients): the W passes it can hide in the bubble are not credited. "peak units" is
the activation memory of the busiest rank in whole-rank units (a unit alive on one of v chunks counts 1/v), so
rows compare at the same layer count.
"""
from __future__ import annotations

import time
from typing import Any

from benchlib.tables import benchmark_parser, fmt, markdown_table, results_path, write_report

from ds_terapipe.planner.presets import MODEL_PRESETS, analytic_pipeline_cost
from ds_terapipe.planner.registry import get_schedule
from ds_terapipe.planner.schedule import build_schedule
from ds_terapipe.planner.simulate import simulate
from ds_terapipe.planner.slicing import plan_slicing

NAME = "simulated_schedules"
MODEL, DEVICE, RANKS = "gpt3-175b", "v100", 48
GRANULARITY = {2048: 16, 8192: 64}

# (label, schedule, virtual stages, sliced by the planner)
VARIANTS = [
    ("stock 1F1B (slices = 1)", "1f1b", 1, False),
    ("interleaved, v = 2 (slices = 1)", "interleaved-1f1b", 2, False),
    ("interleaved, v = 4 (slices = 1)", "interleaved-1f1b", 4, False),
    ("TeraPipe gpipe", "gpipe", 1, True),
    ("token 1f1b", "1f1b", 1, True),
    ("token interleaved-1f1b, v = 2", "interleaved-1f1b", 2, True),
    ("token interleaved-1f1b, v = 4", "interleaved-1f1b", 4, True),
    ("token looped-bfs, v = 2", "looped-bfs", 2, True),
    ("token dualpipev, v = 2", "dualpipev", 2, True),
]


def run_variant(schedule: str, v: int, sliced: bool, seq_len: int, m: int) -> dict[str, Any]:
    layers = MODEL_PRESETS[MODEL].num_layers
    if RANKS * v > layers:
        return {"skipped": f"{RANKS} x {v} = {RANKS * v} chunks > {layers} layers"}
    cost = analytic_pipeline_cost(MODEL, DEVICE, RANKS * v)
    t0 = time.perf_counter()
    if sliced:
        plan = plan_slicing(cost, seq_len, num_microbatches=m, granularity=GRANULARITY[seq_len], schedule=schedule,
                            virtual_stages=v)
        slices = list(plan.slices)
    else:
        slices = [seq_len]
    seconds = time.perf_counter() - t0
    res = simulate(build_schedule(schedule, RANKS, m, len(slices), virtual_stages=v), cost, slices)
    if sliced:
        assert abs(res.makespan_ms - plan.predicted_ms) <= 1e-9 * res.makespan_ms, "planner and simulator disagree"
    bubble = get_schedule(schedule).bubble
    return {"num_slices": len(slices), "slices": slices, "step_ms": res.makespan_ms,
            "bubble_fraction": res.bubble_fraction, "peak_units_per_rank": max(res.peak_in_flight),
            "peak_rank_units": max(res.peak_in_flight) / v,
            "equal_cost_bubble": bubble(RANKS, m * len(slices), v) if bubble else None, "plan_seconds": seconds}


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--seq-len", type=int, nargs="+", default=[2048, 8192], choices=sorted(GRANULARITY))
    parser.add_argument("--microbatches", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--json", default=str(results_path(NAME)), help="where to write the report")
    args = parser.parse_args()
    rows, out = [], []
    for seq_len in args.seq_len:
        for m in args.microbatches:
            stock = None
            for label, schedule, v, sliced in VARIANTS:
                r = run_variant(schedule, v, sliced, seq_len, m)
                if stock is None:
                    stock = r["step_ms"]
                r.update(label=label, schedule=schedule, virtual_stages=v, sliced=sliced, seq_len=seq_len,
                         num_microbatches=m)
                if "skipped" not in r:
                    r["speedup_vs_stock_1f1b"] = stock / r["step_ms"]
                out.append(r)
                rows.append([str(seq_len), str(m), label, *(["-"] * 5 + [r["skipped"]] if "skipped" in r else [
                    str(r["num_slices"]), fmt(r["step_ms"], ".4g"), fmt(r["speedup_vs_stock_1f1b"], ".2f") + "x",
                    fmt(100 * r["bubble_fraction"], ".1f") + "%", fmt(r["peak_rank_units"], "g"),
                    fmt(r["plan_seconds"], ".2f") + " s"])])
            best = min((r for r in out if r.get("seq_len") == seq_len and r.get("num_microbatches") == m
                        and "skipped" not in r), key=lambda r: r["step_ms"])
            print(f"L={seq_len} m={m}: fastest {best['label']} ({best['step_ms']:.4g} ms)")
    header = ["L", "m", "schedule", "slices", "step ms", "vs stock 1F1B", "bubble", "peak units", "planned in"]
    print("\n".join(markdown_table(header, rows)))
    path = write_report({"name": NAME, "model": MODEL, "device": DEVICE, "ranks": RANKS,
                         "granularity": GRANULARITY, "rows": out}, args.json)
    print(f"report: {path}")


if __name__ == "__main__":
    main()

"""Token schedules with virtual stages against the peers that have them, side by side in one run (2 CPU ranks).

    python benchmarks/virtual_stages.py                  # ~50 min; report: benchmarks/results/virtual_stages.json
    python benchmarks/virtual_stages.py --quick          # small model, m in {1, 4}: a smoke run of a few minutes
    python benchmarks/virtual_stages.py --plots docs/img --timeline 1,token/dualpipev

Two processes, one core and one thread each, the reference GPT (8 blocks, hidden 512, seq 1024, micro-batch 1)
for m in {1, 2, 4, 8}. Every step of every variant alternates round by round (``benchlib.alternate``), so a slow
phase of the shared host hits all alike; rows report medians over the rounds. Variants:

* peers: stock DeepSpeed 1F1B (``TrainSchedule``, the baseline), DeepSpeed's ``DualPipeV`` (m >= 4 only: its
  engine needs 2 micro-batches per rank), torch.distributed.pipelining's ``ScheduleInterleaved1F1B``,
  ``ScheduleLoopedBFS`` and its zero-bubble schedules ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``
  and ``ScheduleDualPipeV`` (m >= 4 only), all with 2 stages per rank (``benchlib/peers.py``);
* token pipeline: ``1f1b`` (v = 1) and each schedule with virtual stages (v = 2), all with ``slices: "auto"``.

Columns: step ms; speedup over stock 1F1B (median of per-round ratios); over the best peer at that m (ratio of
medians); efficiency = bubble-free bound (the busiest rank's compute time) / step, for engines whose
instructions are timed (not torch's); the planner's predicted step error; each rank's peak heap during a step.
Workers are ``pipeline_speedup.py``'s (same engines, meters and rounds). Every variant starts from the same
weights and sees the same batches, so the losses of one round must agree across all of them: the run checks it,
which guards the peers' wiring (tied embedding/head, loss scaling) as much as ours.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
import time
from pathlib import Path

import pipeline_speedup as ps
from benchlib.launch import launch_workers
from benchlib.peers import PEER_VARIANTS
from benchlib.tables import ROOT, benchmark_parser, fmt, markdown_table, print_checks, results_path

NAME = "virtual_stages"
PEERS = ["stock", *PEER_VARIANTS]   # stock DeepSpeed 1F1B first: the baseline
TOKEN: dict[str, dict] = {
    "token/1f1b": {"slices": "auto", "schedule": "1f1b"},
    "token/interleaved-1f1b": {"slices": "auto", "schedule": "interleaved-1f1b", "virtual_stages": 2},
    "token/looped-bfs": {"slices": "auto", "schedule": "looped-bfs", "virtual_stages": 2},
    "token/dualpipev": {"slices": "auto", "schedule": "dualpipev", "virtual_stages": 2},
    "token/zbv": {"slices": "auto", "schedule": "zbv", "virtual_stages": 2},
}


def build_rows(report: dict, ms: list[int]) -> list[dict]:
    """Per m and variant: step, both speedups, efficiency, planner error, peak heap per rank."""
    rows = []
    for m in ms:
        at_m = {r["variant"]: r for r in report["rows"] if r["m"] == m}
        peers = {v: r for v, r in at_m.items() if v in PEERS}
        best_peer = min(peers, key=lambda v: peers[v]["step_ms"])
        for v, r in at_m.items():
            torch_peer = v.startswith("torch-")
            rows.append({
                "m": m, "variant": v, "kind": "peer" if v in PEERS else "token",
                "slices": r["slices"] if v.startswith("token/") else None,
                "step_ms": r["step_ms"], "vs_stock": r["speedup"],
                "vs_best_peer": peers[best_peer]["step_ms"] / r["step_ms"], "best_peer": best_peer,
                "efficiency": None if torch_peer else r["efficiency"],
                "pred_err": r["pred_err"], "heap_mib": r["heap_mib"], "losses": r["losses"],
                "clean_rounds": r["clean_rounds"], "rounds_used": r["rounds_used"],
            })
    return rows


def print_table(rows: list[dict]) -> str:
    body = []
    for r in rows:
        slices = "-" if r["slices"] is None else (f"{len(r['slices'])}" if len(set(r["slices"])) == 1
                                                  else f"{len(r['slices'])} (unequal)")
        body.append([r["m"], r["variant"], slices, f"{r['step_ms']:.0f}", f"{r['vs_stock']:.2f}x",
                     f"{r['vs_best_peer']:.2f}x", fmt(None if r["efficiency"] is None else 100 * r["efficiency"],
                                                      ".0f") + ("%" if r["efficiency"] is not None else ""),
                     fmt(None if r["pred_err"] is None else 100 * r["pred_err"], "+.1f")
                     + ("%" if r["pred_err"] is not None else ""),
                     " / ".join(f"{x:.0f}" for x in r["heap_mib"])])
    lines = markdown_table(["m", "variant", "slices", "step ms", "vs stock 1F1B", "vs best peer", "eff",
                            "pred err", "peak heap MiB (rank 0 / 1)"], body)
    text = "\n".join(lines)
    print(text)
    return text


def check_floors(rows: list[dict], ms: list[int]) -> list[dict]:
    """The issue's floors: the best token schedule vs the best peer per m, and its efficiency."""
    checks = []
    for m in ms:
        token = [r for r in rows if r["m"] == m and r["kind"] == "token"]
        best = max(token, key=lambda r: r["vs_best_peer"])
        ratio = best["vs_best_peer"]
        need = 1.2 if m == 1 else (1.0 if m == 2 else 0.97)
        checks.append({"target": f"m={m} best token schedule ({best['variant']}) >= {need:.2f}x the best peer "
                                 f"({best['best_peer']})", "value": ratio, "met": ratio >= need})
        eff = max(r["efficiency"] for r in token)
        checks.append({"target": f"m={m} best token efficiency >= 90%", "value": eff, "met": eff >= 0.90})
    print_checks(checks)
    return checks


def check_losses(rows: list[dict], rtol: float = 1e-4) -> list[dict]:
    """Same weights, same batches, same optimizer: every variant's loss of a round must agree at each m."""
    out = []
    for m in sorted({r["m"] for r in rows}):
        at_m = [r for r in rows if r["m"] == m and r["losses"]]
        ref = at_m[0]
        worst = max(abs(a - b) / max(abs(b), 1e-12) for r in at_m for a, b in zip(r["losses"], ref["losses"]))
        out.append({"target": f"m={m} losses of every variant agree with {ref['variant']} (rel <= {rtol:g})",
                    "value": worst, "met": worst <= rtol})
    print_checks(out)
    return out


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--micro-batches", default="1,2,4,8", help="m values, comma-separated")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per m")
    ap.add_argument("--steps", type=int, default=3, help="timed rounds per m (one step of every variant each)")
    ap.add_argument("--quiet-wait", type=float, default=10.0,
                    help="seconds to wait before each timed round for other processes to go quiet (0: never)")
    ap.add_argument("--quick", action="store_true", help="4 blocks, hidden 256, seq 256, m in {1, 4}, 2 rounds")
    ap.add_argument("--json", metavar="PATH", help=f"report path (default: {results_path(NAME).relative_to(ROOT)};"
                                                   " with --quick: the --out directory)")
    ap.add_argument("--plots", metavar="DIR", help="write measured and planned timelines to DIR")
    ap.add_argument("--timeline", action="append", metavar="M,VARIANT",
                    help="whose median step --plots draws (repeatable; default 1,token/interleaved-1f1b)")
    ap.add_argument("--out", metavar="DIR", help="worker logs and raw records (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=5400.0, help="seconds before the workers are killed")
    args = ap.parse_args()
    size = dict(seq_len=1024, layers=8, hidden=512, heads=8)
    if args.quick:
        size = dict(seq_len=256, layers=4, hidden=256, heads=4)
        args.micro_batches = "1,4" if args.micro_batches == "1,2,4,8" else args.micro_batches
        args.warmup, args.steps = 1, 2
    ms = [int(x) for x in args.micro_batches.split(",")]
    opts = {**size, "vocab": 256, "micro_batches": ms, "variants": [*PEERS, *TOKEN], "extra_variants": TOKEN,
            "profile": None, "warmup": args.warmup, "steps": args.steps, "max_rounds": 2 * args.steps,
            "quiet_wait": args.quiet_wait, "foreign_max": 0.2, "bind_cores": True}
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix=f"{NAME}-"))
    print(f"2 ranks x 1 thread, GPT {size['layers']} blocks, hidden {size['hidden']}, seq {size['seq_len']}, "
          f"micro-batch 1, m in {ms}; variants {', '.join(opts['variants'])}; logs in {out_dir}", flush=True)
    started = time.perf_counter()
    shutil.rmtree(out_dir / "plans", ignore_errors=True)   # profile afresh
    ranks = launch_workers(Path(ps.__file__), ps.NUM_STAGES, out_dir, opts, timeout_s=args.timeout)
    report = ps.analyse(ranks, opts)
    print()
    rows = build_rows(report, ms)
    report = {"rows": rows, "table": print_table(rows), "pipeline_rows": report["rows"]}
    print("\nFloors:")
    report["targets"] = check_floors(rows, ms)
    print("\nSanity:")
    report["loss_checks"] = check_losses(rows)
    if args.plots:
        report["plots"] = ps.draw_timelines({"rows": report["pipeline_rows"]},
                                            args.timeline or ["1,token/interleaved-1f1b"], Path(args.plots), out_dir)
        for plots in report["plots"]:
            plots.pop("per_action", None)
    for r in report["pipeline_rows"]:   # the raw per-round events are in the worker logs, not the report
        r.pop("median_step_events", None)
    json_path = Path(args.json) if args.json else (out_dir / f"{NAME}.json" if args.quick else results_path(NAME))
    ps.finish_report(report, opts, ranks, started, json_path, cores_pinned=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

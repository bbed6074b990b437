"""Speed as users see it: the example trainer through the ``deepspeed`` launcher, token pipeline vs stock DeepSpeed,
with the planner's predicted ms/step beside the measured one.

    python benchmarks/trainer_speed.py                      # m in {1, 2, 4}, 3 rounds: about 30 minutes
    python benchmarks/trainer_speed.py --micro-batches 1 --rounds 2 --json /tmp/t.json

Each launch is what a user types: ``deepspeed --num_gpus 2 examples/train_gpt.py --deepspeed_config CFG --steps S
--log-every 1 --bind-cores`` (GPT 8 x 512, 8 heads, seq 1024, micro-batch 1, m micro-batches, AdamW, fp32, ZeRO 0,
2 stages, each process pinned to its own core). Variants: ``stock`` (``terapipe.enabled: false``: DeepSpeed's
PipelineEngine, 1F1B ``TrainSchedule``), ``gpipe`` and ``1f1b`` (``slices: "auto"``, planned at init; a plan cache
shared by the rounds, so only the first launch of a variant profiles); with ``--variants`` any other
registered schedule, at its default chunks per rank (``interleaved-1f1b``, ``looped-bfs``, ``dualpipev``, ``zbv``:
two, so the trainer cuts the 8 blocks into 4 chunks of 2), and any schedule with ``+replan`` (``gpipe+replan``): the
same with ``terapipe.replan`` on at its defaults (refit after 5 warm-up and 3 measured steps, inside ``--warmup``,
which is then 8 by default; the printed plan is the refit model's from then on). A round launches every variant once
per m,
the order rotated per round; each launch trains ``--warmup`` + ``--steps`` steps and the trainer's per-step ms of
the last ``--steps`` are kept. Reported per (m, variant): the median ms/step over all kept steps of all rounds, the
speedup over stock (median over rounds of the per-round ratio of medians), the plan's predicted ms/step (the
trainer prints it; the plan includes the optimizer step, gradient reductions and per-action overheads measured at
init: ``runtime/planning/step_profile.py``) and its error against the measured median.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.alternate import median
from benchlib.tables import ROOT, benchmark_parser, markdown_table, print_checks, results_path, write_report
from ds_terapipe.config import ReplanConfig
from ds_terapipe.planner.registry import schedule_names

NAME = "trainer_speed"
VARIANTS = ("stock", "gpipe", "1f1b")
STEP_LINE = re.compile(r"^step\s+(\d+)\s+loss\s+([\d.]+)\s+[\d,]+ tokens/s\s+(\d+) ms/step(?: \(plan: (\d+) ms\))?")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: ``+replan`` variants re-plan (config defaults) after this many steps, which ``--warmup`` must cover.
REPLAN_AFTER = ReplanConfig().warmup_steps + ReplanConfig().measure_steps


def _config(variant: str, m: int, seq_len: int, cache: str) -> dict[str, Any]:
    terapipe: dict[str, Any] = {"enabled": variant != "stock", "seq_len": seq_len, "slices": "auto",
                                "granularity": 16, "plan_cache": cache, "p2p_timeout_s": 600}
    schedule, replan = variant.removesuffix("+replan"), variant.endswith("+replan")
    if variant != "stock":
        terapipe["schedule"] = schedule
    if replan:
        terapipe["replan"] = {"enabled": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m, "gradient_clipping": 1.0,
            "steps_per_print": 10**9, "pipeline": {"stages": 2}, "terapipe": terapipe}


def launch(variant: str, m: int, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """One trainer run through the deepspeed launcher; the per-step ms and the plan's prediction from its log."""
    cfg = work / f"ds_{variant}_m{m}.json"
    cfg.write_text(json.dumps(_config(variant, m, args.seq_len, str(work / "plan_cache"))))
    launcher = [shutil.which("deepspeed")] if shutil.which("deepspeed") else [sys.executable, "-m",
                                                                              "deepspeed.launcher.runner"]
    cmd = [*launcher, "--num_gpus", "2", "--master_port", str(_free_port()), str(ROOT / "examples" / "train_gpt.py"),
           "--deepspeed_config", str(cfg), "--steps", str(args.warmup + args.steps), "--log-every", "1",
           "--eval-every", "0", "--max-corpus-mb", "1", "--bind-cores", "--layers", str(args.layers),
           "--hidden", str(args.hidden), "--heads", str(args.heads), "--seed", "1234"]
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    log = proc.stdout + proc.stderr
    (work / f"log_{variant}_m{m}_{int(started)}.txt").write_text(log)
    if proc.returncode != 0:
        raise RuntimeError(f"{variant} m={m}: the trainer exited {proc.returncode}:\n{log[-3000:]}")
    steps = []
    for line in log.splitlines():
        found = STEP_LINE.search(line.split("] ")[-1].strip())
        if found:
            steps.append((int(found.group(1)), float(found.group(3)), float(found.group(4) or 0) or None))
    kept = [ms for step, ms, _ in steps if step > args.warmup]
    plans = [plan for step, _, plan in steps if step > args.warmup and plan]
    return {"ms": kept, "plan_ms": plans[-1] if plans else None, "slices": slices_run(log),
            "seconds": time.perf_counter() - started}


def slices_run(log: str) -> Any:
    """The slicing the launch ended on: the plan logged at init, or the re-planner's when it switched."""
    slices = re.findall(r"running \S+ with \d+ slice\(s\) (\[[\d, ]+\])", log)
    switched = re.findall(r"re-plan after .* best (\[[\d, ]+\]) [\d.]+ ms \([^)]*\): switching", log)
    found = switched or slices
    return json.loads(found[-1]) if found else None


def main() -> int:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--micro-batches", default="1,2,4", help="comma-separated m values")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=None,
                    help="steps per launch not kept (measured: the first 4-5 steps of a launch run 5-40%% slower); "
                         f"default 5, or {REPLAN_AFTER} with a +replan variant (its re-plan comes first)")
    ap.add_argument("--steps", type=int, default=6, help="steps per launch kept")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated: stock or a schedule ({', '.join(schedule_names())}), optionally with "
                         "+replan")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per launch")
    ap.add_argument("--json", metavar="PATH", help=f"report path (default {results_path(NAME).relative_to(ROOT)})")
    ap.add_argument("--out", metavar="DIR", help="logs and plan cache (default: a temporary directory)")
    args = ap.parse_args()
    ms_values = [int(x) for x in args.micro_batches.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v != "stock" and v.removesuffix("+replan") not in schedule_names()]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; give stock or a schedule ({', '.join(schedule_names())}), "
                 "optionally with +replan")
    replanning = any(v.endswith("+replan") for v in variants)
    if args.warmup is None:
        args.warmup = REPLAN_AFTER if replanning else 5
    if replanning and args.warmup < REPLAN_AFTER:
        ap.error(f"--warmup {args.warmup}: +replan variants re-plan after step {REPLAN_AFTER}; give at least that")
    work = Path(args.out or tempfile.mkdtemp(prefix="trainer_speed-"))
    work.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, list[dict]]] = {str(m): {v: [] for v in variants} for m in ms_values}
    loads = []
    for rnd in range(args.rounds):
        for m in ms_values:
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            for variant in order:
                loads.append(os.getloadavg()[0])
                run = launch(variant, m, args, work)
                runs[str(m)][variant].append(run)
                print(f"round {rnd} m={m} {variant}: median {median(run['ms']):.0f} ms/step (plan "
                      f"{run['plan_ms']} ms), slices {run['slices']}, {run['seconds']:.0f} s, load "
                      f"{loads[-1]:.1f}", flush=True)
    rows, summary, checks = [], {}, []
    for m in ms_values:
        base = runs[str(m)].get("stock")
        for variant in variants:
            done = runs[str(m)][variant]
            med = median([ms for run in done for ms in run["ms"]])
            speed = median([median(b["ms"]) / median(r["ms"]) for b, r in zip(base, done)]) if base else None
            plan = median([r["plan_ms"] for r in done if r["plan_ms"]]) if any(r["plan_ms"] for r in done) else None
            err = (plan - med) / med if plan else None
            summary[f"{m}/{variant}"] = {"median_ms": med, "speedup": speed, "plan_ms": plan, "plan_err": err,
                                         "slices": done[-1]["slices"]}
            rows.append([m, variant, done[-1]["slices"] or "-", f"{med:.0f}", f"{speed:.2f}x" if speed else "-",
                         f"{plan:.0f}" if plan else "-", f"{err:+.1%}" if err is not None else "-"])
            if variant != "stock" and err is not None:
                checks.append({"target": f"m={m} {variant}: plan within 5% of measured", "value": err,
                               "met": abs(err) <= 0.05})
    for variant in variants:
        key = f"1/{variant}"
        if variant != "stock" and key in summary and summary[key]["speedup"]:
            checks.append({"target": f"m=1 {variant} >= 1.55x stock (trainer)", "value": summary[key]["speedup"],
                           "met": summary[key]["speedup"] >= 1.55})
    table = markdown_table(["m", "variant", "slices", "ms/step", "vs stock", "plan ms", "plan err"], rows)
    print("\n".join(table))
    print_checks(checks)
    report = {"opts": vars(args), "runs": runs, "summary": summary, "table": table, "checks": checks,
              "load_average_at_launch": loads}
    path = Path(args.json) if args.json else results_path(NAME)
    print(f"report: {write_report(report, path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Randomized cross-feature equivalence: cases drawn from a seeded generator over the feature matrix of the
``"terapipe"`` config, run by suite ``fuzz`` (tests/suites/fuzz.py) against the single-process unsliced reference.

    python -m tests.fuzz --seeds 0-40 --world 2          # 41 cases on 2 ranks, one line each and a summary
    python -m tests.fuzz --seeds 7 --world 4 --set packed=false --set clip=false   # shrink one case by hand
    python -m tests.fuzz --case '{"schedule": "gpipe", "packed": true}' --world 2   # plain_case and these keys

A case's outcome is ``pass`` (every rank within tolerance), ``refused`` (a ValueError or TypeError on every rank,
peers of the raising rank stopped by it; the message is printed: it must name the rule, the value and the fix) or
``FAIL`` (a finding: a wrong loss, gradient, parameter or evaluation, an untrained parameter, ranks that disagree,
another exception, a crash or a hang). Cases run a few per launch (``--per-launch``); a launch that dies on a case
records that case as FAIL and starts again with the next one. Each case is drawn from ``random.Random(f"{seed}
w{world}")`` alone, so ``--seeds 17 --world 4`` redraws exactly the case that ``--seeds 0-40 --world 4`` ran as
``s17w4``. Standard library only in this process; the ranks import torch and DeepSpeed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from ds_terapipe.planner.registry import get_schedule, schedule_names
from tests.dist_harness import run_ranks, suite_command

SEQ_LEN = 48
FP32_TOL = 1e-5
#: half precision, as tests/precision.py: the losses, the master weights' change over the steps (fp16 as bf16: with
#: gradient clipping the fp16 updates of the LayerNorm weights, the smallest, are off by up to 1.3e-2 on one stage
#: without slices too); the evaluation after the steps runs in half precision against the fp32 reference
HALF_LOSS_TOL, UPDATE_TOL, HALF_EVAL_TOL = 1e-4, {"bf16": 5e-2, "fp16": 5e-2}, 1e-2
#: the master weights' change under Adam or AdamW in half precision: Adam divides each element's step by the running
#: RMS of its gradient, so an element whose gradient is near the precision's rounding (a bias, a LayerNorm weight)
#: takes a step of another size; the same cases unsliced (slices 1, one stage too) are off by up to 1.9e-1
ADAM_HALF_UPDATE_TOL = 3e-1
#: the copies of a tied weight under fp16 at ZeRO 1 with 3 or more replicas, left in DeepSpeed's order (warned at
#: init): they drift by fp16 rounding (measured: 1.0e-4 after 6 steps at 2 stages x 3 replicas)
FP16_ZERO1_COPIES_TOL = 1e-3
REFUSALS = ("ValueError", "TypeError", "CheckpointError")
V_SHAPED = ("dualpipev", "zbv")


def _composition(rng: random.Random, total: int, parts: int, unit: int) -> list[int]:
    """``parts`` positive multiples of ``unit`` summing to ``total`` (uneven on purpose)."""
    cuts = sorted(rng.sample(range(1, total // unit), parts - 1))
    return [unit * (b - a) for a, b in zip([0, *cuts], [*cuts, total // unit])]


def draw_case(seed: int, world: int) -> dict[str, Any]:
    """One case for ``world`` ranks from ``seed`` alone. Most cases keep the rules the config documents (so they
    train); one in seven draws every feature independently (so the refusals get exercised too)."""
    rng = random.Random(f"{seed}w{world}")
    free = rng.random() < 0.15
    schedule = rng.choice(schedule_names())
    seq = 2 if world % 2 == 0 and rng.random() < 0.2 else 1
    if seq == 2 and world % 4 == 0 and rng.random() < 0.4:
        seq = 4
    stage_choices = [s for s in (1, 2, 4) if (world // seq) % s == 0 and s <= world // seq]
    stages = rng.choices(stage_choices, weights=[1 if s == 1 else 4 for s in stage_choices])[0]
    if not free and get_schedule(schedule).virtual_stages > 1 and stages == 1:
        stages = max(stage_choices)
    dp = world // (stages * seq)
    default_v = get_schedule(schedule).virtual_stages
    v: Optional[int] = None
    if default_v > 1 and schedule not in V_SHAPED and stages <= 2 and rng.random() < 0.3:
        v = 3
    if free and rng.random() < 0.3:
        v = rng.choice([1, 2, 3])
    chunks = stages * (v or default_v)
    layers = max(1, chunks - 2) + rng.randint(0, 2)
    unit = seq
    kind = rng.choices(["int", "list", "auto", "one"], weights=[40, 35, 15, 10])[0]
    granularity = 8 if kind == "auto" else rng.choice([2, 2, 8])
    if not free:   # sequence ranks split each slice: lengths (and the granularity) multiples of their count
        granularity = max(granularity, seq)
    if kind == "int":
        slices: Any = rng.choice([2, 3, 4, 6])
        if not free and (SEQ_LEN // slices) % granularity:
            granularity = max(2, seq)
    elif kind == "list":
        parts, mult = rng.choice([2, 3, 4]), rng.choice([1, 1, 2, 4])
        while SEQ_LEN // (unit * mult) < parts:   # 4 sequence ranks: 48 tokens are 12 units of 4
            mult //= 2
        slices = _composition(rng, SEQ_LEN, parts, unit * mult)
    elif kind == "auto":
        slices = "auto"
    else:
        slices = 1
    shard = dp >= 2 and seq == 1 and rng.random() < 0.3
    vocab_parallel = stages >= 2 and rng.random() < 0.25 and (free or not shard)
    deferred = rng.choice([None, None, True, False])
    if shard and not free and deferred:
        deferred = None
    freeze = rng.randint(1, layers + 1) if rng.random() < 0.2 and (free or not shard) else None
    lengths = None
    if rng.random() < 0.2:
        lengths = [rng.choice([16, 32, 48, 64]) for _ in range(3)]
        lengths[rng.randrange(3)] = SEQ_LEN
    packed = rng.random() < 0.25
    more = {"model": "llama" if rng.random() < 0.12 and (free or seq < 4) else "gpt",   # 2 KV heads
            "resume": rng.random() < 0.15, "repack": bool(freeze) and stages >= 2 and rng.random() < 0.4,
            "release": rng.choice([None, "step"]) if shard else None,
            "prefetch": False if shard and rng.random() < 0.3 else None,
            "fuse": False if rng.random() < 0.1 else None,
            "per_batch": True if packed and kind == "auto" and rng.random() < 0.5 else None,
            "freeze_at": rng.choice([0, 1]) if freeze else None, "wd": 0.01 if rng.random() < 0.2 else None}
    case = {
        "id": f"s{seed}w{world}", "seed": seed, "world": world, "stages": stages, "seq": seq,
        "schedule": schedule, "v": v, "layers": layers, "vocab": rng.choice([64, 64, 63]),
        "tied": rng.random() < 0.7, "slices": slices, "granularity": granularity,
        "micro": rng.choice([1, 2, 3, 4]) if free or schedule not in V_SHAPED else rng.choice([2, 4]),
        "deferred": deferred, "ckpt": rng.choices([0, 1, 2], weights=[6, 3, 1])[0],
        "zero": 1 if rng.random() < 0.25 and (free or not shard) else 0,
        "precision": rng.choices(["fp32", "bf16", "fp16"], weights=[12, 5, 3])[0],
        "vocab_parallel": vocab_parallel, "packed": packed, "lengths": lengths,
        "ignored": rng.random() < 0.3, "clip": rng.random() < 0.25, "shard": shard, "freeze": freeze,
        "eval": rng.random() < 0.6, "free": free, **more,
    }
    return _draw_training(rng, case)


def _draw_training(rng: random.Random, case: dict[str, Any]) -> dict[str, Any]:
    """The training loop's features of a drawn case: steps, optimizer, fp16's dynamic loss scale and a step that
    overflows, the ``auto`` freeze policy, online re-planning. Valid combinations unless the case is ``free``:
    the auto policy decides from the second check on (3 steps at least: two checks, then a step frozen), a
    re-plan switches before the last step, an overflow is a marked micro-batch that ``poisoned_loss`` multiplies
    (not with vocabulary parallelism, whose sharded loss is ``causal_lm_loss`` itself, nor with ignored labels,
    whose first 8 positions of a row look like the mark to a slice of 8 tokens)."""
    free = case["free"]
    steps = rng.choices([2, 3, 4, 6], weights=[5, 3, 2, 1])[0]
    optimizer = rng.choices(["sgd", "adam", "adamw"], weights=[6, 2, 2])[0]
    auto = None
    if not case["freeze"] and rng.random() < 0.15 and (free or not (case["shard"] or case.get("per_batch"))):
        auto = {"check_interval": 1, "warmup_steps": rng.choice([0, 0, 1]),
                "tolerance": rng.choice([1e-6, 0.05, 0.3, 1e6]), "aggressiveness": rng.choice([0.3, 0.5, 1.0])}
        if rng.random() < 0.3:
            auto["max_frozen_layers"] = rng.randint(1, case["layers"] + 1)
        steps = max(steps, auto["warmup_steps"] + 3)
        case["repack"] = case["stages"] >= 2 and rng.random() < 0.4
    replan = None
    if case["slices"] == "auto" and (free or not case.get("per_batch")) and rng.random() < 0.5:
        replan = {"warmup_steps": rng.choice([0, 1]), "measure_steps": 1, "min_gain": rng.choice([0.0, 0.0, 1.0])}
        steps = max(steps, replan["warmup_steps"] + 2)
    scale, overflow = None, None
    if case["precision"] == "fp16" and rng.random() < 0.7:   # scales at which no clean step of these models overflows
        scale = {"initial_scale_power": rng.choice([8, 12]), "loss_scale_window": rng.choice([1, 2, 1000]),
                 "hysteresis": rng.choice([1, 2])}
        if rng.random() < 0.5 and not case["ignored"] and (free or not case["vocab_parallel"]):
            overflow = rng.randrange(steps)
    if not free and case["micro"] % case["stages"]:   # a repack splits each step's micro-batches over its replicas
        case["repack"] = False
    return {**case, "steps": steps, "optimizer": optimizer, "auto_freeze": auto, "replan": replan,
            "scale": scale, "overflow": overflow}


def plain_case(case_id: str, **features: Any) -> dict[str, Any]:
    """A case written out by hand: 2 stages of a 2-block GPT, 1f1b, slices [8, 24, 16], 2 micro-batches, 2 SGD
    steps, fp32, ZeRO 0, every other feature off, with ``features`` on top."""
    base = {"id": case_id, "seed": 0, "stages": 2, "seq": 1, "schedule": "1f1b", "v": None, "layers": 2,
            "vocab": 64, "tied": True, "slices": [8, 24, 16], "granularity": 2, "micro": 2, "deferred": None,
            "ckpt": 0, "zero": 0, "precision": "fp32", "vocab_parallel": False, "packed": False, "lengths": None,
            "ignored": False, "clip": False, "shard": False, "freeze": None, "eval": False, "steps": 2,
            "optimizer": "sgd"}
    return {**base, **features}


def describe(case: dict) -> str:
    """A case in one line: the keys that are not at their plain value."""
    keys = ("stages", "seq", "schedule", "v", "layers", "vocab", "tied", "slices", "granularity", "micro",
            "deferred", "ckpt", "zero", "precision", "vocab_parallel", "packed", "lengths", "ignored", "clip",
            "shard", "release", "prefetch", "fuse", "per_batch", "freeze", "freeze_at", "auto_freeze", "repack",
            "replan", "resume", "steps", "optimizer", "scale", "overflow", "wd", "eval", "eval_count", "free")
    always = {"zero", "tied", "freeze_at" if case.get("freeze") else "zero"}
    case = dict(case, freeze_at=1) if case.get("freeze") and case.get("freeze_at") is None else case

    def shown(k: str) -> bool:
        value = case.get(k)
        if k in always or (k in ("prefetch", "fuse") and value is False) or (k == "overflow" and value == 0):
            return True
        return value not in (None, False, 0, {"steps": 2, "optimizer": "sgd"}.get(k))

    model = [f"model={case['model']}"] if case.get("model", "gpt") != "gpt" else []
    return " ".join(model + [f"{k}={json.dumps(case.get(k), separators=(',', ':'))}" for k in keys if shown(k)])


def _copies_left_to_drift(case: dict, world: int) -> bool:
    """fp16 at ZeRO 1 with 3 or more replicas keeps DeepSpeed's order of the tied and data-parallel sums, where a
    tied weight's copies drift apart by rounding (the engine warns at init: runtime/execution/grad_reduction.py)."""
    replicas = world // (case["stages"] * case["seq"])
    return case["precision"] == "fp16" and case["zero"] == 1 and replicas > 2 and not case.get("shard")


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def verdict(case: dict, per_rank: list[Optional[dict]], log_tail: str = "") -> dict[str, Any]:
    """The outcome of one case from every rank's line (None: the rank never finished it)."""
    out: dict[str, Any] = {"id": case["id"], "case": case}
    if any(r is None for r in per_rank):
        hung = "WATCHDOG" in log_tail
        unfinished = [rank for rank, r in enumerate(per_rank) if r is None]
        seen = "; ".join(f"rank {rank}: {r['type']} in {r['phase']}: {r['message'][:300]}"
                         for rank, r in enumerate(per_rank) if r is not None and r["status"] == "error")
        return {**out, "outcome": "FAIL", "why": f"{'hang' if hung else 'crash'} of rank(s) {unfinished}",
                "message": (seen + "\n" if seen else "") + log_tail[-3000:]}
    tolerance = per_rank[0].get("auto_tolerance")   # as the ranks ran it, clear of the reference's norm changes
    if tolerance is not None and tolerance != case["auto_freeze"]["tolerance"]:
        out["case"] = dict(case, auto_freeze={**case["auto_freeze"], "tolerance": tolerance})
    errors = [r for r in per_rank if r["status"] == "error"]
    if errors:
        types = {r["type"] for r in errors}
        first = next((r for r in errors if r["type"] in REFUSALS), errors[0])
        out.update(message=first["message"], phase=first["phase"], types=sorted(types),
                   seconds=max(r["seconds"] for r in per_rank))
        peers_stopped = all(r["type"] in REFUSALS or (r["type"] == "PeerFailedError" and first["type"] in REFUSALS)
                            for r in errors)
        if len(errors) == len(per_rank) and peers_stopped and first["phase"] in ("init", "train", "checkpoint"):
            return {**out, "outcome": "refused"}
        why = "ranks disagree" if len(errors) < len(per_rank) else f"{'/'.join(sorted(types))} in {first['phase']}"
        return {**out, "outcome": "FAIL", "why": why, "traceback": first.get("traceback", "")}
    half = case["precision"] != "fp32"
    worst: dict[str, float] = {}
    ref_losses = per_rank[0]["ref_losses"]
    worst["loss"] = max(_rel(a, b) for r in per_rank for a, b in zip(r["losses"], ref_losses) if b is not None)
    for key in ("grad_err", "param_err", "update_err"):
        if key in per_rank[0]:
            worst[key.removesuffix("_err")] = max(r[key] for r in per_rank)
    if case["eval"]:
        worst["eval"] = max(_rel(r["eval"], r["ref_eval"]) for r in per_rank)
    worst["copies"] = max(r.get(k, 0.0) for r in per_rank for k in ("grad_copies_err", "param_copies_err"))
    limits = {"loss": HALF_LOSS_TOL if half else FP32_TOL, "grad": FP32_TOL, "param": FP32_TOL,
              "update": (ADAM_HALF_UPDATE_TOL if half and case.get("optimizer") in ("adam", "adamw") else
                         UPDATE_TOL.get(case["precision"], FP32_TOL)), "eval": HALF_EVAL_TOL if half else FP32_TOL,
              "copies": FP16_ZERO1_COPIES_TOL if _copies_left_to_drift(case, len(per_rank)) else FP32_TOL}
    missing = sorted({n for r in per_rank for n in r.get("missing", []) + r.get("grads_missing", [])})
    # the steps DeepSpeed skipped and the frozen count each step taken trained with, as the reference's
    steps = [f"{key} {r[key]} on rank {rank}, the reference's {r[f'ref_{key}']}" for rank, r in enumerate(per_rank)
             for key in ("skipped", "frozen") if key in r and r[key] != r[f"ref_{key}"]]
    over = {k: v for k, v in worst.items() if not v <= limits[k]}   # not <=: a NaN is over
    out.update(errors=worst, slices=per_rank[0].get("slices"), seconds=max(r["seconds"] for r in per_rank))
    if over or missing or steps:
        where = {k: max(per_rank, key=lambda r: r.get(f"{k}_err", 0.0)).get(f"{k}_worst") for k in over
                 if k in ("grad", "param", "update")}
        if "copies" in over:   # the tensor whose copies (replicas, tied copies) disagree most, and its two ranks
            where["copies"] = max(((r.get(f"{k}_copies_err", 0.0), r.get(f"{k}_copies_worst")) for r in per_rank
                                   for k in ("grad", "param")), key=lambda pair: pair[0])[1]
        return {**out, "outcome": "FAIL", "why": f"off {over} at {where}" + (f"; never compared: {missing}"
                                                                               if missing else "")
                + "".join(f"; {line}" for line in steps[:2]), "losses": per_rank[0]["losses"], "ref_losses": ref_losses}
    return {**out, "outcome": "pass"}


def run_cases(cases: list[dict], world: int, out: Path, *, per_launch: int = 6, case_timeout_s: float = 240,
              echo: bool = True) -> list[dict]:
    """Every case on ``world`` ranks, ``per_launch`` cases per launch; a launch that dies on a case goes on with
    the next case in a new launch. The verdicts, in order."""
    verdicts: list[dict] = []
    todo = list(cases)
    launch = 0
    while todo:
        batch, launch = todo[:per_launch], launch + 1
        where = out / f"launch{launch}"
        where.mkdir(parents=True, exist_ok=True)
        extra = {"cases": batch, "case_timeout_s": case_timeout_s}
        _, texts = run_ranks(suite_command("fuzz", where, extra), world, where,
                             timeout_s=case_timeout_s * len(batch) + 120, forked=True)
        lines = [_read_lines(where / f"fuzz_rank{rank}.jsonl") for rank in range(world)]
        done = 0
        for case in batch:
            per_rank = [lines[rank].get(case["id"]) for rank in range(world)]
            if done and all(r is None for r in per_rank):
                break   # the launch died after the previous case (in its barrier): run this one in a new launch
            if any(r is None or r["status"] == "started" for r in per_rank):
                per_rank = [None if r is None or r["status"] == "started" else r for r in per_rank]
                timeouts = [line for text in texts for line in text.splitlines() if line.startswith("WATCHDOG")]
                tail = "\n".join(timeouts + [f"--- rank {rank}:\n" + "\n".join(text.splitlines()[-25:])
                                             for rank, text in enumerate(texts)])
                verdicts.append(verdict(case, per_rank, tail))
                done += 1
                if echo:
                    _echo(verdicts[-1])
                break
            verdicts.append(verdict(case, per_rank))
            done += 1
            if echo:
                _echo(verdicts[-1])
        todo = todo[done:]
    return verdicts


def _read_lines(path: Path) -> dict[str, dict]:
    """A rank's last line per case: its result, or ``"started"`` for a case it never finished."""
    if not path.exists():
        return {}
    return {r["id"]: r for r in map(json.loads, path.read_text().splitlines())}


def _echo(v: dict) -> None:
    errs = " ".join(f"{k}={e:.1e}" for k, e in v.get("errors", {}).items())
    line = f"{v['id']:>8} {v['outcome']:<7} {errs:<52} {describe(v['case'])}"
    if v["outcome"] != "pass":
        line += f"\n{'':>9}{v.get('why', v.get('phase', ''))}: {(v.get('message') or '')[:600]}"
    print(line, flush=True)


def _seeds(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-9", help="seeds: 0-40, 3,7,9 or 5 (default 0-9)")
    parser.add_argument("--world", default="2", help="ranks per launch; several, comma-separated: 2,4")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a key of every drawn case (JSON value): shrink a finding by hand")
    parser.add_argument("--case", help="run this case instead of drawing: a JSON dict of the keys that differ from "
                        "plain_case's (2 stages, 1f1b, slices [8, 24, 16], 2 micro-batches, fp32, nothing else on)")
    parser.add_argument("--per-launch", type=int, default=6, help="cases per launch of the ranks (default 6)")
    parser.add_argument("--case-timeout", type=float, default=240, help="seconds before a case counts as hung")
    parser.add_argument("--out", help="directory for logs and verdicts.json (default: a new temporary one)")
    args = parser.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="fuzz_"))
    overrides = dict((k, _value(v)) for k, _, v in (s.partition("=") for s in args.set))
    verdicts: list[dict] = []
    started = time.monotonic()
    for world in map(int, args.world.split(",")):
        cases = ([plain_case("case", **json.loads(args.case))] if args.case
                 else [draw_case(s, world) for s in _seeds(args.seeds)])
        cases = [dict(c, **overrides) for c in cases]
        print(f"== world {world}: {len(cases)} case(s), logs under {out / f'world{world}'}", flush=True)
        verdicts += run_cases(cases, world, out / f"world{world}", per_launch=args.per_launch,
                              case_timeout_s=args.case_timeout)
    (out / "verdicts.json").write_text(json.dumps(verdicts, indent=1))
    counts = {k: sum(v["outcome"] == k for v in verdicts) for k in ("pass", "refused", "FAIL")}
    print(f"== {len(verdicts)} case(s) in {time.monotonic() - started:.0f}s: {counts}; verdicts in "
          f"{out / 'verdicts.json'}")
    for v in verdicts:
        if v["outcome"] == "FAIL":
            print(f"FAIL {v['id']}: {v.get('why')} -- {describe(v['case'])}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())

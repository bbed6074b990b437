"""Token pipeline vs stock DeepSpeed pipeline on CPU: step time, bubble-free bound, planner error, activation memory.

    python benchmarks/pipeline_speedup.py --quick                       # 1-2 minute smoke run
    python benchmarks/pipeline_speedup.py                               # the full table (the committed run, 2 variants
                                                                        # more: 39 min on 2 cores)
    python benchmarks/pipeline_speedup.py --plots docs                  # + timelines

Two stages, one process per stage with ONE thread each (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``),
gloo, the reference GPT (``ds_terapipe.models.gpt``, blocks split evenly over the stages), micro-batch size 1.
For every m (gradient_accumulation_steps) the worker builds each variant's engine once:

* ``stock``:      ``deepspeed.initialize`` with the same ``TokenPipelineModule`` (DeepSpeed's ``TrainSchedule``, 1F1B);
* ``slices=1``:   ``ds_terapipe.initialize`` with ``"slices": 1`` (token 1f1b over whole sequences: must equal stock);
* ``auto/gpipe``, ``auto/1f1b``: ``"slices": "auto"`` (profiled at init, planned on rank 0, broadcast);

then runs ``--warmup`` + ``--steps`` rounds, each round one ``train_batch`` of every variant (order rotated per
round), so slow phases of a noisy machine hit every variant alike. Per step and rank the worker records every
pipeline instruction's start/end (the engine's instruction map is wrapped on the instance, the same span that
``engine.record_timeline`` times), so each step yields: step time (barrier to end of ``train_batch``, max over
ranks), each stage's busy time (sum of its forward + backward instructions), the pipeline span and the time in
receives, sends and the optimizer tail. Reported per row (medians over the measured rounds):

* ``step ms``: median step time; ``speedup``: median over rounds of stock step / variant step (paired);
* ``bound ms``: the bubble-free bound, the slowest stage's busy time; ``eff``: bound / step;
* ``pred ms``, ``err``: the planner's ``slicing_plan.predicted_ms`` and (pred - measured) / measured;
* ``re-prof ms``, ``re-prof err``: the same plan predicted again from costs profiled right after the timed rounds
  (``ds_terapipe.runtime.planning.profile.measure_costs``, the engine's own profiler): on this shared host the same work
  runs 10-20% slower or faster minutes apart, so ``pred err`` mixes the host's drift since init with the cost
  model's and simulator's error, and ``re-prof err`` is mostly the latter;
* ``peak MiB``: everything one more untimed step allocates above what the process held when it began (parameter
  gradients, backward temporaries, communication buffers included), from glibc's ``mallinfo2`` after every aten op
  (:class:`HeapMeter`); the peak a stage's device must fit;
* activation memory per stage, from one extra (untimed) step under ``torch.autograd.graph.saved_tensors_hooks``:
  peak bytes of storages saved for backward and still alive (deduplicated by storage, parameters excluded; a
  ``weakref.finalize`` on the packed handle drops a storage when autograd frees its last saved reference) plus
  the KV cache buffers (``engine._states[*].nbytes()``, sampled at every pack and after every instruction).

The parent launches the workers (``ds_terapipe.runtime.execution.local_launch``: a free port, the
RANK/WORLD_SIZE/MASTER_PORT
environment), prints the tables and the targets, writes the report (``--json``, default
``benchmarks/results/pipeline_speedup.json``), and with ``--plots DIR`` the measured timeline of the median step of
``--timeline`` (merged Chrome trace + PNG) beside the planner's simulated timeline of the same plan.
"""
from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.alternate import alternate, median, median_index, paired_ratios, rounds_in_use
from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.meters import ActivationMeter, CpuMeter, HeapMeter, InstructionRecorder, compute_events, step_summary
from benchlib.peers import PEER_VARIANTS, build_peer, peer_applies
from benchlib.tables import (ROOT, benchmark_parser, chosen_variants, fmt, machine_info, markdown_table,
                            print_checks, results_path, write_report)

NAME = "pipeline_speedup"   # its report: benchmarks/results/pipeline_speedup.json
NUM_STAGES = 2

#: variant name -> terapipe section (None: stock DeepSpeed); the first variant is the baseline.
VARIANTS: dict[str, dict | None] = {
    "stock": None,
    "slices=1": {"slices": 1, "schedule": "1f1b"},
    "auto/gpipe": {"slices": "auto", "schedule": "gpipe"},   # defaults: deferred weight gradients (a W per
    "auto/1f1b": {"slices": "auto", "schedule": "1f1b"},     # micro-batch) with gpipe, none with 1f1b
}
#: more variants for --variants (not run by default)
OPTIONAL_VARIANTS: dict[str, dict] = {
    "auto/gpipe-noW": {"slices": "auto", "schedule": "gpipe", "deferred_weight_grads": False},
    "auto/1f1b+W": {"slices": "auto", "schedule": "1f1b", "deferred_weight_grads": True},   # a W per slice
    "slices=1+W": {"slices": 1, "schedule": "1f1b", "deferred_weight_grads": True},
}
KNOWN_VARIANTS = {**VARIANTS, **OPTIONAL_VARIANTS, **{name: None for name in PEER_VARIANTS}}   # + peers (no section)


# ================================================================================================================
# Worker (one per stage)
# ================================================================================================================
def _build_engine(variant: str, m: int, cfg: Any, opts: dict, out_dir: Path) -> tuple[Any, float]:
    """One engine of ``variant`` for m micro-batches of 1 sequence; returns it and its build seconds."""
    import deepspeed
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
                              "train_batch_size": m, "steps_per_print": 10**9, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": 0}}
    section = {**KNOWN_VARIANTS, **opts.get("extra_variants", {})}[variant]
    if section is not None:
        config["terapipe"] = {"p2p_timeout_s": 900.0, **section, "enabled": True, "seq_len": opts["seq_len"],
                              "plan_cache": str(_plan_dir(out_dir, m, variant))}
        if opts.get("profile") and section.get("slices", "auto") == "auto":
            config["terapipe"]["profile"] = opts["profile"]
    if variant in PEER_VARIANTS:   # another pipeline engine on the same layers (benchlib/peers.py)
        t0 = time.perf_counter()
        engine = build_peer(variant, gpt_layer_specs(cfg), causal_lm_loss, m, NUM_STAGES, config)
        return engine, time.perf_counter() - t0
    # built from the config, as a user's trainer does: virtual stages cut the model into more chunks
    chunk_kwargs = ds_terapipe.module_chunk_kwargs(ds_terapipe.parse_terapipe_config(config))
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="type:GPTBlock",
                                            **chunk_kwargs)
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    init = ds_terapipe.initialize if section is not None else deepspeed.initialize
    t0 = time.perf_counter()
    engine, _, _, _ = init(model=model, optimizer=opt, config=config)
    return engine, time.perf_counter() - t0


def _plan_dir(out_dir: Path, m: int, variant: str) -> Path:
    return out_dir / "plans" / f"m{m}-{variant.replace('/', '-')}"


def _engine_info(engine: Any, variant: str, m: int, seq_len: int, build_s: float, build_foreign: float,
                 out_dir: Path) -> dict:
    plan = getattr(engine, "slicing_plan", None)
    tp = getattr(engine, "terapipe", None)
    info = {"build_s": build_s, "build_foreign_cores": build_foreign, "stage": engine.stage_id,
            "schedule": tp.schedule if tp is not None else "deepspeed-1f1b",
            "slices": list(getattr(engine, "slices", [seq_len])),
            "plan": plan.to_dict() if plan is not None else None,
            "plan_source": getattr(engine, "plan_source", None),
            "deferred_weight_grads": bool(getattr(tp, "deferred_weight_grads", False)),
            "virtual_stages": int(getattr(tp, "virtual_stages", 1) or 1),
            "layers": [type(f).__name__ for f in engine.module.forward_funcs], "steps": [], "losses": []}
    files = sorted(_plan_dir(out_dir, m, variant).glob("terapipe-plan-*.json")) if plan is not None else []
    if files:  # the profiled cost model (written by rank 0), for the simulated timeline and the per-slice check
        info["cost"] = json.loads(files[0].read_text()).get("cost")
    return info


def _timed_step(engine: Any, rec: InstructionRecorder, batches: list, cpu: CpuMeter | None) -> tuple[dict, float]:
    """One ``train_batch`` after a barrier; its per-rank summary and loss."""
    import torch.distributed as dist

    rec.reset()
    dist.barrier()
    if cpu is not None:
        cpu.foreign_cores()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t_start = time.time() * 1e3
    loss = engine.train_batch(iter(batches))
    t_end = time.time() * 1e3
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    summary = step_summary(rec.records, t_start, t_end, rec.compute_cpu_ms)
    summary["foreign_cores"] = cpu.foreign_cores() if cpu is not None else float("nan")
    # this process (all threads): user/system CPU, minor page faults, involuntary/voluntary context switches
    summary.update(user_ms=(ru1.ru_utime - ru0.ru_utime) * 1e3, sys_ms=(ru1.ru_stime - ru0.ru_stime) * 1e3,
                   minflt=ru1.ru_minflt - ru0.ru_minflt, nivcsw=ru1.ru_nivcsw - ru0.ru_nivcsw,
                   nvcsw=ru1.ru_nvcsw - ru0.ru_nvcsw)
    summary["events"] = compute_events(rec.records, engine.stage_id, t_start, rec.chunks)
    return summary, float(loss)


def _reprofile(engine: Any) -> dict | None:
    """Profile the stages again right after the timed rounds and predict the same plan from those costs.

    The plan's ``predicted_ms`` comes from costs measured at init, minutes before the rounds; on this shared host
    the same work runs up to 20% slower (or faster) minutes later, so its error mixes the model's with the
    host's. Costs measured next to the rounds, fed to the same schedule and simulator, leave the model's.
    """
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate
    from ds_terapipe.runtime.planning.profile import measure_costs

    measured = measure_costs(engine)
    if measured is None:   # not global rank 0
        return None
    cost, _, seconds = measured
    tp = engine.terapipe
    plan = build_schedule(tp.schedule, engine.num_stages, engine.micro_batches, len(engine.slices),
                          tp.deferred_weight_grads, virtual_stages=tp.virtual_stages)
    sim = simulate(plan, cost, list(engine.slices), micro_batch_size=engine.micro_batch_size)
    return {"predicted_ms": float(sim.step_ms), "profile_s": seconds, "cost": cost.to_dict()}


def _measure_memory(engine: Any, rec: InstructionRecorder, batches: list) -> dict:
    """Two untimed steps: peak activation bytes of this stage (saved-tensor hooks), then its peak heap bytes."""
    import torch.distributed as dist

    rec.reset()
    meter = ActivationMeter(engine)
    rec.meter = meter
    dist.barrier()
    with meter:
        engine.train_batch(iter(batches))
    result = {"peak_total_bytes": meter.peak_total, "peak_saved_bytes": meter.peak_saved,
              "peak_kv_bytes": meter.peak_kv, "peak_stash_bytes": meter.peak_stash,
              "left_alive_bytes": meter.saved_bytes}
    del meter
    gc.collect()
    heap = HeapMeter()
    rec.meter = heap
    dist.barrier()
    with heap:
        engine.train_batch(iter(batches))
    rec.meter = None
    result["peak_heap_bytes"] = heap.peak_bytes
    result["peak_heap_at"] = heap.peak_at
    return result


def worker_main(out_dir: Path, opts: dict) -> None:
    """One stage: build every variant's engine per m, alternate their steps, measure memory, write rank{R}.json."""
    rank = int(os.environ["RANK"])
    pin_and_single_thread(rank, opts.get("bind_cores", False))   # before torch starts any thread
    import deepspeed
    import ds_terapipe
    import torch
    import torch.distributed as dist

    from ds_terapipe.models.gpt import GPTConfig

    ds_terapipe.init_distributed(dist_backend="gloo")
    world = dist.get_world_size()
    assert world == NUM_STAGES, f"this benchmark runs {NUM_STAGES} stages, got world size {world}"
    seq_len = opts["seq_len"]
    cfg = GPTConfig(num_layers=opts["layers"], hidden=opts["hidden"], num_heads=opts["heads"],
                    vocab_size=opts["vocab"], max_seq_len=seq_len, seed=1234)
    gen = torch.Generator().manual_seed(7)
    max_m = max(opts["micro_batches"])
    ids = torch.randint(0, cfg.vocab_size, (max_m, 1, seq_len + 1), generator=gen)   # (m, B=1, L+1)
    batches = [(ids[i, :, :-1].contiguous(), ids[i, :, 1:].contiguous()) for i in range(max_m)]
    result: dict[str, Any] = {"rank": rank, "threads": torch.get_num_threads(), "torch": torch.__version__,
                              "deepspeed": deepspeed.__version__, "per_m": {}}
    pids: list[Any] = [None] * world
    dist.all_gather_object(pids, os.getpid())
    cpu = CpuMeter(pids) if rank == 0 and os.path.exists("/proc/stat") else None
    for m in opts["micro_batches"]:
        engines, recorders, info = {}, {}, {}
        for variant in opts["variants"]:
            if not peer_applies(variant, m, NUM_STAGES):
                continue
            # profiling at init (slices "auto") should see a quiet machine too
            if cpu is not None:
                cpu.wait_quiet(opts["quiet_wait"])
            dist.barrier()
            if cpu is not None:
                cpu.foreign_cores()
            engine, build_s = _build_engine(variant, m, cfg, opts, out_dir)
            build_foreign = cpu.foreign_cores() if cpu is not None else float("nan")
            engines[variant] = engine
            recorders[variant] = InstructionRecorder(engine, engine.stage_id)
            info[variant] = _engine_info(engine, variant, m, seq_len, build_s, build_foreign, out_dir)
            print(f"[rank {rank}] m={m} {variant}: built in {build_s:.1f}s (foreign cores {build_foreign:.2f}), "
                  f"slices {info[variant]['slices']}", flush=True)
        def run_step(variant: str, rnd: int | None) -> dict:
            summary, loss = _timed_step(engines[variant], recorders[variant], batches[:m], cpu)
            if rnd is not None:   # a timed round (not warm-up)
                summary["round"] = rnd
                info[variant]["steps"].append(summary)
                info[variant]["losses"].append(loss)
            return summary

        rounds = alternate(list(engines), run_step, warmup=opts["warmup"], steps=opts["steps"],
                           max_rounds=opts["max_rounds"], quiet_wait=opts["quiet_wait"],
                           foreign_max=opts["foreign_max"], cpu=cpu, rank=rank, label=f"m={m}")
        for variant in engines:
            info[variant]["rounds"] = rounds
            if info[variant]["plan_source"] == "profiled":
                info[variant]["reprofiled"] = _reprofile(engines[variant])
            info[variant]["memory"] = _measure_memory(engines[variant], recorders[variant], batches[:m])
        result["per_m"][str(m)] = info
        engines.clear()
        recorders.clear()
        gc.collect()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


# ================================================================================================================
# Parent
# ================================================================================================================
def analyse(ranks: list[dict], opts: dict) -> dict:
    """Combine the ranks' records into rows: per (m, variant) medians, ratios, bound, planner error, memory.

    Statistics use the clean rounds (no foreign load during any step of the round) when there are at least
    ``min(3, steps)`` of them, else every round (the row says which).
    """
    rows = []
    first = str(opts["micro_batches"][0])
    by_stage = sorted(ranks, key=lambda r: r["per_m"][first][opts["variants"][0]]["stage"])
    base = opts["variants"][0]
    keys = ("step_ms", "forward_ms", "backward_ms", "weight_ms", "busy_ms", "recv_ms", "send_ms", "tail_ms", "load_ms",
            "outside_ms", "compute_start_ms", "compute_end_ms", "cpu_share", "user_ms", "sys_ms", "minflt", "nivcsw",
            "nvcsw")
    for m in opts["micro_batches"]:
        infos = [r["per_m"][str(m)] for r in by_stage]   # index = stage
        rounds = infos[0][base]["rounds"]
        num_clean = sum(1 for r in rounds if r["clean"])
        use = rounds_in_use(rounds, opts["steps"])
        # per variant: list over used rounds of per-stage step summaries
        present = [v for v in opts["variants"] if v in infos[0]]   # a peer may not run at this m
        steps = {v: [per_stage for per_stage in zip(*(info[v]["steps"] for info in infos))
                     if per_stage[0]["round"] in use] for v in present}
        step_ms = {v: {ps[0]["round"]: max(s["step_ms"] for s in ps) for ps in steps[v]} for v in present}
        for v in present:
            per_round = steps[v]
            times = [step_ms[v][ps[0]["round"]] for ps in per_round]
            bound = [max(s["busy_ms"] for s in ps) for ps in per_round]
            span = [max(s["compute_end_ms"] for s in ps) - min(s["compute_start_ms"] for s in ps) for ps in per_round]
            eff = [b / t for b, t in zip(bound, times)]
            ratios = paired_ratios(step_ms[base], step_ms[v])
            plan = infos[0][v]["plan"]
            med = median(times)
            again = infos[0][v].get("reprofiled")
            med_i = median_index(times)
            stage_rows = []
            for stage, info in enumerate(infos):
                ss = [ps[stage] for ps in per_round]
                stage_rows.append({k: median([x[k] for x in ss]) for k in keys})
                stage_rows[-1].update(memory=info[v]["memory"], build_s=info[v]["build_s"])
            row = {
                "m": m, "variant": v, "slices": infos[0][v]["slices"], "num_slices": len(infos[0][v]["slices"]),
                "rounds_used": sorted(use), "clean_rounds": num_clean, "all_rounds": len(rounds),
                "step_ms": med, "step_ms_all": times, "step_ms_min": min(times), "step_ms_max": max(times),
                "speedup": median(ratios), "speedup_ratios": ratios, "speedup_of_medians": median(
                    [step_ms[base][ps[0]["round"]] for ps in steps[base]]) / med,
                "bound_ms": median(bound), "efficiency": median(eff), "span_ms": median(span),
                "predicted_ms": plan["predicted_ms"] if plan else None,
                "planner_unsliced_ms": plan["unsliced_ms"] if plan else None,
                "pred_err": (plan["predicted_ms"] - med) / med if plan else None,
                "pred_err_vs_span": (plan["predicted_ms"] - median(span)) / median(span) if plan else None,
                "reprofiled_ms": again["predicted_ms"] if again else None,
                "reprofiled_err": (again["predicted_ms"] - med) / med if again else None,
                "reprofiled_cost": again["cost"] if again else None,
                "plan_source": infos[0][v]["plan_source"], "schedule": infos[0][v]["schedule"],
                "deferred_weight_grads": infos[0][v].get("deferred_weight_grads", False),
                "virtual_stages": infos[0][v].get("virtual_stages", 1),
                "stages": stage_rows,
                "foreign_cores": median([max(s["foreign_cores"] for s in ps) for ps in per_round]),
                "losses": infos[-1][v]["losses"],
                "median_step_events": [e for ev in (ps["events"] for ps in per_round[med_i]) for e in ev],
                "median_step_ms": times[med_i],
                "cost": next((info[v].get("cost") for info in infos if info[v].get("cost")), None),
            }
            row["activation_mib"] = [s["memory"]["peak_total_bytes"] / 2**20 for s in stage_rows]
            row["heap_mib"] = [s["memory"]["peak_heap_bytes"] / 2**20 for s in stage_rows]
            rows.append(row)
    return {"rows": rows}


def print_tables(report: dict, opts: dict) -> str:
    """The main table (one row per m and variant) and the per-stage breakdown, printed and returned as text."""
    rows = report["rows"]
    main_rows = []
    for r in rows:
        n = r["num_slices"]
        err = "-" if r["pred_err"] is None else f"{100 * r['pred_err']:+.1f}%"
        err_r = "-" if r["reprofiled_err"] is None else f"{100 * r['reprofiled_err']:+.1f}%"
        used = len(r["rounds_used"])
        main_rows.append([r["m"], r["variant"], str(n) if n > 1 else "1", f"{r['step_ms']:.0f}",
                          f"{r['speedup']:.2f}x", f"{r['bound_ms']:.0f}", f"{100 * r['efficiency']:.0f}%",
                          fmt(r["predicted_ms"], ".0f"), err, fmt(r["reprofiled_ms"], ".0f"), err_r,
                          "/".join(f"{a:.0f}" for a in r["activation_mib"]),
                          "/".join(f"{a:.0f}" for a in r["heap_mib"]),
                          f"{used}{'' if r['clean_rounds'] >= used else '*'}"])
    out = markdown_table(["m", "variant", "slices", "step ms", "speedup", "bound ms", "eff", "pred ms", "pred err",
                          "re-prof ms", "re-prof err", "act MiB s0/s1", "peak MiB s0/s1", "rounds"], main_rows)
    out.append("")
    out.append("pred: the plan's prediction from costs profiled at init; re-prof: the same plan predicted from costs "
               "profiled again right after the rounds. act: saved for backward + KV buffers; peak: everything the "
               "step allocates (grads, temporaries) above the step's start")
    out.append("rounds: timed rounds in the medians; * = too few clean rounds, noisy rounds included")
    out.append("")
    out.append("Per stage (medians, ms): forward / backward / deferred weight gradients / waiting in recv / send / "
               "grads+optimizer tail / outside instructions; cpu = thread CPU time / wall time inside compute")
    stage_keys = ("forward_ms", "backward_ms", "weight_ms", "recv_ms", "send_ms", "tail_ms", "outside_ms")
    stage_rows = []
    for r in rows:
        cells = ["/".join(f"{s[k]:.0f}" for k in stage_keys) for s in r["stages"]]
        sl = r["slices"] if r["num_slices"] <= 12 else f"{r['slices'][:12]}..."
        cpu = "/".join(f"{s['cpu_share']:.2f}" for s in r["stages"])
        stage_rows.append([r["m"], r["variant"], cells[0], cells[1], cpu, sl if r["num_slices"] > 1 else "-"])
    out += markdown_table(["m", "variant", "stage 0 F/B/W/recv/send/tail/out", "stage 1 F/B/W/recv/send/tail/out",
                           "cpu s0/s1", "planned slices"], stage_rows)
    text = "\n".join(out)
    print(text)
    return text


def _best_token_row(rows: list[dict], m: int) -> dict | None:
    """The fastest ``auto`` variant at ``m`` (the schedule a user would pick), or None."""
    auto = [r for r in rows if r["m"] == m and r["variant"].startswith("auto")]
    return min(auto, key=lambda r: r["step_ms"]) if auto else None


def check_targets(report: dict) -> list[dict]:
    """The targets of docs/performance.md, each with its value and whether it was met (printed too)."""
    rows = report["rows"]
    checks = []
    for r in rows:
        if r["variant"].startswith("auto"):
            if r["m"] == 1:
                checks.append({"target": f"m=1 {r['variant']} speedup >= 1.6x", "value": r["speedup"],
                               "met": r["speedup"] >= 1.6})
            checks.append({"target": f"m={r['m']} {r['variant']} efficiency >= 85%", "value": r["efficiency"],
                           "met": r["efficiency"] >= 0.85})
            checks.append({"target": f"m={r['m']} {r['variant']} |prediction error| <= 10%", "value": r["pred_err"],
                           "met": abs(r["pred_err"]) <= 0.10})
            if r["reprofiled_err"] is not None:
                checks.append({"target": f"m={r['m']} {r['variant']} |prediction error| <= 10%, costs re-profiled "
                               "after the rounds", "value": r["reprofiled_err"],
                               "met": abs(r["reprofiled_err"]) <= 0.10})
        if r["variant"].startswith("auto") and r is _best_token_row(rows, r["m"]):
            # the targets for the best token schedule of the run at each m
            if r["m"] == 1:
                checks.append({"target": f"m=1 best token schedule ({r['variant']}) speedup >= 1.65x",
                               "value": r["speedup"], "met": r["speedup"] >= 1.65})
            checks.append({"target": f"m={r['m']} best token schedule ({r['variant']}) efficiency >= 90%",
                           "value": r["efficiency"], "met": r["efficiency"] >= 0.90})
        if r["variant"] == "slices=1":
            # the engine's own overhead: one slice may not cost more than stock (it may cost less: one replica
            # skips DeepSpeed's identity gradient reduction, runtime/execution/grad_reduction.py
            # _dp_reduce_is_identity)
            checks.append({"target": f"m={r['m']} slices=1 at most 3% slower than stock", "value": r["speedup"],
                           "met": 1.0 / r["speedup"] - 1.0 <= 0.03})
        stock = next((x for x in rows if x["m"] == r["m"] and x["variant"] == "stock"), None)
        if r["variant"] == "auto/1f1b" and stock is not None:
            worst = max(a / s for a, s in zip(r["activation_mib"], stock["activation_mib"]))
            checks.append({"target": f"m={r['m']} auto/1f1b activations <= stock, every stage (worst ratio)",
                           "value": worst, "met": worst <= 1.0})
            peak = max(r["activation_mib"]) / max(stock["activation_mib"])
            checks.append({"target": f"m={r['m']} auto/1f1b activations <= stock, busiest stage (ratio)",
                           "value": peak, "met": peak <= 1.0})
            worst = max(a / s for a, s in zip(r["heap_mib"], stock["heap_mib"]))
            checks.append({"target": f"m={r['m']} auto/1f1b peak step memory <= stock, every stage (worst ratio)",
                           "value": worst, "met": worst <= 1.0})
    print_checks(checks)
    return checks


def write_plots(report: dict, which: tuple[int, str], out_dir: Path, work_dir: Path) -> dict:
    """Measured timeline of the median step (per-rank traces merged) and the planner's simulated one."""
    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.schedule import Action, ActionKind, build_schedule
    from ds_terapipe.planner.simulate import TimedAction, simulate
    from ds_terapipe.trace import events_to_chrome_trace, load_chrome_trace, merge_traces, plot_timeline

    m, variant = which
    row = next(r for r in report["rows"] if r["m"] == m and r["variant"] == variant)
    kinds = {"F": ActionKind.FORWARD, "B": ActionKind.BACKWARD, "W": ActionKind.WEIGHT}
    per_rank = []
    events = [(e + [e[0]])[:7] for e in row["median_step_events"]]   # [rank, kind, mb, slice, t0, t1, chunk]
    for stage in range(NUM_STAGES):
        evs = [TimedAction(s, Action(c, kinds[k], mb, sl), t0, t1) for s, k, mb, sl, t0, t1, c in events
               if s == stage]
        path = work_dir / f"measured-m{m}-{variant.replace('/', '-')}-rank{stage}.json"
        events_to_chrome_trace(evs, path, metadata={"stage": stage, "m": m, "variant": variant,
                                                    "slices": row["slices"]})
        per_rank.append(path)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = f"m{m}-{variant.replace('/', '-')}"
    merged = merge_traces(per_rank, out_dir / f"timeline-measured-{tag}.json")
    measured = load_chrome_trace(merged)
    span = max(e.end_ms for e in measured) - min(e.start_ms for e in measured)
    step = row["median_step_ms"]
    plot_timeline(measured, out_dir / f"timeline-measured-{tag}.png",
                  title=f"measured: {variant}, m={m}, {row['num_slices']} slices; compute span {span:.0f} ms "
                        f"(step {step:.0f} ms incl. optimizer)")
    paths = {"measured_trace": str(merged), "measured_png": str(out_dir / f"timeline-measured-{tag}.png")}
    if row["cost"] is not None:
        cost = PipelineCost.from_dict(row["cost"])   # one cost per chunk
        sched = build_schedule(row["schedule"], NUM_STAGES, m, row["num_slices"],
                               row.get("deferred_weight_grads", False), virtual_stages=row.get("virtual_stages", 1))
        sim = simulate(sched, cost, row["slices"], micro_batch_size=1)
        events_to_chrome_trace(sim.events, out_dir / f"timeline-planned-{tag}.json",
                               metadata={"m": m, "variant": variant, "slices": row["slices"],
                                         "makespan_ms": sim.makespan_ms})
        plot_timeline(sim.events, out_dir / f"timeline-planned-{tag}.png",
                      title=f"planned: {variant}, m={m}, {row['num_slices']} slices; simulated makespan "
                            f"{sim.makespan_ms:.0f} ms")
        paths.update(planned_trace=str(out_dir / f"timeline-planned-{tag}.json"),
                     planned_png=str(out_dir / f"timeline-planned-{tag}.png"))
        # per-slice check of the cost model against the measured actions of the median step
        per_action = []
        lens = row["slices"]
        ctx = [sum(lens[:i]) for i in range(len(lens))]
        for s, k, mb, sl, t0, t1, c in events:
            model = cost.chunk(c)
            w_slices = [lens[sl]] if sched.weights_per_slice else lens   # a W per micro-batch: every slice's
            pred = sum(float(model.weight_ms(n, 1)) for n in w_slices) if k == "W" else \
                float((model.forward_ms if k == "F" else model.backward_ms)(lens[sl], ctx[sl], 1))
            per_action.append({"stage": s, "chunk": c, "kind": k, "microbatch": mb, "slice": sl, "measured_ms": t1 - t0,
                               "predicted_ms": pred})
        paths["per_action"] = per_action
    return paths


def cost_model_check(report: dict) -> list[dict]:
    """For every auto row: the cost model's F/B/W per slice vs the measured medians over all rounds (per stage)."""
    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.registry import get_schedule
    from ds_terapipe.planner.schedule import WEIGHTS_PER_SLICE

    out = []
    for r in report["rows"]:
        if r["cost"] is None:
            continue
        cost = PipelineCost.from_dict(r["cost"])   # one cost per chunk
        v = r.get("virtual_stages", 1)
        placement = get_schedule(r["schedule"]).placement(NUM_STAGES, v)
        lens = r["slices"]
        ctx = [sum(lens[:i]) for i in range(len(lens))]
        for stage in range(NUM_STAGES):
            chunks = [c for c, rank in enumerate(placement) if rank == stage]
            for kind in ("F", "B", "W"):
                if kind == "W":
                    if not r.get("deferred_weight_grads"):
                        continue
                    # every slice's W work: the same total whether W runs per micro-batch or per slice
                    pred = sum(float(cost.chunk(c).weight_ms(n, 1)) for c in chunks for n in lens) * r["m"]
                    actions = r["m"] * len(chunks) * (len(lens) if WEIGHTS_PER_SLICE.get(r["schedule"]) else 1)
                else:
                    pred = sum(float((cost.chunk(c).forward_ms if kind == "F" else cost.chunk(c).backward_ms)(
                        lens[i], ctx[i], 1)) for c in chunks for i in range(len(lens))) * r["m"]
                    actions = len(lens) * r["m"] * len(chunks)
                if cost.step is not None:   # the whole-step model's fixed cost per action, measured at init
                    name = {"F": "forward", "B": "backward", "W": "weight"}[kind]
                    per_chunk = len(lens) if kind != "W" or WEIGHTS_PER_SLICE.get(r["schedule"]) else 1
                    pred += sum(cost.step.action_ms(name, c, cost.num_chunks) for c in chunks) * r["m"] * per_chunk
                meas = r["stages"][stage][{"F": "forward_ms", "B": "backward_ms", "W": "weight_ms"}[kind]]
                out.append({"m": r["m"], "variant": r["variant"], "stage": stage, "kind": kind,
                            "predicted_ms": pred, "measured_ms": meas, "err": (pred - meas) / meas,
                            "per_action_overhead_ms": (meas - pred) / actions})
    return out


def draw_timelines(report: dict, items: list[str], plots_dir: Path, work_dir: Path) -> list[dict]:
    """:func:`write_plots` for each ``"M,VARIANT"`` of ``items`` measured in ``report`` (others are skipped)."""
    out = []
    have = {(r["m"], r["variant"]) for r in report["rows"]}
    for item in items:
        m_str, variant = item.split(",", 1)
        if (int(m_str), variant) not in have:
            print(f"--timeline {item}: not measured in this run, skipped")
            continue
        plots = write_plots(report, (int(m_str), variant), plots_dir, work_dir)
        out.append(plots)
        print(f"timelines: {plots['measured_png']} {plots.get('planned_png', '')}")
    return out


def finish_report(report: dict, opts: dict, ranks: list[dict], started: float, json_path: Path, *,
                  cores_pinned: bool) -> Path:
    """Add the options and wall time, and write the report with the commit and machine it was measured on."""
    wall = time.perf_counter() - started
    report.update(options=opts, wall_s=wall)
    machine = machine_info(torch=ranks[0]["torch"], deepspeed=ranks[0]["deepspeed"],
                           threads_per_rank=ranks[0]["threads"], cores_pinned=cores_pinned)
    print(f"\nwall time {wall:.0f} s")
    path = write_report(report, json_path, machine=machine)
    print(f"report: {path}")
    return path


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = benchmark_parser(__doc__)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8, help="transformer blocks (split evenly over 2 stages)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--micro-batches", type=str, default="1,2,4", help="m values, comma-separated")
    ap.add_argument("--variants", type=str, default=",".join(VARIANTS),
                    help=f"comma-separated, from {', '.join(KNOWN_VARIANTS)} (first: baseline)")
    ap.add_argument("--extra-variant", action="append", default=[], metavar="NAME=JSON",
                    help='another token-pipeline variant: its "terapipe" section, e.g. '
                         '\'fixed8={"slices": 8, "schedule": "gpipe"}\' (repeatable; appended to --variants)')
    ap.add_argument("--profile", metavar="JSON", help='"terapipe.profile" for the auto variants, e.g. '
                    '\'{"repeats": 5}\' (default: the engine\'s defaults)')
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds per m")
    ap.add_argument("--steps", type=int, default=7, help="timed rounds per m (one step of every variant each)")
    ap.add_argument("--max-rounds", type=int, help="timed rounds at most, clean or not (default 2 x --steps)")
    ap.add_argument("--quiet-wait", type=float, default=20.0,
                    help="seconds to wait before each timed round for other processes to go quiet (0: never)")
    ap.add_argument("--foreign-max", type=float, default=0.2,
                    help="a round is clean when other processes used fewer cores than this during each step")
    ap.add_argument("--quick", action="store_true", help="small model and few steps: a 1-2 minute smoke run")
    ap.add_argument("--json", metavar="PATH",
                    help=f"where to write the report as JSON (default: {results_path(NAME).relative_to(ROOT)}; "
                         "with --quick: the --out directory, so a smoke run never replaces the committed results)")
    ap.add_argument("--plots", metavar="DIR", help="write timelines (planned/measured PNG + Chrome traces) to DIR")
    ap.add_argument("--timeline", action="append", metavar="M,VARIANT",
                    help="whose median step --plots draws (repeatable; default 1,auto/gpipe and 4,auto/1f1b)")
    ap.add_argument("--out", metavar="DIR", help="worker logs and raw records (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds before the workers are killed")
    ap.add_argument("--no-bind-cores", dest="bind_cores", action="store_false",
                    help="do not pin each stage's process (all its threads) to its own core (default: pinned, "
                         "like the deepspeed launcher's --bind_cores_to_rank)")
    args = ap.parse_args()
    if args.quick:
        args.seq_len, args.layers, args.hidden, args.heads = 256, 4, 256, 4
        args.micro_batches = "1,2" if args.micro_batches == "1,2,4" else args.micro_batches
        args.warmup, args.steps = 1, 3
    variants = chosen_variants(ap, args.variants, KNOWN_VARIANTS)
    extra: dict[str, dict] = {}
    for item in args.extra_variant:
        name, _, text = item.partition("=")
        try:
            section = json.loads(text)
        except json.JSONDecodeError as err:
            ap.error(f"--extra-variant {item!r}: the part after '=' must be a JSON object ({err})")
        if not name or name in KNOWN_VARIANTS or name in extra or not isinstance(section, dict):
            ap.error(f"--extra-variant {item!r}: use a new NAME and a JSON object, e.g. 'fixed8={{\"slices\": 8}}'")
        extra[name] = section
        variants.append(name)
    opts = {"seq_len": args.seq_len, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "vocab": args.vocab, "micro_batches": [int(x) for x in args.micro_batches.split(",")],
            "variants": variants, "extra_variants": extra,
            "profile": json.loads(args.profile) if args.profile else None, "warmup": args.warmup, "steps": args.steps,
            "max_rounds": args.max_rounds or 2 * args.steps, "quiet_wait": args.quiet_wait,
            "foreign_max": args.foreign_max, "bind_cores": args.bind_cores}
    out_dir = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="pipeline_speedup-"))
    print(f"2 stages x 1 thread, GPT {args.layers} layers, hidden {args.hidden}, {args.heads} heads, vocab "
          f"{args.vocab}, seq_len {args.seq_len}, micro-batch 1, m in {opts['micro_batches']}; "
          f"{args.warmup} warm-up + {args.steps} timed rounds; logs in {out_dir}", flush=True)
    started = time.perf_counter()
    shutil.rmtree(out_dir / "plans", ignore_errors=True)  # profile afresh: a cached plan would skip profiling
    ranks = launch_workers(Path(__file__), NUM_STAGES, out_dir, opts, timeout_s=args.timeout)
    report = analyse(ranks, opts)
    print()
    report["table"] = print_tables(report, opts)
    report["cost_model"] = cost_model_check(report)
    if report["cost_model"]:
        print("\nCost model vs measured (sum over the step's slices, per stage; overhead = per-action ms the "
              "profile does not see):")
        for c in report["cost_model"]:
            print(f"  m={c['m']} {c['variant']:<10} stage {c['stage']} {c['kind']}: predicted {c['predicted_ms']:.0f} "
                  f"measured {c['measured_ms']:.0f} ({100 * c['err']:+.1f}%), overhead "
                  f"{c['per_action_overhead_ms']:+.2f} ms/action")
    print("\nTargets:")
    report["targets"] = check_targets(report)
    if args.plots:
        report["plots"] = draw_timelines(report, args.timeline or ["1,auto/gpipe", "4,auto/1f1b"],
                                         Path(args.plots), out_dir)
    json_path = Path(args.json) if args.json else (out_dir / f"{NAME}.json" if args.quick else results_path(NAME))
    finish_report(report, opts, ranks, started, json_path, cores_pinned=args.bind_cores)
    return 0


if __name__ == "__main__":
    sys.exit(main())

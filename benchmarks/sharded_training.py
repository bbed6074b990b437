"""Sharded data parallelism measured: the token pipeline's looped-bfs with its model states sharded over the replicas,
against the same schedule under ZeRO 1 and against torch pipelining's ScheduleLoopedBFS with FSDP2, side by side.

    python benchmarks/sharded_training.py           # ~6 min; report: benchmarks/results/sharded_training.json
    python benchmarks/sharded_training.py --slices 1 --json benchmarks/results/sharded_training_1slice.json
    python benchmarks/sharded_training.py --quick   # a smaller model, fewer rounds: a smoke run

Four processes, 2 pipeline stages x 2 data-parallel replicas, one thread each; the machine has two cores, so each
stage gets one and its two replicas share it (``--pin stage``: a stage's idle time in the pipeline's bubbles is an
idle core, as on devices). The reference GPT (``--layers`` blocks of ``--hidden``, ``--seq-len`` tokens,
micro-batch 1), m micro-batches per replica, AdamW in every variant. Variants, all from the same weights on the same
batches:

* ``token/zero1``: ``looped-bfs``, 2 chunks per rank, ``--slices`` fixed slices (default 2; with 1 the sharding
  machinery is all that differs from torch's pipeline), ZeRO stage 1 (the optimizer state partitioned,
  parameters and gradients whole on every replica);
* ``token/sharded``: the same with ``terapipe.shard_params`` (each chunk's parameters, gradients and optimizer state
  sharded; gathered per run of the schedule, the next run's gather started early);
* ``token/sharded-no-prefetch``: gathered when each run starts;
* ``token/sharded-step``: ``shard_release: "step"``, each chunk whole from its first run to its last of the step (one
  gather per chunk and step, as torch's pipeline keeps FSDP2 modules);
* ``torch/fsdp2``: ``torch.distributed.pipelining``'s ``ScheduleLoopedBFS`` (2 stages per rank) with FSDP2 per block
  and per stage module, not resharded after forward, as torchtitan arranges it (``benchlib/peers.py``).

Every step of every variant alternates round by round (``benchlib.alternate``); rows report the median step over the
rounds and the median of the per-round ratio to ``token/zero1``. The losses of a round must agree across variants
(the same model, data and optimizer): the run checks it. Model states per rank (parameters, gradients, optimizer
state, as each engine holds them at its optimizer step) are counted per variant, and for the sharded ones the whole
parameters gathered at the step's peak: the token pipeline frees a chunk after each run (a chunk's forward run and
its backward run gather it twice); torch's pipeline keeps every chunk of the stage whole from its first forward to
the step's end (one gather per chunk and step).
"""
from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.alternate import alternate, median, paired_ratios, rounds_in_use
from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.meters import CpuMeter
from benchlib.tables import benchmark_parser, chosen_variants, markdown_table, print_checks, write_ranks_report

NAME = "sharded_training"
STAGES, DP = 2, 2
VARIANTS = ["token/zero1", "token/sharded", "token/sharded-no-prefetch", "token/sharded-step", "torch/fsdp2"]
LR = 1e-4


def _token_engine(variant: str, m: int, cfg: Any, opts: dict) -> Any:
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    sharded = variant != "token/zero1"
    terapipe = {"enabled": True, "seq_len": opts["seq_len"], "slices": opts["slices"], "schedule": "looped-bfs",
                "virtual_stages": 2, "p2p_timeout_s": 900.0, "shard_params": sharded,
                "shard_prefetch": variant != "token/sharded-no-prefetch",
                "shard_release": "step" if variant == "token/sharded-step" else "run"}
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m, "train_batch_size": m * DP,
              "steps_per_print": 10**9, "gradient_clipping": 0.0, "terapipe": terapipe,
              "zero_optimization": {"stage": 0 if sharded else 1}, "zero_allow_untested_optimizer": True}
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="type:GPTBlock",
                                            **ds_terapipe.module_chunk_kwargs(
                                                ds_terapipe.parse_terapipe_config(config)))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    return engine


def _states(engine: Any) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state this rank holds (local shards where sharded)."""
    def local(t: Any) -> Any:
        return t.to_local() if hasattr(t, "to_local") else t

    sharded = getattr(engine, "sharded", None)
    if sharded is not None:
        mem = sharded.memory()
        return {k: mem[k] for k in ("params", "grads", "optimizer", "gathered_peak")}
    params = list(engine.module.parameters())
    out = {"params": sum(local(p).numel() * p.element_size() for p in params),
           "grads": sum(local(p.grad).numel() * p.grad.element_size() for p in params if p.grad is not None)}
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)   # ZeRO 1 wraps the torch optimizer
    out["optimizer"] = sum(local(t).numel() * t.element_size() for st in optimizer.state.values()
                           for t in st.values() if hasattr(t, "dim") and t.dim() > 0)
    if any(hasattr(p, "to_local") for p in params):   # torch's FSDP2 under its pipeline: whole all step
        out["gathered_peak"] = sum(p.numel() * p.element_size() for p in params)
    partitions = getattr(engine.optimizer, "single_partition_of_fp32_groups", None)
    if partitions is not None:   # ZeRO 1's flat fp32 partition (its own master copy)
        out["optimizer"] += sum(t.numel() * t.element_size() for t in partitions)
    for held in (getattr(engine.optimizer, "averaged_gradients", None) or {}).values():   # ZeRO 1's reduced grads
        for t in (held if isinstance(held, (list, tuple)) else [held] if held is not None else []):
            out["grads"] += t.numel() * t.element_size()
    return {k: float(v) for k, v in out.items()}


def _measured_states(engine: Any, batches: list) -> dict[str, float]:
    """Model states at the optimizer step of one more training step (gradients and optimizer state both there)."""
    seen: dict[str, float] = {}
    step = getattr(engine, "_take_model_step", None)
    if step is None:   # torch pipelining: right before its optimizer step
        original = engine.optimizer.step

        def measure(*args: Any, **kwargs: Any) -> Any:
            seen.update(_states(engine))
            return original(*args, **kwargs)

        engine.optimizer.step = measure
        engine.train_batch(iter(batches))
        del engine.optimizer.step
        return seen

    def measure_then_step(*args: Any, **kwargs: Any) -> Any:
        seen.update(_states(engine))
        return step(*args, **kwargs)

    engine._take_model_step = measure_then_step
    engine.train_batch(iter(batches))
    del engine._take_model_step
    return seen


def worker_main(out_dir: Path, opts: dict) -> None:
    rank = int(os.environ["RANK"])
    # one core per pipeline stage (its replicas share it): the pipeline's bubbles are idle cores, as on devices
    pin_and_single_thread(rank // DP if opts["pin"] == "stage" else rank, True)
    import deepspeed
    import ds_terapipe
    import torch
    import torch.distributed as dist

    from benchlib.peers import TorchPipelineEngine
    from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs

    ds_terapipe.init_distributed(dist_backend="gloo")
    assert dist.get_world_size() == STAGES * DP, f"this benchmark runs {STAGES * DP} processes"
    seq_len, m = opts["seq_len"], opts["micro_batches"]
    cfg = GPTConfig(num_layers=opts["layers"], hidden=opts["hidden"], num_heads=opts["heads"],
                    vocab_size=opts["vocab"], max_seq_len=seq_len, seed=1234)
    replica = rank % DP
    gen = torch.Generator().manual_seed(100 + replica)   # each replica its own batches
    ids = torch.randint(0, cfg.vocab_size, (m, 1, seq_len + 1), generator=gen)
    batches = [(ids[i, :, :-1].contiguous(), ids[i, :, 1:].contiguous()) for i in range(m)]
    pids: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(pids, os.getpid())
    cpu = CpuMeter(pids) if rank == 0 and os.path.exists("/proc/stat") else None
    engines: dict[str, Any] = {}
    for variant in opts["variants"]:
        dist.barrier()
        t0 = time.perf_counter()
        if variant == "torch/fsdp2":
            engines[variant] = TorchPipelineEngine(
                "torch-loopedbfs-fsdp2", gpt_layer_specs(cfg), causal_lm_loss, m, STAGES, dp=DP,
                optimizer=lambda params: torch.optim.AdamW(params, lr=LR))
        else:
            engines[variant] = _token_engine(variant, m, cfg, opts)
        print(f"[rank {rank}] {variant}: built in {time.perf_counter() - t0:.1f}s", flush=True)
    steps: dict[str, list[float]] = {v: [] for v in engines}
    losses: dict[str, list[float]] = {v: [] for v in engines}
    gathers: dict[str, int] = {}

    def run_step(variant: str, rnd: int | None) -> dict:
        dist.barrier()
        if cpu is not None:
            cpu.foreign_cores()
        t0 = time.perf_counter()
        loss = float(engines[variant].train_batch(iter(batches)))
        ms = (time.perf_counter() - t0) * 1e3
        if rnd is not None:
            steps[variant].append(ms)
            losses[variant].append(loss)
            sharded = getattr(engines[variant], "sharded", None)
            if sharded is not None:
                gathers[variant] = sharded.gathers
        return {"step_ms": ms, "foreign_cores": cpu.foreign_cores() if cpu is not None else float("nan")}

    rounds = alternate(list(engines), run_step, warmup=opts["warmup"], steps=opts["steps"],
                       max_rounds=opts["max_rounds"], quiet_wait=opts["quiet_wait"],
                       foreign_max=opts["foreign_max"], cpu=cpu, rank=rank, label=f"m={m}")
    states = {}
    for variant, engine in engines.items():
        states[variant] = _measured_states(engine, batches)
        gc.collect()
    result = {"rank": rank, "stage": rank // DP, "replica": replica, "torch": torch.__version__,
              "deepspeed": deepspeed.__version__, "steps": steps, "losses": losses, "rounds": rounds,
              "states": states, "gathers": gathers,
              "slices": list(getattr(engines.get("token/sharded"), "slices", []) or [])}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()


def analyse(ranks: list[dict], opts: dict) -> dict:
    """Per variant: median step (the slowest rank's per round), per-round ratio to token/zero1, states per rank."""
    variants = [v for v in VARIANTS if v in ranks[0]["steps"]]
    used = rounds_in_use(ranks[0]["rounds"], opts["steps"])
    per_round = {v: {i: max(r["steps"][v][i] for r in ranks) for i in range(len(ranks[0]["steps"][v])) if i in used}
                 for v in variants}
    rows = []
    for v in variants:
        # per round, this variant's step over token/zero1's (paired_ratios gives the speedup, baseline / variant)
        ratios = [1 / x for x in paired_ratios(per_round["token/zero1"], per_round[v])] \
            if "token/zero1" in per_round else []
        worst_states = max(sum(x for k, x in r["states"][v].items() if k != "gathered_peak") for r in ranks)
        gathered = max(r["states"][v].get("gathered_peak", 0.0) for r in ranks)
        rows.append({"variant": v, "step_ms": median(per_round[v].values()),
                     "ratio_to_zero1": median(ratios) if ratios else None,
                     "states_bytes_max_rank": worst_states, "gathered_peak_bytes_max_rank": gathered,
                     "states_per_rank": [r["states"][v] for r in ranks],
                     "gathers_per_step": [r["gathers"].get(v) for r in ranks],
                     "losses": ranks[-1]["losses"][v]})
    return {"variants": variants, "rows": rows, "rounds_used": sorted(used)}


def checks(report: dict) -> list[dict]:
    rows = {r["variant"]: r for r in report["rows"]}
    out = []
    base = rows.get("token/zero1")
    for v in ("token/sharded", "token/sharded-no-prefetch", "token/sharded-step", "torch/fsdp2"):
        if v in rows and base is not None:
            worst = max(abs(a - b) / abs(b) for a, b in zip(rows[v]["losses"], base["losses"]))
            out.append({"target": f"{v}: losses agree with token/zero1's round by round (rel diff <= 2e-3)",
                        "met": worst <= 2e-3, "value": worst})
    if "token/sharded" in rows and base is not None:
        ratio = rows["token/sharded"]["ratio_to_zero1"]
        out.append({"target": "sharded looped-bfs within 10% of ZeRO-1 looped-bfs (step ratio <= 1.10)",
                    "met": ratio <= 1.10, "value": ratio})
    for v in ("token/sharded", "token/sharded-step"):
        if v in rows and "torch/fsdp2" in rows:
            ours, theirs = rows[v]["step_ms"], rows["torch/fsdp2"]["step_ms"]
            out.append({"target": f"{v} ahead of torch pipelining + FSDP2 (their step / ours > 1)",
                        "met": ours < theirs, "value": theirs / ours})
    return out


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = benchmark_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a small model and 3 rounds: a smoke run")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--slices", type=int, default=2,
                    help="token slices per micro-batch of the token variants (1: only the sharding differs from torch)")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7, help="timed clean rounds")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--pin", choices=["stage", "rank"], default="stage",
                    help="core per pipeline stage (its replicas share it), or cores round-robin by rank")
    ap.add_argument("--json", default=None, help="where to write the report (default: benchmarks/results/)")
    ap.add_argument("--timeout", type=float, default=3600)
    args = ap.parse_args()
    opts = {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
            "seq_len": args.seq_len, "slices": args.slices, "micro_batches": args.micro_batches,
            "steps": args.steps, "warmup": 1, "pin": args.pin, "max_rounds": 3 * args.steps, "quiet_wait": 20.0,
            "foreign_max": 0.5, "variants": chosen_variants(ap, args.variants, VARIANTS)}
    if args.quick:
        opts.update(layers=4, hidden=128, heads=4, vocab=256, seq_len=128, steps=3, max_rounds=6, quiet_wait=2.0)
    started = time.time()
    work = Path(tempfile.mkdtemp(prefix="ds_terapipe_sharded_"))
    try:
        ranks = launch_workers(Path(__file__), STAGES * DP, work, opts, timeout_s=args.timeout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report = {"benchmark": NAME, "options": opts, **analyse(ranks, opts)}
    header = ["variant", "step ms (median)", "x token/zero1 (median of rounds)", "model states KiB (worst rank)",
              "+ whole parameters gathered at the peak, KiB", "gathers per step (ranks)"]
    table = [[r["variant"], f"{r['step_ms']:.0f}",
              f"{r['ratio_to_zero1']:.3f}" if r["ratio_to_zero1"] is not None else "",
              f"{r['states_bytes_max_rank'] / 1024:.0f}",
              f"{r['gathered_peak_bytes_max_rank'] / 1024:.0f}" if r["gathered_peak_bytes_max_rank"] else "",
              " ".join(str(g) for g in r["gathers_per_step"]) if any(r["gathers_per_step"]) else ""]
             for r in report["rows"]]
    print(f"m = {opts['micro_batches']}, {opts['layers']} x {opts['hidden']}, L = {opts['seq_len']}, "
          f"{STAGES} stages x {DP} replicas")
    print("\n".join(markdown_table(header, table)))
    report["checks"] = checks(report)
    print_checks(report["checks"])
    report["elapsed_s"] = time.time() - started
    if not args.quick or args.json:
        write_ranks_report(report, NAME, args.json, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())

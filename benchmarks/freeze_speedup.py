"""Progressive freezing on CPU: tokens/s of the token pipeline unfrozen, after freezing half the blocks, after
repacking to 1 stage x 2 replicas, and stock DeepSpeed with the same layers frozen.

    flock /tmp/bench.lock python benchmarks/freeze_speedup.py            # 8 blocks, hidden 512, seq 1024, m = 4
    flock /tmp/bench.lock python benchmarks/freeze_speedup.py --quick    # a 1-2 minute smoke run
    flock /tmp/bench.lock python benchmarks/freeze_speedup.py --dtype bf16   # every variant in bf16

Two stages, one process per stage pinned to its own core with one torch thread, gloo, the reference GPT
(``partition_method="type:GPTBlock"``: the embedding and the first half of the blocks on stage 0), micro-batch 1,
m micro-batches. Every variant's engine is built once, then ``--warmup`` + ``--steps`` rounds run one
``train_batch`` of every variant each (order rotated per round, so a noisy phase of the host hits all alike):

* ``token``: ``slices: "auto"``, 1f1b, nothing frozen (the baseline);
* ``token+freeze``: the same with ``freeze: {"schedule": [[0, 1 + layers/2]]}``: the embedding and the first half
  of the blocks are frozen before the first step, stage 0 runs forward only and the slicing is re-planned;
* ``token+repack``: the same freeze with ``"repack": true``: stage 0 holds frozen layers only, so before the first
  step the run continues as 1 stage x 2 data-parallel replicas (``runtime/features/repack.py``), each running the frozen
  prefix forward-only in front of the trained layers on 2 of the 4 micro-batches;
* ``stock+freeze``: ``deepspeed.initialize`` on the same module with ``requires_grad=False`` on those layers'
  parameters (the tied embedding weight trains through the head, as in ``token+freeze``). DeepSpeed still runs
  stage 0's backward: the tied weight needs the gradient of the embedding's use.

Reported: median step time and tokens/s (m x seq_len / step) per variant, and the paired speedups; the run
checks that every token variant's loss equals ``token``'s in the first timed round (they train the same model
from the same weights on the same batch: freezing before the first step changes nothing before it).

``--dtype bf16`` runs every variant, ``stock+freeze`` too, with ``"bf16": {"enabled": true}`` (ZeRO stage 0:
DeepSpeed's ``BF16_Optimizer``) and writes ``benchmarks/results/freeze_speedup_bf16.json``; the variants slice
differently (and stock not at all), which bf16 rounds differently, so their first-round losses are checked to
agree within 2e-2 relative there (1e-5 in fp32). A variant refused at init or whose step fails in bf16 is left
out, under ``failed`` in the report, and the checks that need it are not met.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.alternate import median
from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.tables import ROOT, benchmark_parser, markdown_table, print_checks, results_path, write_report

NAME = "freeze_speedup"
NUM_STAGES = 2
VARIANTS = ("token", "token+freeze", "token+repack", "stock+freeze")
DTYPES = ("fp32", "bf16")
# first-round losses of the variants: equal up to fp32 rounding; bf16 keeps 8 bits of mantissa and the variants'
# slicings round differently
LOSS_RTOL = {"fp32": (1e-5, "1e-5"), "bf16": (2e-2, "2e-2, bf16")}


def _build(variant: str, cfg: Any, opts: dict, num_frozen: int) -> Any:
    import deepspeed
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    torch.manual_seed(1234)
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="type:GPTBlock")
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": opts["m"],
                              "train_batch_size": opts["m"], "steps_per_print": 10**9, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": 0}}
    if opts["dtype"] == "bf16":
        config["bf16"] = {"enabled": True}
    if variant.startswith("token"):
        config["terapipe"] = {"enabled": True, "seq_len": opts["seq_len"], "slices": "auto", "schedule": "1f1b",
                              "p2p_timeout_s": 900.0, "profile": opts["profile"]}
        if variant != "token":
            config["terapipe"]["freeze"] = {"schedule": [[0, num_frozen]], "repack": variant == "token+repack"}
    else:  # stock DeepSpeed, the same layers frozen the usual way
        for idx in range(num_frozen):
            layer = model._modules.get(str(idx))
            if layer is not None:
                layer.requires_grad_(False)
        if "embed" in model.tied_modules and num_frozen > 0:
            model.tied_modules["embed"].wpe.requires_grad_(False)   # wte stays: the head trains it
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    init = ds_terapipe.initialize if variant.startswith("token") else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=config)
    return engine


def worker_main(out_dir: Path, opts: dict) -> None:
    rank = int(os.environ["RANK"])
    pin_and_single_thread(rank, True)
    import ds_terapipe
    import torch
    import torch.distributed as dist

    from ds_terapipe.models.gpt import GPTConfig

    ds_terapipe.init_distributed(dist_backend="gloo")
    seq_len, m = opts["seq_len"], opts["m"]
    cfg = GPTConfig(num_layers=opts["layers"], hidden=opts["hidden"], num_heads=opts["heads"],
                    vocab_size=opts["vocab"], max_seq_len=seq_len, seed=1234)
    num_frozen = 1 + opts["layers"] // 2   # the embedding and half the blocks
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, cfg.vocab_size, (m, 1, seq_len + 1), generator=gen)
    batches = [(ids[i, :, :-1].contiguous(), ids[i, :, 1:].contiguous()) for i in range(m)]
    engines: dict[str, Any] = {}
    failed: dict[str, str] = {}
    for v in opts["variants"]:
        try:
            engines[v] = _build(v, cfg, opts, num_frozen)
        except ValueError as exc:   # outside fp32: refused at init, on every rank together
            if opts["dtype"] == "fp32":
                raise
            failed[v] = f"refused: {exc}"
            print(f"[rank {rank}] {v}: refused in {opts['dtype']}, left out: {exc}", flush=True)
    times: dict[str, list[float]] = {v: [] for v in opts["variants"]}
    losses: dict[str, list[float]] = {v: [] for v in opts["variants"]}
    info: dict[str, Any] = {v: {"failed": failed[v], "losses": []} for v in failed}
    order = list(engines)
    for rnd in range(opts["warmup"] + opts["steps"]):
        for variant in order[rnd % len(order):] + order[:rnd % len(order)]:
            if variant in failed:
                continue
            engine = engines[variant]
            dist.barrier()
            t0 = time.perf_counter()
            try:
                loss = engine.train_batch(iter(batches))
            except Exception as exc:   # outside fp32: a feature without support for the precision fails its step
                if opts["dtype"] == "fp32":
                    raise
                failed[variant] = f"{type(exc).__name__}: {exc}"
                print(f"[rank {rank}] round {rnd} {variant}: failed in {opts['dtype']}, left out: "
                      f"{failed[variant]}", flush=True)
                continue
            dist.barrier()
            losses[variant].append(float(loss))
            if rnd >= opts["warmup"]:
                times[variant].append((time.perf_counter() - t0) * 1e3)
            if rank == 0:
                print(f"[rank 0] round {rnd} {variant}: {(time.perf_counter() - t0) * 1e3:.0f} ms", flush=True)
    for variant, engine in engines.items():
        if variant in failed:
            info[variant] = {"failed": failed[variant], "losses": losses[variant]}
            continue
        freezer = getattr(engine, "freezer", None)
        info[variant] = {"slices": list(getattr(engine, "slices", [seq_len])),
                         "trainable_params": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
                         "events": freezer.events if freezer is not None else None,
                         "layers": [type(f).__name__ for f in engine.module.forward_funcs],
                         "layout": [engine.num_stages, engine.dp_world_size], "losses": losses[variant]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "times": times, "info": info}))


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = benchmark_parser(__doc__)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--m", type=int, default=4, help="micro-batches per step (micro-batch size 1)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed rounds (one step of every variant each)")
    ap.add_argument("--quick", action="store_true", help="seq 256, hidden 256: a smoke run")
    ap.add_argument("--dtype", choices=DTYPES, default="fp32",
                    help="run every variant in this precision (bf16: DeepSpeed's bf16 section, ZeRO stage 0)")
    ap.add_argument("--json", metavar="PATH", help=f"report path (default {results_path(NAME).relative_to(ROOT)}, "
                                                   f"bf16: {results_path(NAME + '_bf16').relative_to(ROOT)}; "
                                                   "--quick: the --out directory)")
    ap.add_argument("--out", metavar="DIR", help="worker logs (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=1800.0)
    args = ap.parse_args()
    if args.quick:
        args.seq_len, args.hidden, args.heads, args.steps = 256, 256, 4, 2
    out = Path(args.out or tempfile.mkdtemp(prefix="freeze_speedup-"))
    opts = {"seq_len": args.seq_len, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "vocab": args.vocab, "m": args.m, "warmup": args.warmup, "steps": args.steps,
            "variants": list(VARIANTS), "dtype": args.dtype,
            "profile": {"slice_lengths": [s for s in (64, 128, 256, 512, 1024, 2048) if s <= args.seq_len][-4:],
                        "num_contexts": 2, "warmup": 1, "repeats": 3}}
    ranks = launch_workers(Path(__file__), NUM_STAGES, out, opts, timeout_s=args.timeout)
    failed = {v: r["info"][v]["failed"] for r in ranks for v in VARIANTS if "failed" in r["info"][v]}
    ran = [v for v in VARIANTS if v not in failed]   # all of them in fp32 (a failure there ends the run)
    step = {v: [max(r["times"][v][i] for r in ranks) for i in range(args.steps)] for v in ran}
    tokens = args.m * args.seq_len
    med = {v: median(step[v]) for v in ran}
    paired = {(a, b): median([x / y for x, y in zip(step[a], step[b])]) for a in ran for b in ran}
    rows = [[v, f"{med[v]:.0f}", f"{tokens / med[v] * 1e3:,.0f}", f"{paired[('token', v)]:.2f}x",
             ", ".join(str(r["info"][v]["slices"]) for r in ranks[:1]),
             f"{sum(r['info'][v]['trainable_params'] for r in ranks):,}"] for v in ran]
    rows = [row + ["x".join(str(n) for n in ranks[0]["info"][v]["layout"])] for row, v in zip(rows, ran)]
    rows += [[v, "-", "-", "-", f"failed in {args.dtype}: {failed[v][:80]}", "-", "-"] for v in failed]
    table = markdown_table(["variant", "step ms", "tokens/s", "vs token", "slices", "trainable params (all ranks)",
                            "stages x replicas"], rows)
    print("\n".join(table))
    # the same model, weights and batch in every variant's first round (warm-up): the same loss
    nan = float("nan")   # a value with a variant that failed: not measured, not met
    first = {v: ranks[0]["info"][v]["losses"][0] for v in ran}
    agree = max(abs(first[v] - first["token"]) / abs(first["token"]) for v in ran) if "token" in first else nan
    rtol, rtol_text = LOSS_RTOL[args.dtype]
    repack_vs_token = paired.get(("token", "token+repack"), nan)
    repack_vs_stock = paired.get(("stock+freeze", "token+repack"), nan)
    checks = [{"target": "token+repack >= 1.6x token", "value": repack_vs_token, "met": repack_vs_token >= 1.6},
              {"target": "token+repack >= 1.3x stock+freeze", "value": repack_vs_stock, "met": repack_vs_stock >= 1.3},
              {"target": f"first-round losses agree (rel <= {rtol_text})", "value": agree, "met": agree <= rtol}]
    print_checks(checks)
    for v, why in failed.items():
        print(f"  {v} failed in {args.dtype}, left out: {why}")
    report = {"dtype": args.dtype, "opts": opts, "step_ms": step, "median_ms": med, "table": table, "checks": checks,
              "events": {v: ranks[0]["info"][v].get("events") for v in ("token+freeze", "token+repack")},
              "losses": {v: ranks[0]["info"][v]["losses"] for v in VARIANTS}}
    if failed:   # the checks it leaves unmeasured: null in the JSON (NaN is not JSON)
        report["failed"] = failed
        report["checks"] = [dict(c, value=None) if c["value"] != c["value"] else c for c in checks]
    name = NAME if args.dtype == "fp32" else f"{NAME}_{args.dtype}"
    path = Path(args.json) if args.json else (out / f"{name}.json" if args.quick else results_path(name))
    print(f"report: {write_report(report, path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Balanced stages on a vocabulary-heavy GPT (CPU, 2 stages): stock DeepSpeed 1F1B, the token pipeline with the head on
the last stage, with cost-based partitioning, and with vocabulary parallelism, side by side in one run.

    flock /tmp/bench.lock python benchmarks/vocab_parallel.py            # about 10 minutes on 2 cores
    python benchmarks/vocab_parallel.py --micro-batches 1 --steps 1      # a quick look
    flock /tmp/bench.lock python benchmarks/vocab_parallel.py --dtype bf16   # every variant in bf16
    flock /tmp/bench.lock python benchmarks/vocab_parallel.py --untied       # an untied head (own input table)

Two pipeline stages (2 local gloo processes, one thread each, pinned to one core each), the reference GPT
(``ds_terapipe.models.gpt``: 4 blocks, hidden 256, 4 heads, vocab 65536, tied head), sequence 512, micro-batch size
1, AdamW, m micro-batches per step. Variants:

* ``deepspeed <method>``: stock DeepSpeed (``deepspeed.initialize``, its 1F1B ``TrainSchedule``, whole sequences),
  with each of its partition methods ``uniform``, ``parameters``, ``type:GPTBlock``; the table marks the best.
* ``token: head on last stage``: the token pipeline (1F1B, 4 equal slices), blocks split 2 + 2 (``type:GPTBlock``).
* ``token: cost-based partition``: the same with ``partition_method="terapipe"`` (layers profiled at init,
  boundaries and slicing planned together; the engine runs the 4 slices).
* ``token: vocab parallel``: 2 + 2 blocks, ``terapipe.vocab_parallel`` (head and tied input embedding split by
  vocabulary rows over both ranks: passes EF/EB/VF/VB).
* ``token: cost-based partition + VP``: vocabulary parallelism with ``partition_method="terapipe"`` (the layers
  timed as they run under it, every rank's head shard and the links timed, the share charged to every rank).

Variants alternate step by step in rounds (``benchlib/alternate.py``): a round runs one step of each in rotated
order; rank 0 measures foreign CPU load during every step and the statistics use the clean rounds when there are
enough. Per variant and m: the median step time (slowest rank), per stage the busy time (forward, backward, the
vocabulary passes' own compute without their waits in collectives, and the optimizer step) and the imbalance
(max / mean busy over the stages), and per stage the parameter, gradient (at the optimizer step) and optimizer-state
bytes. Writes ``benchmarks/results/vocab_parallel.json`` unless ``--json PATH``.

``--dtype bf16`` runs every variant, the stock ones too, with ``"bf16": {"enabled": true}`` (ZeRO stage 0:
DeepSpeed's ``BF16_Optimizer``, bf16 weights with an fp32 master copy and fp32 gradient buffers) and writes
``benchmarks/results/vocab_parallel_bf16.json``. Its memory columns count what that optimizer holds: grads are the
fp32 gradient buffers (plus any bf16 ``.grad`` still alive at the step), optimizer the AdamW states plus the fp32
master weights. bf16 rounds sliced and unsliced, split and whole heads differently, so the losses of vocabulary
parallelism and of the head on the last stage are checked to agree within 2e-2 relative there. A stage that holds
only a tied copy (its only parameters ``ds_pipe_replicated``, e.g. the tied head alone) cannot step under
BF16_Optimizer: the cost-based partition gives every stage a layer with parameters of its own under bf16, and the
token engine refuses such a layout at init; a stock variant (DeepSpeed's partition methods know nothing of it) with
one is left out, under ``skipped`` in the report.

``--untied`` gives the model an untied head (``nn.Linear(hidden, vocab)`` without bias after the final norm; the
input embedding keeps its own table): the first stage then holds a second V x H table, which vocabulary
parallelism splits too (``module.vocab_embed``). Writes ``benchmarks/results/vocab_parallel_untied.json`` (with
``--dtype bf16``: ``vocab_parallel_untied_bf16.json``).
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.alternate import alternate, median, rounds_in_use
from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.meters import KINDS, CpuMeter, InstructionRecorder
from benchlib.tables import (ROOT, benchmark_parser, chosen_variants, markdown_table, results_path,
                             write_ranks_report)

NAME = "vocab_parallel"
DTYPES = ("fp32", "bf16")
# bf16 keeps 8 bits of mantissa: sliced, split and whole heads round differently
BF16_LOSS_RTOL, BF16_LOSS_RTOL_TEXT = 2e-2, "2e-2"
NUM_STAGES = 2
STOCK = ["deepspeed uniform", "deepspeed parameters", "deepspeed type:GPTBlock"]
HEAD_LAST, COST_BASED, VOCAB = "token: head on last stage", "token: cost-based partition", "token: vocab parallel"
COST_VOCAB = "token: cost-based partition + VP"
VARIANTS = STOCK + [HEAD_LAST, COST_BASED, VOCAB, COST_VOCAB]
# the vocabulary passes: their wall time less their waits in collectives is compute of this stage
VOCAB_PASSES = {"VocabForwardPass", "VocabBackwardPass", "VocabEmbedForwardPass", "VocabEmbedBackwardPass"}
BUSY = set(KINDS) | {"OptimizerStep"}


def _specs(cfg: Any, untied: bool) -> list:
    """The GPT's layer specs; ``untied``: its head a bias-free ``nn.Linear(hidden, vocab)`` of its own, seeded
    (every variant starts from the same weights, whichever rank builds it)."""
    import torch
    from deepspeed.pipe import LayerSpec

    from ds_terapipe.models.gpt import gpt_layer_specs

    class SeededHead(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(cfg.hidden, cfg.vocab_size, bias=False)
            with torch.no_grad():
                self.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(cfg.seed + 1))

    specs = gpt_layer_specs(cfg)
    return specs[:-1] + [LayerSpec(SeededHead)] if untied else specs


def _engine(variant: str, cfg: Any, seq_len: int, micro: int, slices: int, dtype: str, untied: bool = False) -> Any:
    import deepspeed
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss

    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro,
                              "train_batch_size": micro, "steps_per_print": 10**9, "gradient_clipping": 0.0}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    kwargs: dict[str, Any] = {"partition_method": "type:GPTBlock"}
    if variant in STOCK:
        kwargs["partition_method"] = variant.split(" ", 1)[1]
    else:
        config["terapipe"] = {"enabled": True, "seq_len": seq_len, "slices": slices, "schedule": "1f1b",
                              "vocab_parallel": variant in (VOCAB, COST_VOCAB), "p2p_timeout_s": 900.0}
        if variant in (COST_BASED, COST_VOCAB):
            kwargs = ds_terapipe.partition_kwargs(config)
        kwargs.update(ds_terapipe.module_chunk_kwargs(ds_terapipe.parse_terapipe_config(config)))
    model = ds_terapipe.TokenPipelineModule(_specs(cfg, untied), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    init = deepspeed.initialize if variant in STOCK else ds_terapipe.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=config)
    return engine


def _memory(engine: Any, grad_bytes: int) -> dict:
    import torch

    params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    state = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    out = {"param_bytes": params, "grad_bytes": grad_bytes, "optimizer_bytes": state,
           "parts": [int(x) for x in engine.module.parts]}
    master = _bytes(getattr(engine.optimizer, "fp32_groups_flat_partition", None))
    if master is not None:   # DeepSpeed's BF16_Optimizer: its fp32 master weights are optimizer memory too
        out.update(optimizer_state_bytes=state, master_bytes=master, optimizer_bytes=state + master)
    return out


def _norm_over_nothing(engine: Any) -> bool:
    """True when DeepSpeed's BF16_Optimizer on this rank holds only pipeline-replicated parameters (a stage that
    holds nothing but a tied copy, e.g. the tied head alone): its step skips those in the gradient norm, so it
    computes the norm of no tensor and fails (``torch.stack`` of an empty list), whatever the clipping."""
    groups = getattr(engine.optimizer, "bf16_groups", None)
    return groups is not None and all(getattr(p, "ds_pipe_replicated", False) for g in groups for p in g)


def _bytes(tensors: Any) -> int | None:
    """Bytes of a list of tensors, None for None."""
    return None if tensors is None else sum(t.numel() * t.element_size() for t in tensors)


class _Waits:
    """Wall-clock intervals this rank spent waiting in the token pipeline's p2p and collectives."""

    def __init__(self, engine: Any) -> None:
        self.intervals: list[tuple[float, float]] = []
        p2p = getattr(engine, "p2p", None)
        if p2p is not None:
            original = p2p.wait_all

            def timed(works: Any, what: str) -> None:
                t0 = time.time() * 1e3
                try:
                    original(works, what)
                finally:
                    self.intervals.append((t0, time.time() * 1e3))

            p2p.wait_all = timed


def _busy(records: list, waits: list[tuple[float, float]]) -> dict:
    """Busy ms of one step on this rank: compute instructions, the optimizer step, and the vocabulary passes less
    the waits inside them."""
    busy = sum(t1 - t0 for name, _, _, t0, t1 in records if name in BUSY)
    passes = [(t0, t1) for name, _, _, t0, t1 in records if name in VOCAB_PASSES]
    waited = sum(w1 - w0 for w0, w1 in waits if any(t0 <= w0 and w1 <= t1 for t0, t1 in passes))
    vocab = sum(t1 - t0 for t0, t1 in passes) - waited
    optimizer = sum(t1 - t0 for name, _, _, t0, t1 in records if name == "OptimizerStep")
    return {"busy_ms": busy + vocab, "vocab_net_ms": vocab, "vocab_wait_ms": waited, "optimizer_ms": optimizer}


def worker_main(out_dir: Path, opts: dict) -> None:
    rank = int(os.environ["RANK"])
    pin_and_single_thread(rank, True)
    import json

    import deepspeed
    import ds_terapipe
    import torch
    import torch.distributed as dist

    from ds_terapipe.models.gpt import GPTConfig

    ds_terapipe.init_distributed(dist_backend="gloo")
    seq_len = opts["seq_len"]
    cfg = GPTConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=opts["vocab"], max_seq_len=seq_len, seed=1234)
    pids: list[Any] = [None] * NUM_STAGES
    dist.all_gather_object(pids, os.getpid())
    cpu = CpuMeter(pids) if rank == 0 and os.path.exists("/proc/stat") else None
    rows: list[dict] = []
    skipped: list[dict] = []
    for micro in opts["micro_batches"]:
        gen = torch.Generator().manual_seed(7)
        batches = []
        for _ in range(micro):
            ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=gen)
            batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
        engines, recorders, waits, grads, info = {}, {}, {}, {}, {}
        for name in opts["variants"]:
            t0 = time.perf_counter()
            engine = _engine(name, cfg, seq_len, micro, opts["slices"], opts["dtype"], opts.get("untied", False))
            if opts["dtype"] != "fp32" and name in STOCK:   # the token engine refuses such a layout itself
                stuck: list[Any] = [None] * NUM_STAGES
                dist.all_gather_object(stuck, _norm_over_nothing(engine))
                if any(stuck):
                    parts = [int(x) for x in engine.module.parts]
                    skipped.append({"variant": name, "micro_batches": micro, "parts": parts,
                                    "reason": f"stage(s) {[s for s, x in enumerate(stuck) if x]} hold only "
                                              "pipeline-replicated (tied) parameters: DeepSpeed's BF16_Optimizer "
                                              "step would take the gradient norm of no tensor and fail"})
                    print(f"[rank {rank}] m={micro} {name}: parts {parts}, left out: {skipped[-1]['reason']}",
                          flush=True)
                    del engine
                    continue
            engines[name], recorders[name], waits[name] = engine, InstructionRecorder(engine, engine.stage_id), \
                _Waits(engine)
            info[name] = {"build_s": time.perf_counter() - t0, "steps": [], "losses": []}
            grads[name] = _grad_probe(engine)
            print(f"[rank {rank}] m={micro} {name}: built in {info[name]['build_s']:.1f}s, parts "
                  f"{[int(x) for x in engine.module.parts]}", flush=True)

        def run_step(name: str, rnd: int | None) -> dict:
            engine, rec, wait = engines[name], recorders[name], waits[name]
            rec.reset()
            wait.intervals.clear()
            dist.barrier()
            if cpu is not None:
                cpu.foreign_cores()
            t_start = time.time() * 1e3
            loss = float(engine.train_batch(iter(batches)))
            t_end = time.time() * 1e3
            summary = {"step_ms": t_end - t_start, **_busy(rec.records, wait.intervals),
                       "foreign_cores": cpu.foreign_cores() if cpu is not None else float("nan")}
            if rnd is not None:
                info[name]["steps"].append({"round": rnd, **summary})
                info[name]["losses"].append(loss)
            return summary

        rounds = alternate(list(engines), run_step, warmup=1, steps=opts["steps"], max_rounds=opts["max_rounds"],
                           quiet_wait=opts["quiet_wait"], foreign_max=opts["foreign_max"], cpu=cpu, rank=rank,
                           label=f"m={micro}")
        for name, engine in engines.items():
            rows.append({"variant": name, "micro_batches": micro, "stage": engine.stage_id, "rounds": rounds,
                         **info[name], **_memory(engine, grads[name][0])})
        engines.clear()
        recorders.clear()
        gc.collect()
    report = {"rank": rank, "rows": rows, "torch": torch.__version__, "deepspeed": deepspeed.__version__}
    if opts["dtype"] != "fp32":
        report["skipped"] = skipped
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


def _grad_probe(engine: Any) -> list[int]:
    """Bytes of the gradients held at the optimizer step (the last step's), in a one-item list; with DeepSpeed's
    BF16_Optimizer its fp32 gradient buffers count too."""
    seen = [0]
    original = engine._take_model_step

    def probe(*args: Any, **kwargs: Any) -> Any:
        seen[0] = sum(p.grad.numel() * p.grad.element_size() for p in engine.module.parameters()
                      if p.grad is not None)
        seen[0] += _bytes(getattr(engine.optimizer, "fp32_groups_gradients_flat", None)) or 0
        return original(*args, **kwargs)

    engine._take_model_step = probe
    return seen


def analyse(ranks: list[dict], opts: dict) -> tuple[list[str], list[dict], list[dict]]:
    """Per (m, variant): median step (slowest rank) and busy per stage over the rounds in use; memory per stage."""
    by_key: dict = {}
    for r in ranks:
        for row in r["rows"]:
            by_key.setdefault((row["micro_batches"], row["variant"]), {})[row["stage"]] = row
    out, lines, checks = [], [], []
    mib = 2.0 ** 20
    for micro in opts["micro_batches"]:
        entries = {}
        for name in [n for n in opts["variants"] if (micro, n) in by_key]:   # all but those left out
            stages = [by_key[(micro, name)][s] for s in range(NUM_STAGES)]
            use = rounds_in_use(stages[0]["rounds"], opts["steps"])
            per_round = [dict(zip(("s0", "s1"), pair)) for pair in zip(*(s["steps"] for s in stages))]
            per_round = [r for r in per_round if r["s0"]["round"] in use]
            step = median(max(r["s0"]["step_ms"], r["s1"]["step_ms"]) for r in per_round) / 1e3
            busy = [median(r[f"s{s}"]["busy_ms"] for r in per_round) / 1e3 for s in range(NUM_STAGES)]
            entries[name] = {"variant": name, "m": micro, "step_s": step, "busy_s": busy,
                             "imbalance": max(busy) / (sum(busy) / len(busy)),
                             "vocab_net_s": [median(r[f"s{s}"]["vocab_net_ms"] for r in per_round) / 1e3
                                             for s in range(NUM_STAGES)],
                             "vocab_wait_s": [median(r[f"s{s}"]["vocab_wait_ms"] for r in per_round) / 1e3
                                              for s in range(NUM_STAGES)],
                             "optimizer_s": [median(r[f"s{s}"]["optimizer_ms"] for r in per_round) / 1e3
                                             for s in range(NUM_STAGES)],
                             "param_mib": [s["param_bytes"] / mib for s in stages],
                             "grad_mib": [s["grad_bytes"] / mib for s in stages],
                             "optimizer_mib": [s["optimizer_bytes"] / mib for s in stages],
                             "parts": stages[0]["parts"], "losses": stages[-1]["losses"],
                             "rounds_used": len(per_round),
                             "clean_rounds": sum(r["clean"] for r in stages[0]["rounds"])}
        stock_best = min(STOCK, key=lambda n: entries[n]["step_s"]) if all(n in entries for n in STOCK) else None
        base = entries.get(HEAD_LAST)
        for name, e in entries.items():
            e["best_stock"] = name == stock_best
            e["speedup_vs_head_last"] = base["step_s"] / e["step_s"] if base else float("nan")
            e["speedup_vs_best_stock"] = entries[stock_best]["step_s"] / e["step_s"] if stock_best else float("nan")
            label = name + (" (best stock)" if e["best_stock"] else "")
            lines.append([str(micro), label, "-".join(map(str, e["parts"])), f"{e['step_s']:.2f}",
                          f"{e['speedup_vs_head_last']:.2f}x", " / ".join(f"{b:.2f}" for b in e["busy_s"]),
                          f"{e['imbalance']:.2f}",
                          " / ".join(f"{p:.0f}+{g:.0f}+{o:.0f}" for p, g, o in zip(e["param_mib"], e["grad_mib"],
                                                                                   e["optimizer_mib"]))])
            out.append(e)
        if VOCAB in entries and base is not None:
            vp = entries[VOCAB]
            if opts["dtype"] == "bf16":   # bf16 weight, fp32 master copy, two fp32 AdamW states
                head_share = opts["vocab"] * 256 * (2 + 4 + 2 * 4) / mib
            else:
                head_share = opts["vocab"] * 256 * 4 / mib * 3   # weight + two AdamW states, fp32
            fall = (base["param_mib"][-1] + base["optimizer_mib"][-1]) - (vp["param_mib"][-1] + vp["optimizer_mib"][-1])
            floor = (NUM_STAGES - 1) / NUM_STAGES * head_share
            checks.append({"m": micro, "vp_speedup": vp["speedup_vs_head_last"], "vp_speedup_floor": 1.3,
                           "vp_imbalance": vp["imbalance"], "vp_imbalance_floor": 1.10,
                           "last_stage_param_opt_fall_mib": fall, "fall_floor_mib": floor,
                           "max_loss_diff": max(abs(a - b) for a, b in zip(vp["losses"], base["losses"])),
                           "met": {"speedup": vp["speedup_vs_head_last"] >= 1.3, "imbalance": vp["imbalance"] <= 1.10,
                                   "memory": fall >= floor}})
            if opts["dtype"] == "bf16":
                rel = max(abs(a - b) / abs(b) for a, b in zip(vp["losses"], base["losses"]))
                checks[-1].update(max_loss_rel_diff=rel, loss_rel_tol=BF16_LOSS_RTOL,
                                  loss_target=f"losses agree with the head on the last stage (rel <= "
                                              f"{BF16_LOSS_RTOL_TEXT}, bf16)")
                checks[-1]["met"]["losses"] = rel <= BF16_LOSS_RTOL
    header = ["m", "variant", "layers per stage", "step s", "vs head on last", "busy s stage 0 / 1", "imbalance",
              "params+grads+optimizer MiB stage 0 / 1"]
    return markdown_table(header, lines), out, checks


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = benchmark_parser(__doc__)
    ap.add_argument("--micro-batches", default="1,4", help="comma-separated micro-batch counts")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--slices", type=int, default=4, help="slices of the token pipeline variants")
    ap.add_argument("--steps", type=int, default=3, help="clean timed rounds wanted (after one warm-up round)")
    ap.add_argument("--max-rounds", type=int, default=5)
    ap.add_argument("--quiet-wait", type=float, default=10.0, help="seconds to wait for a quiet host per round")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--dtype", choices=DTYPES, default="fp32",
                    help="run every variant in this precision (bf16: DeepSpeed's bf16 section, ZeRO stage 0)")
    ap.add_argument("--json", metavar="PATH", help=f"report path (default {results_path(NAME).relative_to(ROOT)}; "
                                                   f"bf16: {results_path(NAME + '_bf16').relative_to(ROOT)})")
    ap.add_argument("--untied", action="store_true",
                    help="an untied head: the input embedding keeps its own table")
    ap.add_argument("--timeout", type=float, default=3000.0)
    args = ap.parse_args()
    variants = chosen_variants(ap, args.variants, VARIANTS)
    opts = {"micro_batches": [int(x) for x in args.micro_batches.split(",")], "seq_len": args.seq_len,
            "vocab": args.vocab, "slices": args.slices, "steps": args.steps, "max_rounds": args.max_rounds,
            "quiet_wait": args.quiet_wait, "foreign_max": 0.2, "variants": variants, "dtype": args.dtype,
            "untied": args.untied}
    out_dir = Path(tempfile.mkdtemp(prefix="vocab_parallel-"))
    started = time.perf_counter()
    load_before = os.getloadavg()
    ranks = launch_workers(Path(__file__), NUM_STAGES, out_dir, opts, timeout_s=args.timeout)
    load_after = os.getloadavg()
    lines, rows, checks = analyse(ranks, opts)
    print("\n" + "\n".join(lines))
    for check in checks:
        print(f"m={check['m']}: vocab parallel {check['vp_speedup']:.2f}x over the head on the last stage (floor 1.3), "
              f"imbalance {check['vp_imbalance']:.2f} (floor 1.10), last stage params+optimizer "
              f"{-check['last_stage_param_opt_fall_mib']:+.0f} MiB (floor -{check['fall_floor_mib']:.0f}), "
              f"losses agree to {check['max_loss_diff']:.1e}")
        if "losses" in check["met"]:
            print(f"  [{'met ' if check['met']['losses'] else 'MISS'}] {check['loss_target']}: "
                  f"{check['max_loss_rel_diff']:.1e}")
    skipped = ranks[0].get("skipped", [])
    for s in skipped:
        print(f"m={s['micro_batches']}: {s['variant']} left out (parts {s['parts']}): {s['reason']}")
    print(f"load average before {load_before[0]:.2f}, after {load_after[0]:.2f} (1 min)")
    report = {"name": NAME, "dtype": args.dtype, "options": opts, "table": lines, "rows": rows, "checks": checks,
              "ranks": ranks, "load_average": {"before": load_before, "after": load_after},
              "wall_s": time.perf_counter() - started}
    if args.dtype != "fp32":
        report["skipped"] = skipped
    name = NAME + ("_untied" if args.untied else "") + ("" if args.dtype == "fp32" else f"_{args.dtype}")
    write_ranks_report(report, name, args.json, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())

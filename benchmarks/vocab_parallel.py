"""Vocabulary parallelism against the head on the last stage, on a vocabulary-heavy GPT (CPU, 2 stages).

    flock /tmp/bench.lock python benchmarks/vocab_parallel.py        # about 2-3 minutes on 2 cores
    python benchmarks/vocab_parallel.py --micro-batches 1 --steps 2   # a quick look

Two pipeline stages (2 local gloo processes, one thread each, pinned), the reference GPT (``ds_terapipe.models.gpt``:
4 blocks split 2 + 2 with ``partition_method="type:GPTBlock"``, hidden 256, 4 heads, vocab 65536, tied head),
sequence 512 in 4 equal slices, micro-batch size 1, token 1F1B, AdamW. Variants: the token pipeline with the head
on the last stage, and with ``terapipe.vocab_parallel`` (the head split by vocabulary rows over both ranks).
Per variant and number of micro-batches m: median step time over ``--steps`` steps after one warm-up step, and
per stage the parameter and optimizer-state bytes. Variants alternate step by step in one run, so a burst of load
on the shared host hits both. Writes ``benchmarks/results/vocab_parallel.json`` unless ``--json PATH``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.tables import ROOT, machine_info, markdown_table, results_path, write_report

NAME = "vocab_parallel"
NUM_STAGES = 2
VARIANTS = ["head on last stage", "vocab parallel"]


def _engine(cfg: Any, seq_len: int, micro: int, vocab_parallel: bool) -> Any:
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="type:GPTBlock",
                                            vocab_parallel=vocab_parallel)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": micro, "train_batch_size": micro,
              "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "terapipe": {"enabled": True, "seq_len": seq_len, "slices": 4, "schedule": "1f1b",
                           "vocab_parallel": vocab_parallel}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    return engine


def _memory(engine: Any) -> dict:
    import torch

    params = sum(p.numel() * p.element_size() for p in engine.module.parameters())
    state = sum(t.numel() * t.element_size() for s in engine.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t))
    return {"param_bytes": params, "optimizer_bytes": state}


def worker_main(out_dir: Path, opts: dict) -> None:
    rank = int(os.environ["RANK"])
    pin_and_single_thread(rank, True)
    import json

    import deepspeed
    import torch

    from ds_terapipe.models.gpt import GPTConfig

    deepspeed.init_distributed(dist_backend="gloo")
    seq_len = opts["seq_len"]
    cfg = GPTConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=opts["vocab"], max_seq_len=seq_len, seed=1234)
    rows = []
    for micro in opts["micro_batches"]:
        gen = torch.Generator().manual_seed(7)
        batches = []
        for _ in range(micro):
            ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=gen)
            batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
        engines = {name: _engine(cfg, seq_len, micro, name == "vocab parallel") for name in VARIANTS}
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        losses: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for step in range(opts["steps"] + 1):
            for name, engine in engines.items():
                torch.distributed.barrier()
                t0 = time.perf_counter()
                loss = float(engine.train_batch(iter(batches)))
                if step:  # step 0 warms up
                    times[name].append(time.perf_counter() - t0)
                losses[name].append(loss)
        for name, engine in engines.items():
            ordered = sorted(times[name])
            rows.append({"variant": name, "micro_batches": micro, "stage": engine.stage_id,
                         "step_s": ordered[len(ordered) // 2], "all_step_s": times[name], "losses": losses[name],
                         **_memory(engine)})
            print(f"[rank {rank}] m={micro} {name}: step {rows[-1]['step_s']:.2f} s", flush=True)
        del engines
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rows": rows, "torch": torch.__version__,
                                                          "deepspeed": deepspeed.__version__}))


def table(ranks: list[dict]) -> tuple[list[str], list[dict]]:
    by_key: dict = {}
    for r in ranks:
        for row in r["rows"]:
            by_key.setdefault((row["micro_batches"], row["variant"]), {})[row["stage"]] = row
    lines, checks = [], []
    for (micro, variant), stages in by_key.items():
        s0, s1 = stages[0], stages[1]
        step = max(s0["step_s"], s1["step_s"])
        base = by_key[(micro, VARIANTS[0])]
        speedup = max(base[0]["step_s"], base[1]["step_s"]) / step
        mem = [(s["param_bytes"] + s["optimizer_bytes"]) / 2**20 for s in (s0, s1)]
        lines.append([str(micro), variant, f"{step:.2f}", f"{speedup:.2f}x", f"{mem[0]:.0f} / {mem[1]:.0f}"])
        if variant != VARIANTS[0]:
            # the losses of both variants agree step by step (the same model and data)
            checks.append({"m": micro, "max_loss_diff": max(abs(a - b) for a, b in zip(s1["losses"],
                                                                                       base[1]["losses"]))})
    return markdown_table(["m", "variant", "step s", "speedup", "params + optimizer MiB stage 0 / 1"], lines), checks


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batches", default="1,4", help="comma-separated micro-batch counts")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per variant (after one warm-up step)")
    ap.add_argument("--json", metavar="PATH", help=f"report path (default {results_path(NAME).relative_to(ROOT)})")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    opts = {"micro_batches": [int(x) for x in args.micro_batches.split(",")], "seq_len": args.seq_len,
            "vocab": args.vocab, "steps": args.steps}
    out_dir = Path(tempfile.mkdtemp(prefix="vocab_parallel-"))
    started = time.perf_counter()
    ranks = launch_workers(Path(__file__), NUM_STAGES, out_dir, opts, timeout_s=args.timeout)
    lines, checks = table(ranks)
    print("\n" + "\n".join(lines))
    for check in checks:
        print(f"m={check['m']}: largest loss difference between the variants {check['max_loss_diff']:.2e}")
    report = {"name": NAME, "options": opts, "table": lines, "checks": checks, "ranks": ranks,
              "wall_s": time.perf_counter() - started}
    path = write_report(report, Path(args.json) if args.json else results_path(NAME),
                        machine=machine_info(torch=ranks[0]["torch"], deepspeed=ranks[0]["deepspeed"],
                                             threads_per_rank=1, cores_pinned=True))
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

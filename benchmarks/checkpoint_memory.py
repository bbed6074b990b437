"""Peak memory per stage with and without activation checkpointing, sliced and unsliced, at long sequences (CPU).

    python benchmarks/checkpoint_memory.py                  # L = 4096 and 8192, about 2-3 minutes on 2 cores
    python benchmarks/checkpoint_memory.py --seq-lens 1024  # a quick look

Two pipeline stages (2 local gloo processes, one thread each), the reference GPT (``ds_terapipe.models.gpt``:
4 blocks split 2 + 2, hidden 256, 4 heads, vocab 256), micro-batch size 1, one micro-batch per step, token
1F1B (no deferred weight gradients). Variants per sequence length: whole sequences (``slices: 1``) and 8 equal
slices, each with ``activation_checkpoint_interval`` 0 and 1, plus 8 slices checkpointed under gpipe with its
default deferred weight gradients (one W per micro-batch: the recorded Linear inputs and output gradients of
every slice stay alive until then). After one warm-up step, one step is measured with
:class:`benchlib.meters.HeapMeter`: the peak bytes the stage's process allocates during the step above what it
held at the start (activations, KV buffers and their gradients, backward temporaries, parameter gradients),
i.e. what a device would have to fit beside weights and optimizer state. Step times are one step on a shared
host: indicative only. Writes
``benchmarks/results/checkpoint_memory.json`` (with commit and machine) unless ``--json PATH``.
"""
from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.meters import HeapMeter
from benchlib.tables import ROOT, benchmark_parser, markdown_table, results_path, write_ranks_report

NAME = "checkpoint_memory"
NUM_STAGES = 2
#: (label, slices, activation_checkpoint_interval, schedule); gpipe defers weight gradients to one W per micro-batch
VARIANTS = [("unsliced", 1, 0, "1f1b"), ("unsliced + ckpt", 1, 1, "1f1b"), ("8 slices", 8, 0, "1f1b"),
            ("8 slices + ckpt", 8, 1, "1f1b"), ("8 slices + ckpt, gpipe + W", 8, 1, "gpipe")]


def _measure(cfg: Any, seq_len: int, slices: int, interval: int, schedule: str, batch: list) -> dict:
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="type:GPTBlock",
                                            activation_checkpoint_interval=interval)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": 1,
              "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "terapipe": {"enabled": True, "seq_len": seq_len, "slices": slices, "schedule": schedule}}
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                             config=config)
    engine.train_batch(iter(batch))   # warm-up: gradients and optimizer state exist before the measured step
    gc.collect()
    torch.distributed.barrier()
    heap = HeapMeter()
    t0 = time.perf_counter()
    with heap:
        engine.train_batch(iter(batch))
    seconds = time.perf_counter() - t0
    result = {"seq_len": seq_len, "slices": list(engine.slices), "interval": interval, "stage": engine.stage_id,
              "peak_heap_bytes": heap.peak_bytes, "peak_at": heap.peak_at, "step_s": seconds}
    del engine, model, heap
    gc.collect()
    return result


def worker_main(out_dir: Path, opts: dict) -> None:
    rank = int(os.environ["RANK"])
    pin_and_single_thread(rank, True)
    import json

    import deepspeed
    import ds_terapipe
    import torch

    from ds_terapipe.models.gpt import GPTConfig

    ds_terapipe.init_distributed(dist_backend="gloo")
    rows = []
    for seq_len in opts["seq_lens"]:
        cfg = GPTConfig(num_layers=4, hidden=256, num_heads=4, vocab_size=256, max_seq_len=seq_len, seed=1234)
        ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=torch.Generator().manual_seed(7))
        batch = [(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())]
        for label, slices, interval, schedule in VARIANTS:
            row = dict(_measure(cfg, seq_len, slices, interval, schedule, batch), variant=label)
            rows.append(row)
            print(f"[rank {rank}] L={seq_len} {label}: peak {row['peak_heap_bytes'] / 2**20:.0f} MiB, "
                  f"step {row['step_s']:.1f} s", flush=True)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "rows": rows,
                                                          "torch": torch.__version__,
                                                          "deepspeed": deepspeed.__version__}))


def table(ranks: list[dict]) -> list[str]:
    by_key = {}
    for r in ranks:
        for row in r["rows"]:
            by_key.setdefault((row["seq_len"], row["variant"]), {})[row["stage"]] = row
    lines = []
    for (seq_len, variant), stages in by_key.items():
        s0, s1 = stages[0], stages[1]
        lines.append([str(seq_len), variant, str(len(s0["slices"])), str(s0["interval"]),
                      f"{s0['peak_heap_bytes'] / 2**20:.0f} / {s1['peak_heap_bytes'] / 2**20:.0f}",
                      f"{max(s0['step_s'], s1['step_s']):.1f}"])
    return markdown_table(["L", "variant", "slices", "ckpt interval", "peak MiB stage 0 / 1", "step s"], lines)


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = benchmark_parser(__doc__)
    ap.add_argument("--seq-lens", default="4096,8192", help="comma-separated sequence lengths")
    ap.add_argument("--json", metavar="PATH", help=f"report path (default {results_path(NAME).relative_to(ROOT)})")
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    opts = {"seq_lens": [int(x) for x in args.seq_lens.split(",")]}
    out_dir = Path(tempfile.mkdtemp(prefix="checkpoint_memory-"))
    started = time.perf_counter()
    ranks = launch_workers(Path(__file__), NUM_STAGES, out_dir, opts, timeout_s=args.timeout)
    lines = table(ranks)
    print("\n" + "\n".join(lines))
    report = {"name": NAME, "options": opts, "table": lines, "ranks": ranks,
              "wall_s": time.perf_counter() - started}
    write_ranks_report(report, NAME, args.json, ranks)
    return 0


if __name__ == "__main__":
    sys.exit(main())

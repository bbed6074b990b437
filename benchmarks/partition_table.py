"""Balanced stages at scale: simulated step times of GPT-3 13B and 175B with a 50k and a 256k vocabulary, naive
layout vs cost-based partitioning vs vocabulary parallelism (VP).

    python benchmarks/partition_table.py          # the table; report: benchmarks/results/partition_table.json
    python benchmarks/partition_table.py --microbatches 4 16 --device a100

Nothing runs on a device: every row is the event simulator under the analytic roofline cost of the presets
(``planner/presets.py``), with the layers costed one by one (``analytic_layer_costs``: the input embedding with its
dense per-slice gradient, the blocks, the LM head with GEMM + softmax over the vocabulary), token 1F1B, sequences of
2048 tokens, granularity 64. Per model, vocabulary and micro-batch count, three layouts
(``planner.partition.analytic_layouts``), each with the slicing the planner chooses for it:

* naive: blocks split evenly, embedding on the first stage, head on the last (DeepSpeed ``uniform``-like);
* cost-based: layer boundaries and slicing chosen together (``plan_partition``);
* VP: the head split over all ranks (head/p + broadcast of the hidden states, two small all-reduces and a reduce
  of the hidden gradient per slice, over the device preset's link), boundaries balanced around it. VP is charged
  inside each rank's per-slice compute (the balanced ideal of interleaved vocabulary passes), see the module
  docstring of ``planner/partition.py``.

"imbalance" is the max/mean simulated busy time over ranks; speedups are over the naive layout.
"""
from __future__ import annotations

import time
from typing import Any

from benchlib.tables import benchmark_parser, fmt, markdown_table, results_path, write_report

from ds_terapipe.planner.partition import analytic_layouts

NAME = "partition_table"
SEQ_LEN, GRANULARITY, SCHEDULE = 2048, 64, "1f1b"
# (model, pipeline ranks): 13B's 40 blocks on 8 ranks (5 each), 175B's 96 on 16 (6 each)
MODELS = [("gpt3-13b", 8), ("gpt3-175b", 16)]
VOCABS = [50257, 256000]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--device", default="a100")
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--json", default=str(results_path(NAME)), help="where to write the report")
    args = parser.parse_args()
    rows, out = [], []
    for model, ranks in MODELS:
        for vocab in VOCABS:
            for m in args.microbatches:
                t0 = time.perf_counter()
                lay = analytic_layouts(model, args.device, ranks, SEQ_LEN, vocab=vocab, vocab_parallel=True,
                                       num_microbatches=m, granularity=GRANULARITY, schedule=SCHEDULE)
                seconds = time.perf_counter() - t0
                b, vp = lay.balanced, lay.vocab_parallel
                assert vp is not None
                entries: list[tuple[str, Any, Any, Any]] = [
                    ("naive", b.naive_parts, b.naive_plan, b.naive_busy_ms), ("cost-based", b.parts, b.plan, b.busy_ms),
                    ("VP", vp.parts, vp.plan, vp.busy_ms)]
                for label, parts, plan, busy in entries:
                    sizes = [y - x for x, y in zip(parts[:-1], parts[1:])]
                    r = {"model": model, "vocab": vocab, "ranks": ranks, "num_microbatches": m, "layout": label,
                         "step_ms": plan.predicted_ms, "speedup_vs_naive": b.naive_plan.predicted_ms / plan.predicted_ms,
                         "imbalance": max(busy) / (sum(busy) / len(busy)), "busy_ms": list(busy),
                         "num_slices": plan.num_slices, "slices": list(plan.slices), "layers_per_chunk": sizes,
                         "plan_seconds": seconds}
                    out.append(r)
                    rows.append([model, str(vocab), str(m), label, fmt(r["step_ms"], ".4g"),
                                 fmt(r["speedup_vs_naive"], ".3f") + "x", fmt(r["imbalance"], ".3f"),
                                 str(r["num_slices"]), f"{sizes[0]}, {sizes[1]}..{sizes[-2]}, {sizes[-1]}"])
                print(f"{model} vocab {vocab} m={m}: planned in {seconds:.1f} s", flush=True)
    header = ["model", "vocab", "m", "layout", "step ms", "vs naive", "imbalance", "slices",
              "layers/chunk (first, .., last)"]
    print("\n".join(markdown_table(header, rows)))
    path = write_report({"name": NAME, "device": args.device, "seq_len": SEQ_LEN, "granularity": GRANULARITY,
                         "schedule": SCHEDULE, "rows": out}, args.json)
    print(f"report: {path}")


if __name__ == "__main__":
    main()

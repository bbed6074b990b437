"""Sharded data parallelism at Breadth-First Pipeline Parallelism's scale: simulated steps of a 52B GPT on 64 ranks
(8 pipeline stages x 8 data-parallel replicas), per schedule, with model states sharded over the replicas and
replicated under ZeRO 1.

    python benchmarks/sharded_schedules.py     # the table; report: benchmarks/results/sharded_schedules.json

Nothing runs on a device: every row is the event simulator under the analytic A100 roofline
(``planner/presets.py``), 64 blocks of hidden 8192 (12 x 8192^2 x 64 = 51.5B parameters in the blocks), sequences of
2048 tokens in 4 slices of 512, micro-batch 1, m micro-batches per replica (a small batch per GPU: m x 8 sequences
a step), bf16 parameters and gradients, fp32 master copy and Adam moments (12 bytes a parameter), a data-parallel
link of 200 Gbit/s per rank. ``planner/sharding.py`` costs the gathers and reduce-scatters (BFPP's policy: a chunk
gathered once per run of consecutive actions on it, prefetched during the previous run) and states what a rank
holds; "sharded, per step" keeps each chunk whole from its first run to its last (``release="step"``: one gather and
one reduce-scatter per chunk and step, the rank's chunks whole at once). Columns: the step, the gathers per step and
rank, the model states per rank.
"""
from __future__ import annotations

from benchlib.tables import benchmark_parser, markdown_table, results_path, write_report

from ds_terapipe.planner.lowering import lower
from ds_terapipe.planner.presets import analytic_pipeline_cost
from ds_terapipe.planner.roofline import TransformerSpec
from ds_terapipe.planner.sequence import block_params
from ds_terapipe.planner.sharding import estimate_sharding

NAME = "sharded_schedules"
SPEC = TransformerSpec(num_layers=64, hidden=8192, num_heads=64, vocab=51200, seq_len=2048)
RANKS, DP, SLICES, LINK_GBPS = 8, 8, [512] * 4, 200.0
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 4), ("looped-bfs", 2),
             ("looped-bfs", 4)]


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--json", default=str(results_path(NAME)), help="where to write the report")
    args = parser.parse_args()
    rows, out = [], []
    for m in args.microbatches:
        for name, v in SCHEDULES:
            chunks = RANKS * v
            cost = analytic_pipeline_cost(SPEC, "a100", chunks, lm_head=False)
            chunk_params = [block_params(SPEC) * SPEC.num_layers / chunks] * chunks
            schedule = lower(name, RANKS, m, len(SLICES), virtual_stages=v)
            for sharded, release in ((False, "run"), (True, "run"), (True, "step")):
                est = estimate_sharding(schedule, cost, SLICES, chunk_params=chunk_params, dp=DP,
                                        link_gbps=LINK_GBPS, sharded=sharded, release=release)
                tokens = m * DP * sum(SLICES) / (est.step_ms / 1e3)
                out.append({"schedule": name, "virtual_stages": v, "micro_batches": m, **est.to_dict(),
                            "tokens_per_s": tokens})
                mode = ("sharded, per step" if release == "step" else "sharded") if sharded else "ZeRO 1"
                rows.append([str(m), name, str(v), mode, f"{est.step_ms / 1e3:.2f}",
                             f"{est.exposed_ms / 1e3:.2f}", f"{tokens:,.0f}", str(est.gathers_per_step),
                             f"{est.memory_bytes / 2**30:.1f}"])
    header = ["m", "schedule", "v", "data parallelism", "step s", "exposed comm s", "tokens/s (64 ranks)",
              "gathers per step", "model states GiB per rank"]
    print("\n".join(markdown_table(header, rows)))
    best = {}
    for r in out:
        key = (r["micro_batches"], r["sharded"], r["release"])
        if key not in best or r["step_ms"] < best[key]["step_ms"]:
            best[key] = r
    for (m, sharded, release), r in sorted(best.items()):
        mode = (f"sharded (release per {release})" if sharded else "ZeRO 1")
        print(f"m={m} {mode}: fastest {r['schedule']} v={r['virtual_stages']} "
              f"{r['step_ms'] / 1e3:.2f} s, {r['memory_bytes'] / 2**30:.1f} GiB per rank")
    path = write_report({"name": NAME, "model": repr(SPEC), "ranks": RANKS, "dp": DP, "slices": SLICES,
                         "link_gbps": LINK_GBPS, "rows": out}, args.json)
    print(f"report: {path}")


if __name__ == "__main__":
    main()

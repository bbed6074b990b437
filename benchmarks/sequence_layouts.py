"""Long context across ranks: simulated pipeline x sequence x data layouts of a 70B Llama-shaped model at 128K
tokens on 64 ranks, each planned under an 80 GB-per-rank memory cap, the planner's choice first.

    python benchmarks/sequence_layouts.py    # the table; report: benchmarks/results/sequence_layouts.json

Nothing runs on a device: every row is the planner (``planner/sequence.py``) under the analytic H100 roofline
(``planner/presets.py``): 80 blocks of hidden 8192, 64 heads with 8 key/value heads, SwiGLU 28672; sequences of
131072 tokens, micro-batch 1, 2 micro-batches per data replica, token 1F1B on a 1024-token grid, at most 64 slices;
every layer's activations recomputed (activation factor 2); Ulysses all-to-alls inside a stage over 3600 Gbit/s
links (NVLink), bf16 weights and gradients, fp32 Adam state sharded over the data x sequence ranks (ZeRO 1).
Memory per rank: the activations and KV carry of the plan (1/N of them at sequence degree N) plus the model
states. A layout fits when both stay under the cap; the planner slices finer to make it fit when it can.
"""
from __future__ import annotations

from benchlib.tables import benchmark_parser, markdown_table, results_path, write_report

from ds_terapipe.planner.roofline import TransformerSpec
from ds_terapipe.planner.sequence import plan_layouts

NAME = "sequence_layouts"
SPEC = TransformerSpec(num_layers=80, hidden=8192, num_heads=64, vocab=128256, seq_len=131072, ffn_hidden=28672,
                       num_kv_heads=8, block="llama")
WORLD, MICRO_BATCHES, CAP, LINK_GBPS = 64, 2, 80e9, 3600.0


def main() -> None:
    parser = benchmark_parser(__doc__)
    parser.add_argument("--json", default=str(results_path(NAME)), help="where to write the report")
    args = parser.parse_args()
    layouts = plan_layouts(SPEC, "h100", WORLD, micro_batches=MICRO_BATCHES, memory_cap_bytes=CAP,
                           sequence_link_gbps=LINK_GBPS, granularity=1024, max_slices=64, activation_factor=2.0)
    rows = [[f"{e.stages} x {e.sequence} x {e.data}", str(len(e.slices)), f"{e.step_ms / 1e3:.1f}",
             f"{e.tokens_per_s:,.0f}", f"{e.activation_bytes / 1e9:.1f}", f"{e.model_state_bytes / 1e9:.1f}",
             "yes" if e.fits else "no"] for e in layouts]
    header = ["stages x sequence x data", "slices", "step s", "tokens/s (64 ranks)", "activations GB per rank",
              "model states GB per rank", "fits 80 GB"]
    print("\n".join(markdown_table(header, rows)))
    chosen = next((e for e in layouts if e.fits), None)
    if chosen is not None:
        print(f"chosen: {chosen.stages} stages x {chosen.sequence} sequence x {chosen.data} data ranks, "
              f"{len(chosen.slices)} slices, predicted step {chosen.step_ms / 1e3:.1f} s")
    path = write_report({"name": NAME, "model": repr(SPEC), "world": WORLD, "micro_batches": MICRO_BATCHES,
                         "memory_cap_bytes": CAP, "sequence_link_gbps": LINK_GBPS,
                         "layouts": [e.to_dict() for e in layouts],
                         "chosen": None if chosen is None else chosen.to_dict()}, args.json)
    print(f"report: {path}")


if __name__ == "__main__":
    main()

"""Sliding-window attention of one layer, sliced as a stage runs it: query blocks against one band-masked call.

    python benchmarks/window_attention.py                 # L 2048 and 4096, windows 128, 512, 1024; 1 and 4 slices
    python benchmarks/window_attention.py --quick         # L 2048, window 256, a few rounds
    python benchmarks/window_attention.py --json out.json # the report elsewhere (default:
                                                          # benchmarks/results/window_attention.json)

Why: past its first window a windowed slice runs SDPA under an additive band mask (no fused kernel takes a band
without one), which scores every query it is handed against every key it is handed. ``sliced_causal_attention``
cuts such a slice into blocks of ``max(w, WINDOW_QUERY_BLOCK)`` queries, each over the keys of its own window, so a
slice of T tokens scores about ``T * 2w`` pairs instead of ``T * (T + w - 1)``. This script measures what that
buys, one attention of 8 heads of 64 (grouped-query: 2 key/value heads), forward and backward of every slice (later
slices first, as a stage runs them), on one pinned core with one thread:

* ``blocks``: the slice in query blocks (what runs);
* ``one call``: the slice as one band-masked call (blocks as long as the slice), the way ``transformers``' own
  SDPA attention runs a windowed layer (one call under the dense sliding mask) when unsliced;
* ``causal``: the same slicing without a window, for scale (the fused causal paths).

Variants alternate round by round; medians. Beside each: the scores the planner's analytic cost counts for the
slicing (``planner.roofline.computed_pairs``), relative to ``one call``'s.
"""
from __future__ import annotations

import statistics
import time

import torch

from benchlib.launch import pin_one_core
from benchlib.tables import benchmark_parser, machine_info, markdown_table, results_path, write_report

NAME = "window_attention"
VARIANTS = ("blocks", "one call", "causal")
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 64


def _run(variant: str, length: int, window: int, slices: int, seed: int = 0) -> float:
    """Seconds for the forward and backward of every slice of one micro-batch (one attention)."""
    import ds_terapipe.runtime.slicing.attention as attention
    from ds_terapipe import sliced_causal_attention
    from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope

    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, length, HEAD_DIM, generator=gen)
    k, v = (torch.randn(1, KV_HEADS, length, HEAD_DIM, generator=gen) for _ in range(2))
    bounds = [length * i // slices for i in range(slices + 1)]
    state = MicroBatchState(0, length, slices)
    saved = attention.WINDOW_QUERY_BLOCK
    attention.WINDOW_QUERY_BLOCK = length if variant == "one call" else saved
    try:
        t0 = time.perf_counter()
        outs = []
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            piece = [t[:, :, a:b].detach().requires_grad_() for t in (q, k, v)]
            with slice_scope(SliceContext(0, i, a, b, state)):
                outs.append(sliced_causal_attention(*piece, cache_key="attn",
                                                    window=None if variant == "causal" else window))
        for out in reversed(outs):
            out.sum().backward()
        return time.perf_counter() - t0
    finally:
        attention.WINDOW_QUERY_BLOCK = saved


def _scores(length: int, window: int, slices: int, block: int) -> float:
    from ds_terapipe.planner.roofline import computed_pairs

    bounds = [length * i // slices for i in range(slices + 1)]
    return float(sum(computed_pairs(b - a, a, window, block=block) for a, b in zip(bounds, bounds[1:])))


def main() -> None:
    ap = benchmark_parser(__doc__)
    ap.add_argument("--lengths", default="2048,4096", help="sequence lengths (comma-separated)")
    ap.add_argument("--windows", default="128,512,1024", help="sliding windows (comma-separated)")
    ap.add_argument("--slices", default="1,4", help="equal slice counts (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds per case, variants alternated (default 5)")
    ap.add_argument("--quick", action="store_true", help="L 2048, window 256, 1 and 4 slices, 3 rounds")
    ap.add_argument("--json", default=None, help="report path (default: benchmarks/results/window_attention.json)")
    args = ap.parse_args()
    if args.quick:
        args.lengths, args.windows, args.rounds = "2048", "256", 3
    pin_one_core()
    torch.set_num_threads(1)
    from ds_terapipe.runtime.slicing.attention import WINDOW_QUERY_BLOCK

    cases = []
    for length in map(int, args.lengths.split(",")):
        for window in map(int, args.windows.split(",")):
            for slices in map(int, args.slices.split(",")):
                times: dict[str, list[float]] = {v: [] for v in VARIANTS}
                for variant in VARIANTS:   # warm-up round
                    _run(variant, length, window, slices)
                for r in range(args.rounds):
                    for variant in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
                        times[variant].append(_run(variant, length, window, slices, seed=r))
                ms = {v: 1e3 * statistics.median(t) for v, t in times.items()}
                cases.append({"seq_len": length, "window": window, "slices": slices, "ms": ms,
                              "speedup": ms["one call"] / ms["blocks"],
                              "scores_ratio": (_scores(length, window, slices, length)
                                               / _scores(length, window, slices, WINDOW_QUERY_BLOCK)),
                              "rounds": {v: [1e3 * x for x in t] for v, t in times.items()}})
                print(f"L {length} window {window} slices {slices}: blocks {ms['blocks']:.1f} ms, one call "
                      f"{ms['one call']:.1f} ms, causal {ms['causal']:.1f} ms", flush=True)
    rows = [[c["seq_len"], c["window"], c["slices"], *(f"{c['ms'][v]:.1f}" for v in VARIANTS),
             f"{c['speedup']:.2f}x", f"{c['scores_ratio']:.2f}x"] for c in cases]
    print("\n".join(markdown_table(["L", "window", "slices", "blocks ms", "one call ms", "causal ms",
                                    "blocks vs one call", "scores one call / blocks (cost model)"], rows)))
    report = {"name": NAME, "options": vars(args), "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM,
              "window_query_block": WINDOW_QUERY_BLOCK, "cases": cases}
    path = write_report(report, args.json or results_path(NAME), machine=machine_info(threads=1))
    print(f"report: {path}")


if __name__ == "__main__":
    main()

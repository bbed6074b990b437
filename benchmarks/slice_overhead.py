"""What slicing costs one stage: forward, backward and weight-gradient time of a micro-batch cut into n slices.

    python benchmarks/slice_overhead.py                      # GPT 4 x 512 blocks (one stage of the 8 x 512 model)
    python benchmarks/slice_overhead.py --slices 1,2,4,5,8 --profile   # + which ops grow with n
    python benchmarks/slice_overhead.py --json out.json      # the report elsewhere (default:
                                                             # benchmarks/results/slice_overhead.json)

Why: at one micro-batch a token pipeline's speedup over an unsliced pipeline is bounded by
``p x n / (n + p - 1)`` *times* ``t(1) / t(n)``, the unsliced stage's compute over the sliced one's. The
planner sees ``t(n)`` through its profile and picks n accordingly; this script shows the factor on its own, so
the gap between ``benchmarks/pipeline_speedup.py`` and the bubble-free bound can be split into bubble and
per-slice overhead. One process, one core (pinned), the stage's blocks run slice by slice exactly as a stage
runs them (slice context, KV buffers, backwards later slices first), with the weight gradients in the backward
(added into ``.grad`` by autograd, or inside their GEMMs as the engine does where nothing hooks the accumulation)
and deferred (one W per micro-batch, gpipe's default), variants alternated round by round; medians.

Columns: ``F``, ``B`` (input gradients; with the weight gradients too when not deferred), ``W`` (the deferred
pass), ``total``, ``x t(1)`` (total over the unsliced total of the same mode), ``x autograd`` (over the same n with
autograd's accumulation), and ``ceiling``: the m = 1
speedup over an unsliced 2-stage pipeline this overhead leaves with n equal slices,
``2 n / (n + 1) x t(1) / t(n)``. On an accelerator every time is taken after a device synchronise.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from benchlib.launch import pin_one_core
from benchlib.slices import run_variant
from benchlib.tables import machine_info, markdown_table, results_path, write_report

NAME = "slice_overhead"


def _blocks(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from ds_terapipe.models.gpt import GPTBlock, GPTConfig
    cfg = GPTConfig(num_layers=2 * args.layers, hidden=args.hidden, num_heads=args.heads, vocab_size=256,
                    max_seq_len=args.seq_len)
    from ds_terapipe.runtime.slicing.deferred import enable_deferred_weight_grads, enable_fused_grad_accumulation
    blocks = torch.nn.Sequential(*[GPTBlock(cfg, i) for i in range(args.layers)]).to(device)
    enable_deferred_weight_grads(blocks)  # defers only under a slice context with a stash (the "deferred" rows)
    enable_fused_grad_accumulation(blocks)  # adds in the GEMMs only where the state asks (the "in GEMM" rows)
    return blocks


#: how the weight gradients are computed: in the backward, autograd adding each into ``.grad``; in the backward,
#: added into ``.grad`` inside the GEMM (the engine's way without deferral where nothing hooks the accumulation);
#: deferred to one W pass over the micro-batch (gpipe's)
MODES = {"autograd": "unsynced", "in GEMM": "in-gemm", "deferred": "fused"}


def _run(blocks: torch.nn.Module, x0: torch.Tensor, n: int, mode: str) -> tuple[float, float, float]:
    """One micro-batch through the blocks in n equal slices: (F, B, W) milliseconds, device-synchronised."""
    took = run_variant(blocks, x0, n, MODES[mode])
    return took["F"], took["B"], took["W"]


def _op_profile(blocks: torch.nn.Module, x0: torch.Tensor, n: int, top: int) -> dict[str, float]:
    """Self time per op (ms) of one deferred micro-batch in n slices, CPU side."""
    from torch.profiler import ProfilerActivity, profile
    _run(blocks, x0, n, "deferred")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _run(blocks, x0, n, "deferred")
    ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    return dict(sorted(ops.items(), key=lambda kv: -kv[1])[:top])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--slices", default="1,2,4,5,8", help="slice counts, comma-separated (1 is always added)")
    ap.add_argument("--rounds", type=int, default=7, help="rounds after one warm-up round")
    ap.add_argument("--device", default=None, help="default: the DeepSpeed accelerator's device")
    ap.add_argument("--core", type=int, default=None, help="pin to this CPU core (default: the last one)")
    ap.add_argument("--profile", action="store_true", help="also the per-op self time at n = 1 and the largest n")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    pin_one_core(args.core)
    if args.device is None:
        from deepspeed.accelerator import get_accelerator
        args.device = get_accelerator().device_name()
    device = torch.device(args.device)
    counts = sorted({1, *(int(s) for s in args.slices.split(","))})
    blocks = _blocks(args, device)
    x0 = torch.randn(args.batch, args.seq_len, args.hidden, device=device)
    variants = [(n, mode) for mode in MODES for n in counts]
    samples: dict[tuple[int, str], list[tuple[float, float, float]]] = {v: [] for v in variants}
    for rnd in range(args.rounds + 1):
        for v in variants:
            took = _run(blocks, x0, *v)
            if rnd:
                samples[v].append(took)

    rows, table = [], []
    for n, mode in variants:
        f, b, w = (statistics.median(s[k] for s in samples[(n, mode)]) for k in range(3))
        base = sum(statistics.median(s[k] for s in samples[(1, mode)]) for k in range(3))
        autograd = sum(statistics.median(s[k] for s in samples[(n, "autograd")]) for k in range(3))
        total = f + b + w
        ceiling = 2 * n / (n + 1) * base / total
        rows.append({"slices": n, "slice_len": args.seq_len // n, "deferred": mode == "deferred",
                     "weight_grads": mode, "forward_ms": f, "backward_ms": b, "weight_ms": w, "total_ms": total,
                     "vs_unsliced": total / base, "vs_autograd": total / autograd, "m1_2stage_ceiling": ceiling})
        table.append([str(n), str(args.seq_len // n), mode, f"{f:.0f}", f"{b:.0f}",
                      f"{w:.0f}" if mode == "deferred" else "-", f"{total:.0f}", f"{total / base:.3f}",
                      f"{total / autograd:.3f}", f"{ceiling:.2f}x"])
    print(f"GPT {args.layers} blocks x hidden {args.hidden}, {args.heads} heads, {args.batch} x {args.seq_len} tokens, "
          f"{args.device}, 1 thread; medians of {args.rounds} rounds")
    print("\n".join(markdown_table(["n", "slice", "weight gradients", "F ms", "B ms", "W ms", "total ms", "x t(1)",
                                    "x autograd", "m=1 ceiling, 2 stages"], table)))
    report = {"rows": rows, "options": vars(args)}
    if args.profile:
        top = {str(n): _op_profile(blocks, x0, n, 12) for n in (1, counts[-1])}
        report["ops_ms"] = top
        print(f"\nSelf time per op, deferred, n = 1 vs n = {counts[-1]} (ms):")
        keys = list(dict.fromkeys([*top[str(counts[-1])], *top["1"]]))
        print("\n".join(markdown_table(["op", "n=1", f"n={counts[-1]}"],
                                       [[k[:60], f"{top['1'].get(k, 0):.1f}", f"{top[str(counts[-1])].get(k, 0):.1f}"]
                                        for k in keys])))
    path = write_report(report, args.json or results_path(NAME), machine=machine_info(threads=1))
    print(f"\nreport: {path}")


if __name__ == "__main__":
    main()

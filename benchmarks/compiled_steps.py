"""The engine's step eager and compiled, unsliced and sliced: how much of a slice's host cost compiling takes away.

    python benchmarks/compiled_steps.py                       # GPT 8 x 64 on one pinned CPU core (aot_eager)
    python benchmarks/compiled_steps.py --hidden 1024 --heads 16 --batch 8 --seq-len 1024 --dtype bf16   # on a GPU

Why: on a GPU the example trainer's model is bound by the host issuing its kernels, so four slices of a micro-batch
cost about four times one (``host_overhead.py``, ``gpu_slices.py``). ``engine.compile()`` fuses the layers'
elementwise kernels and issues them from generated code; with ``mode="reduce-overhead"`` inductor also replays them
as CUDA graphs, which takes the host out of every compiled region (the sliced attention stays eager between them).
This script runs the same engine (one stage, world size 1) in each mode at each slice count, steps alternating
variant by variant, and reports the median step, each mode's sliced step against its own unsliced one, and each
variant's first loss against the eager unsliced one (the same batches and weights).

A variant that cannot be built, compiled or stepped is reported with its error and left out; the others still run.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time
from typing import Any

import torch

from benchlib.tables import machine_info, markdown_table, results_path, write_report
from host_overhead import batches, build_engine, model_arguments, start_process

NAME = "compiled_steps"

#: mode name -> engine.compile's arguments (None: not compiled)
MODES: dict[str, dict[str, Any] | None] = {
    "eager": None,
    "inductor": {"backend": "inductor"},
    "reduce-overhead": {"backend": "inductor", "compile_kwargs": {"mode": "reduce-overhead"}},
    "aot_eager": {"backend": "aot_eager"},
}


def _step(engine: Any, mode: str, args: argparse.Namespace, seed: int) -> float:
    if mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()   # a new step: the last step's graph outputs may be reused
    return float(engine.train_batch(batches(args, torch.Generator().manual_seed(seed))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(ap)
    ap.add_argument("--slices", default="1,4", help="slice counts, comma-separated")
    ap.add_argument("--modes", default=None, help="comma-separated, from " + ", ".join(MODES) +
                    " (default: eager,inductor,reduce-overhead on a GPU, eager,aot_eager on a CPU)")
    ap.add_argument("--deferred", action="store_true", help="deferred weight gradients in the sliced variants")
    ap.add_argument("--warmup", type=int, default=3, help="steps per variant before timing (compiling, recording)")
    ap.add_argument("--steps", type=int, default=7, help="measured steps per variant")
    args = ap.parse_args()
    accel = start_process(args)
    on_cpu = accel.device_name() == "cpu"
    modes = (args.modes or ("eager,aot_eager" if on_cpu else "eager,inductor,reduce-overhead")).split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}; known: {', '.join(MODES)}")
    counts = [int(c) for c in args.slices.split(",")]
    # Every engine here compiles the same layer code: each mode and slice length adds cache entries to the same
    # code objects, more than dynamo's default limit of 8 allows before it falls back to eager for good.
    torch._dynamo.config.recompile_limit = 64
    from torch._dynamo.utils import counters
    engines: dict[tuple[str, int], Any] = {}
    errors: dict[str, str] = {}
    first_loss: dict[tuple[str, int], float] = {}
    warmup_s: dict[tuple[str, int], float] = {}
    for mode in modes:
        for n in counts:
            key = (mode, n)
            try:
                engine = build_engine(args, n, args.deferred and n > 1)
                if MODES[mode] is not None:
                    engine.compile(**MODES[mode])
                start = time.perf_counter()
                first_loss[key] = _step(engine, mode, args, seed=0)
                for i in range(1, args.warmup):
                    _step(engine, mode, args, seed=i)
                accel.synchronize()
                warmup_s[key] = time.perf_counter() - start
                engines[key] = engine
            except Exception as err:   # noqa: BLE001 - one variant's failure must not lose the others' numbers
                errors[f"{mode}, {n} slices"] = f"{type(err).__name__}: {str(err)[:400]}"
                print(f"{mode}, {n} slices: {errors[f'{mode}, {n} slices']}", flush=True)
            print(f"{mode}, {n} slices: warm-up {warmup_s.get(key, float('nan')):.1f} s", flush=True)
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in engines}
    for step in range(args.steps):   # variants alternate step by step
        for key, engine in list(engines.items()):
            try:
                accel.synchronize()
                start = time.perf_counter()
                _step(engine, key[0], args, seed=100 + step)
                accel.synchronize()
                samples[key].append((time.perf_counter() - start) * 1e3)
            except Exception as err:   # noqa: BLE001
                errors[f"{key[0]}, {key[1]} slices"] = f"{type(err).__name__}: {str(err)[:400]}"
                del engines[key]
                samples.pop(key)

    base_key = ("eager", counts[0])
    rows, table = [], []
    for (mode, n), runs in samples.items():
        med = statistics.median(runs)
        own = samples.get((mode, counts[0]))
        eager = samples.get(base_key)
        row = {"mode": mode, "slices": n, "step_ms": med, "steps_ms": runs, "warmup_s": warmup_s[(mode, n)],
               "vs_own_unsliced": med / statistics.median(own) if own else None,
               "vs_eager_unsliced": med / statistics.median(eager) if eager else None,
               "first_loss": first_loss[(mode, n)],
               "first_loss_diff": (first_loss[(mode, n)] - first_loss[base_key]) if base_key in first_loss else None}
        rows.append(row)
        table.append([mode, n, f"{med:.1f}", _ratio(row["vs_own_unsliced"]), _ratio(row["vs_eager_unsliced"]),
                      f"{row['warmup_s']:.1f}", f"{row['first_loss']:.5f}",
                      "-" if row["first_loss_diff"] is None else f"{row['first_loss_diff']:+.1e}"])
    print(f"\n{NAME}: GPT {args.layers} x {args.hidden}, L = {args.seq_len}, batch {args.batch}, "
          f"{args.micro_batches} micro-batches, {args.schedule}, {args.dtype}, ZeRO {args.zero}, "
          f"{'deferred W, ' if args.deferred else ''}{accel.device_name()}; medians of {args.steps} steps (ms)")
    for line in markdown_table(["mode", "slices", "step", "vs its 1 slice", "vs eager 1 slice", "warm-up (s)",
                                "first loss", "vs eager"], table):
        print(line)
    for what, err in errors.items():
        print(f"failed: {what}: {err}")
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    # where dynamo broke the layers' graphs, and how many frames it compiled (all variants together)
    breaks = {reason.split("\n")[0] + _disabled(reason): n for reason, n in counters["graph_break"].items()}
    frames = counters["frames"]["total"]
    print(f"dynamo: {frames} frames compiled; graph breaks: {breaks}")
    report = {"options": vars(args), "device": device, "rows": rows, "errors": errors,
              "dynamo": {"frames": frames, "graph_breaks": breaks}}
    path = write_report(report, args.json or results_path(NAME),
                        machine=machine_info(threads=torch.get_num_threads(), device=device))
    print(f"report: {path}")


def _disabled(reason: str) -> str:
    """The function a ``torch.compiler.disable`` graph break names, as `` (name)``, else ''."""
    found = re.search(r"Skip calling function `<function (\w+)", reason)
    return f" ({found.group(1)})" if found else ""


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


if __name__ == "__main__":
    main()

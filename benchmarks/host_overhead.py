"""The engine's own time per action: what a step spends outside the layers' forward, backward and optimizer.

    python benchmarks/host_overhead.py                       # the example trainer's model, 1 stage, one process
    python benchmarks/host_overhead.py --hidden 1024 --batch 8 --dtype bf16   # the GPU trainer shape (on a GPU)
    python benchmarks/host_overhead.py --profile             # + the engine functions that cost the most (cProfile)

Why: on a GPU a small model is bound by the host, and every slice repeats the engine's per-action work (schedule
dispatch, buffers, the slice context, loss weighting, DeepSpeed's per-backward gradient bookkeeping). That work
does not shrink with the slice, so it decides whether cutting a micro-batch finer can pay. This script runs
the engine (one stage, world size 1, one pinned core on a CPU) and splits each step's time into

* ``layers``: inside the module's forward and inside autograd's backward (the model's own kernels and their
  dispatch; deferred W passes included),
* ``optimizer``: the optimizer step (clipping, DeepSpeed's update),
* ``engine``: the rest, the engine's own work; ``per action`` divides it by the step's F, B and W actions.

One more step per variant runs under a counting dispatch mode: the ATen calls that launch a kernel on a device
(views, reshapes and allocations left out) per slice in the layers (forward, backward and W), and per action in
the engine. On a GPU bound by launching kernels, that count is what a slice costs.

With a narrow model (the default hidden 64) the layers' arithmetic is small, so the numbers are what a
launch-bound device sees of the host. Variants (slice counts, deferral) alternate step by step; medians.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import os
import pstats
import statistics
import time
from collections import defaultdict
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchlib.launch import pin_one_core
from benchlib.tables import machine_info, markdown_table, results_path, write_report

NAME = "host_overhead"


class Clock:
    """Wall time spent inside wrapped calls, by bucket; nested calls count once (the outermost). ``bucket`` names
    the one running now ("engine" outside every wrapped call), for :class:`KernelCount`."""

    def __init__(self, sync: Callable[[], None]) -> None:
        self.sync = sync
        self.ms: dict[str, float] = defaultdict(float)
        self.depth = 0
        self.bucket = "engine"

    def wrap(self, fn: Callable, bucket: str) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self.depth:
                return fn(*args, **kwargs)
            self.depth += 1
            self.bucket = bucket
            self.sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.ms[bucket] += (time.perf_counter() - start) * 1e3
                self.depth -= 1
                self.bucket = "engine"
        return timed


#: ATen calls that launch no kernel on a device: views, shape queries, allocations without a fill.
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "_reshape_alias", "reshape", "transpose", "t", "permute", "expand", "unsqueeze",
    "squeeze", "split", "split_with_sizes", "chunk", "unbind", "slice", "select", "narrow", "as_strided", "alias",
    "detach", "view_as", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "size", "stride", "sym_size", "sym_stride", "is_same_size", "_has_compatible_shallow_copy_type",
    "_is_mkldnn_fp16_supported"})


class KernelCount(TorchDispatchMode):
    """ATen calls that launch a kernel, by the clock's running bucket."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.counts: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.overloadpacket.__name__ not in NO_KERNEL:
            self.counts[self.clock.bucket] += 1
        return func(*args, **(kwargs or {}))


def _init_single_process() -> None:
    import ds_terapipe
    from ds_terapipe.runtime.execution.local_launch import free_port, rank_env
    for key, value in rank_env(0, 1, free_port(), threads=None).items():   # what a launcher would give rank 0
        os.environ.setdefault(key, value)
    ds_terapipe.init_distributed(verbose=False)


def model_arguments(ap: argparse.ArgumentParser) -> None:
    """The options :func:`build_engine` reads (the model, its batches, the schedule, precision and ZeRO stage), and
    :func:`start_process`'s core and the report's path."""
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--schedule", default="1f1b")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--zero", type=int, default=0)
    ap.add_argument("--core", type=int, default=None, help="pin to this CPU core (default: the last one)")
    ap.add_argument("--json", default=None)


def start_process(args: argparse.Namespace) -> Any:
    """World size 1 in this process, pinned to one core on a CPU; returns DeepSpeed's accelerator."""
    from deepspeed.accelerator import get_accelerator
    # DeepSpeed's process group first: on a fresh machine it compiles its CPU comm op, which a pinned process would
    # compile on one core
    _init_single_process()
    if get_accelerator().device_name() == "cpu":
        pin_one_core(args.core)
    return get_accelerator()


def build_engine(args: argparse.Namespace, slices: int, deferred: bool) -> Any:
    import ds_terapipe
    from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
    cfg = GPTConfig(num_layers=args.layers, hidden=args.hidden, num_heads=args.heads, vocab_size=256,
                    max_seq_len=args.seq_len, seed=1)
    tp = {"enabled": True, "seq_len": args.seq_len, "slices": [args.seq_len // slices] * slices,
          "schedule": args.schedule, "deferred_weight_grads": deferred}
    ds_config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": args.micro_batches,
                 "gradient_clipping": 1.0, "steps_per_print": 10 ** 9, "terapipe": tp}
    if args.dtype == "bf16":
        ds_config["bf16"] = {"enabled": True}
    if args.zero:
        ds_config["zero_optimization"] = {"stage": args.zero}
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=1, loss_fn=causal_lm_loss,
                                            vocab_size=256, partition_method="type:GPTBlock")
    # torch's AdamW (fused on a GPU): DeepSpeed's own would build its CUDA op on first use
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=torch.cuda.is_available())
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=optimizer, config=ds_config)
    return engine


def instrument(engine: Any, clock: Clock) -> None:
    """Time the layers' forward and backward, and the optimizer step, on this engine."""
    from deepspeed.runtime.pipe.schedule import OptimizerStep
    module = engine.module
    module.forward = clock.wrap(module.forward, "layers")
    # the engine dispatches through its class's instruction map (handlers bound per call)
    handlers = dict(engine._INSTRUCTION_MAP)
    handlers[OptimizerStep] = clock.wrap(handlers[OptimizerStep], "optimizer")
    engine._INSTRUCTION_MAP = handlers


@contextlib.contextmanager
def timed_autograd(clock: Clock):
    """Every autograd backward (DeepSpeed's loss.backward, the stages' backward) and every deferred W pass's
    GEMMs into ``layers``."""
    from ds_terapipe.runtime.slicing.deferred import WeightGradStash
    backward, tensor_backward, compute = torch.autograd.backward, torch.Tensor.backward, WeightGradStash.compute
    torch.autograd.backward = clock.wrap(backward, "layers")
    torch.Tensor.backward = clock.wrap(tensor_backward, "layers")
    WeightGradStash.compute = clock.wrap(compute, "layers")
    try:
        yield
    finally:
        torch.autograd.backward, torch.Tensor.backward, WeightGradStash.compute = backward, tensor_backward, compute


@contextlib.contextmanager
def per_parameter_bf16_grads():
    """The engine without its flat bf16 gradients: DeepSpeed's own per-parameter move after each backward."""
    from ds_terapipe.runtime.execution import engine as engine_module

    class _Nothing:
        @staticmethod
        def begin_step() -> None:
            pass

    saved = engine_module.FlatBf16Grads
    engine_module.FlatBf16Grads = type("Off", (), {"attach": staticmethod(lambda optimizer: _Nothing)})
    try:
        yield
    finally:
        engine_module.FlatBf16Grads = saved


def batches(args: argparse.Namespace, gen: torch.Generator):
    for _ in range(args.micro_batches):
        ids = torch.randint(0, 256, (args.batch, args.seq_len + 1), generator=gen)
        yield ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    model_arguments(ap)
    ap.add_argument("--slices", default="1,4,8", help="slice counts, comma-separated")
    ap.add_argument("--steps", type=int, default=9, help="measured steps per variant (after 2 warm-up steps)")
    ap.add_argument("--per-parameter-bf16", action="store_true",
                    help="bf16 at ZeRO 0: also each variant without the flat bf16 gradients (DeepSpeed's own loop)")
    ap.add_argument("--profile", action="store_true", help="cProfile one step of the largest slice count")
    args = ap.parse_args()
    accel = start_process(args)
    counts = [int(c) for c in args.slices.split(",")]
    variants = [(n, d, True) for n in counts for d in ((False, True) if n > 1 else (False,))]
    if args.dtype == "bf16" and not args.zero and args.per_parameter_bf16:
        variants += [(n, d, False) for n, d, _ in variants]
    clock = Clock(accel.synchronize)
    engines = {}
    for n, deferred, flat in variants:
        engine = build_engine(args, n, deferred)
        instrument(engine, clock)
        engines[(n, deferred, flat)] = engine
    gen = torch.Generator().manual_seed(0)
    samples: dict[tuple[int, bool, bool], list[dict[str, float]]] = {v: [] for v in variants}
    with timed_autograd(clock):
        for step in range(args.steps + 2):   # variants alternate step by step
            for key, engine in engines.items():
                clock.ms.clear()
                accel.synchronize()
                start = time.perf_counter()
                with contextlib.nullcontext() if key[2] else per_parameter_bf16_grads():
                    engine.train_batch(batches(args, gen))
                accel.synchronize()
                total = (time.perf_counter() - start) * 1e3
                if step >= 2:
                    samples[key].append({"step": total, **clock.ms})
        kernels: dict[tuple[int, bool, bool], dict[str, int]] = {}
        for key, engine in engines.items():   # one more step each, counted (the dispatch mode slows it down)
            with contextlib.nullcontext() if key[2] else per_parameter_bf16_grads(), KernelCount(clock) as count:
                engine.train_batch(batches(args, gen))
            kernels[key] = dict(count.counts)
        profile_text = None
        if args.profile:
            engine = engines[variants[-1]]
            prof = cProfile.Profile()
            prof.enable()
            engine.train_batch(batches(args, gen))
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
            profile_text = buf.getvalue()

    rows, table = [], []
    base = None
    for (n, deferred, flat), runs in samples.items():
        med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in ("step", "layers", "optimizer")}
        engine_ms = statistics.median(r["step"] - r.get("layers", 0.0) - r.get("optimizer", 0.0) for r in runs)
        actions = args.micro_batches * n * (3 if deferred else 2) if args.schedule != "gpipe" or not deferred \
            else args.micro_batches * (2 * n + 1)
        counted = kernels[(n, deferred, flat)]
        row = {"slices": n, "deferred": deferred, "flat_bf16_grads": flat, "step_ms": med["step"],
               "layers_ms": med["layers"], "optimizer_ms": med["optimizer"], "engine_ms": engine_ms, "actions": actions,
               "engine_ms_per_action": engine_ms / actions,
               "layer_kernels_per_slice": counted.get("layers", 0) / (args.micro_batches * n),
               "engine_kernels_per_action": counted.get("engine", 0) / actions}
        if base is None:
            base = row
        row["step_vs_1"] = row["step_ms"] / base["step_ms"]
        rows.append(row)
        table.append([n, "on" if deferred else "off", "flat" if flat else "per parameter", f"{row['step_ms']:.1f}",
                      f"{row['layers_ms']:.1f}",
                      f"{row['optimizer_ms']:.1f}", f"{engine_ms:.1f}", actions,
                      f"{row['engine_ms_per_action']:.3f}", f"{row['layer_kernels_per_slice']:.0f}",
                      f"{row['engine_kernels_per_action']:.1f}", f"{row['step_vs_1']:.2f}"])
    print(f"\n{NAME}: GPT {args.layers} x {args.hidden}, L = {args.seq_len}, batch {args.batch}, "
          f"{args.micro_batches} micro-batches, {args.schedule}, {args.dtype}, ZeRO {args.zero}, "
          f"{accel.device_name()}; medians of {args.steps} steps (ms)")
    for line in markdown_table(["slices", "deferred W", "bf16 grads", "step", "layers", "optimizer", "engine", "actions",
                                "engine / action", "layer kernels / slice", "engine kernels / action",
                                "step / 1 slice"], table):
        print(line)
    if profile_text:
        print(profile_text)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    report = {"options": vars(args), "device": device, "rows": rows}
    if profile_text:
        report["profile"] = profile_text
    path = write_report(report, args.json or results_path(NAME),
                        machine=machine_info(threads=torch.get_num_threads(), device=device))
    print(f"report: {path}")


if __name__ == "__main__":
    main()

"""Long context on 4 CPU processes: pipeline x sequence parallelism against a pipeline alone and against DeepSpeed's
Ulysses alone, the same model, side by side in one run.

    flock /tmp/bench.lock python benchmarks/sequence_parallel.py                 # L = 8192, about 10 minutes
    python benchmarks/sequence_parallel.py --seq-len 2048 --rounds 1            # a quick look

Four local gloo processes (one compute thread each; the host has 2 cores, so two processes share a core in every
variant alike), the reference GPT (``ds_terapipe.models.gpt``: 8 blocks, hidden 128, 4 heads, vocab 256, learned
positions), sequence L, micro-batch size 1, 2 micro-batches per step, SGD. Variants:

* ``pipeline x sequence (2 x 2)``: the token pipeline, 2 stages x 2 sequence ranks (``terapipe.sequence_parallel:
  2``), 1f1b, 4 equal slices.
* ``pipeline (4 stages) + checkpointing``: the token pipeline on 4 stages, 1f1b, 4 equal slices, every layer's
  activations recomputed (``activation_checkpoint_interval=1``): how a pipeline alone fits long sequences.
* ``pipeline (4 stages)``: the same without recomputation.
* ``DeepSpeed Ulysses (4 ranks)``: no pipeline; ``deepspeed.initialize(mesh_param=(1, 4))`` and DeepSpeed's
  ``deepspeed.sequence.layer.DistributedAttention`` around each block's attention (the same weights), each rank
  holding L/4 tokens of each sequence, its positions offset to its share, the gradients summed over the four
  ranks by DeepSpeed's reduction given the sequence group through an ``mpu`` (:class:`_SequenceDataParallel`).

No gradient clipping anywhere (DeepSpeed's default clips at 1.0). Checked: every variant's loss after every step
equals the first variant's (rel 1e-5): the same model, batches and weights, so the same training.

Per variant: the median step time (slowest rank) and tokens/s over alternated rounds (``benchlib/alternate.py``);
the CPU seconds the four processes spent in a step (``time.process_time``: every thread of a process, gloo's
included), summed and the busiest rank's: with four processes on two cores the step can be no shorter than the
sum over two, so this column says how much of a difference in step time is a difference in work; and per
rank, measured in the warm-up step (``benchlib.meters.ActivationMeter``; the timed steps run without hooks): the
peak bytes of the storages autograd holds for backward (each once however many views of it are
saved, while any is alive; parameters and the KV carry left out), the token pipeline's KV carry at its peak, the
peak of the two together, and the parameters held (gradients and SGD state scale with them). Writes
``benchmarks/results/sequence_parallel.json`` unless ``--json PATH``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib.alternate import alternate, median
from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.meters import ActivationMeter
from benchlib.tables import (benchmark_parser, chosen_variants, machine_info, markdown_table, print_checks,
                             results_path, write_report)

NAME = "sequence_parallel"
WORLD = 4
PIPE_SEQ, PIPE_AC, PIPE, ULYSSES = ("pipeline x sequence (2 x 2)", "pipeline (4 stages) + checkpointing",
                                    "pipeline (4 stages)", "DeepSpeed Ulysses (4 ranks)")
VARIANTS = [PIPE_SEQ, PIPE_AC, PIPE, ULYSSES]


def _pipeline(name: str, cfg: Any, opts: dict) -> Any:
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    seq = 2 if name == PIPE_SEQ else 1
    terapipe = {"enabled": True, "seq_len": opts["seq_len"], "slices": 4, "granularity": 8, "schedule": "1f1b",
                "p2p_timeout_s": 1800.0, "sequence_parallel": seq}
    kwargs: dict[str, Any] = {"activation_checkpoint_interval": 1} if name == PIPE_AC else {}
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=WORLD // seq, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="type:GPTBlock",
                                            **kwargs, **ds_terapipe.module_chunk_kwargs(
                                                ds_terapipe.parse_terapipe_config({"terapipe": terapipe})))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": opts["micro"],
              "train_batch_size": opts["micro"], "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "terapipe": terapipe}
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                             config=config)
    return engine


class _UlyssesAttention:
    """A reference GPT block's attention through DeepSpeed's DistributedAttention (same qkv and proj weights)."""

    def __init__(self, attn: Any, group: Any) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        self.attn = attn
        self.dist = DistributedAttention(self._local, group, scatter_idx=2, gather_idx=1)

    @staticmethod
    def _local(q: Any, k: Any, v: Any, *args: Any, **kwargs: Any) -> Any:   # (B, T, heads/N, hs)
        import torch.nn.functional as F

        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return out.transpose(1, 2)

    def __call__(self, x: Any) -> Any:
        batch, tokens, channels = x.shape
        heads = self.attn.num_heads
        q, k, v = self.attn.qkv(x).split(channels, dim=2)
        shape = (batch, tokens, heads, channels // heads)
        y = self.dist(q.reshape(shape), k.reshape(shape), v.reshape(shape), 0)   # (B, T/N, heads, hs)
        return self.attn.proj(y.reshape(batch, tokens, channels))


class _SequenceDataParallel:
    """The one thing DeepSpeed asks of a model-parallel unit (``mpu``) to reduce gradients over the sequence
    ranks. Without an mpu, DeepSpeed 0.19.8 takes the data-parallel group (one rank here) for the reduction and
    divides by its size over the sequence degree (1/4): every rank would step on 4x its own partial gradient,
    never summed over the others (checked against the unsliced reference). With it, the reduction sums over
    all four ranks, as Megatron-DeepSpeed's mpu makes it do."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def get_sequence_data_parallel_group(self) -> Any:
        return self.group

    def get_sequence_data_parallel_world_size(self) -> int:
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    def get_sequence_data_parallel_rank(self) -> int:
        import torch.distributed as dist

        return dist.get_rank(self.group)


def _ulysses(cfg: Any, opts: dict) -> Any:
    import deepspeed
    import torch

    from deepspeed.utils import groups
    from ds_terapipe.models.gpt import GPTReference

    model = GPTReference(cfg)
    groups.mpu = None   # DeepSpeed keeps the last engine's grid process-wide; this engine has none
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": opts["micro"],
              "train_batch_size": opts["micro"], "steps_per_print": 10**9, "sequence_parallel_size": WORLD,
              "gradient_clipping": 0.0}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-3),
                                           config=config, mesh_param=(1, WORLD))
    group = groups._get_sequence_parallel_group()
    for block in model.layers[1:-1]:
        block.attn.forward = _UlyssesAttention(block.attn, group)
    engine.sequence_mpu = _SequenceDataParallel(group)   # set as DeepSpeed's mpu around each step
    return engine


def _ulysses_step(engine: Any, batches: list, seq_len: int) -> float:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from types import SimpleNamespace

    from deepspeed.utils import groups
    from ds_terapipe.runtime.slicing.context import slice_scope

    rank, share = dist.get_rank(), seq_len // WORLD
    lo, hi = rank * share, (rank + 1) * share
    total = torch.zeros(())
    previous, groups.mpu = groups.mpu, engine.sequence_mpu   # the pipeline engines install their own grids
    try:
        for ids, labels in batches:
            # positions of this rank's share: the embedding reads them from a slice context (no pipeline runs here)
            with slice_scope(SimpleNamespace(position_start=lo, documents=None, sequence=None)):
                logits = engine(ids[:, lo:hi])
            loss = F.cross_entropy(logits.flatten(0, 1), labels[:, lo:hi].flatten(), reduction="sum") / labels.numel()
            engine.backward(loss)   # DeepSpeed divides by its gradient_accumulation_steps (the micro-batches)
            total += loss.detach() / len(batches)
            engine.step()           # one optimizer step, at the accumulation boundary
    finally:
        groups.mpu = previous
    dist.all_reduce(total)
    return float(total)


def worker_main(out_dir: Path, opts: dict) -> None:
    rank = int(os.environ["RANK"])
    pin_and_single_thread(rank, False)
    import json

    import deepspeed
    import ds_terapipe
    import torch

    from ds_terapipe.models.gpt import GPTConfig

    ds_terapipe.init_distributed(dist_backend="gloo")
    seq_len = opts["seq_len"]
    cfg = GPTConfig(num_layers=8, hidden=128, num_heads=4, vocab_size=256, max_seq_len=seq_len, seed=1234)
    gen = torch.Generator().manual_seed(7)
    batches = []
    for _ in range(opts["micro"]):
        ids = torch.randint(0, cfg.vocab_size, (1, seq_len + 1), generator=gen)
        batches.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    engines: dict[str, Any] = {}
    for name in sorted(opts["variants"], key=lambda n: n != ULYSSES):   # Ulysses first: see _ulysses
        if name == ULYSSES:
            engine = _ulysses(cfg, opts)
        else:
            engine = _pipeline(name, cfg, opts)
        engines[name] = engine
    memory: dict[str, dict] = {}
    losses: dict[str, list] = {name: [] for name in engines}
    times: dict[str, list] = {name: [] for name in engines}   # the slowest rank's, per timed round
    cpu: dict[str, list] = {name: [] for name in engines}     # per timed round: every rank's CPU seconds

    def run_step(name: str, rnd: Any) -> dict:
        engine = engines[name]
        meter = ActivationMeter(engine) if rnd is None else contextlib.nullcontext()   # memory: the warm-up
        torch.distributed.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        with meter:
            if name == ULYSSES:
                loss = _ulysses_step(engine, batches, seq_len)
            else:
                loss = float(engine.train_batch(iter(batches)))
        step_ms, cpu_s = (time.perf_counter() - t0) * 1e3, time.process_time() - c0
        slowest = torch.tensor([step_ms])
        torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
        every = [torch.zeros(1, dtype=torch.float64) for _ in range(WORLD)]
        torch.distributed.all_gather(every, torch.tensor([cpu_s], dtype=torch.float64))
        if rnd is None:
            memory[name] = {"saved_peak_bytes": meter.peak_saved, "kv_bytes": meter.peak_kv,
                            "total_peak_bytes": meter.peak_total,
                            "param_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters())}
        losses[name].append(loss)
        if rnd is not None:
            times[name].append(float(slowest))
            cpu[name].append([float(x) for x in every])
        return {"step_ms": float(slowest), "foreign_cores": float("nan")}

    rounds = alternate(list(engines), run_step, warmup=1, steps=opts["rounds"], max_rounds=opts["rounds"],
                       quiet_wait=0.0, foreign_max=1e9, cpu=None, rank=rank, label=f"L={seq_len}")
    per_rank = {"rank": rank, "rounds": rounds, "memory": memory, "losses": losses, "times": times, "cpu_s": cpu,
                "torch": torch.__version__, "deepspeed": deepspeed.__version__}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(per_rank))


def analyse(ranks: list[dict], opts: dict) -> tuple[list[str], list[dict]]:
    tokens = opts["seq_len"] * opts["micro"]
    rows = []
    for name in opts["variants"]:
        times = ranks[0]["times"][name]
        step_ms = median(times) if times else float("nan")
        mem = [r["memory"][name] for r in ranks]
        cpu = ranks[0]["cpu_s"][name]
        rows.append({"variant": name, "step_ms": step_ms, "tokens_per_s": tokens / step_ms * 1e3,
                     "cpu_s": median([sum(c) for c in cpu]) if cpu else float("nan"),
                     "busiest_cpu_s": median([max(c) for c in cpu]) if cpu else float("nan"),
                     "saved_peak_mib": [m["saved_peak_bytes"] / 2**20 for m in mem],
                     "kv_mib": [m["kv_bytes"] / 2**20 for m in mem],
                     "param_mib": [m["param_bytes"] / 2**20 for m in mem],
                     "max_rank_mib": max(m["total_peak_bytes"] / 2**20 for m in mem)})
    lines = markdown_table(
        ["variant", "step s", "tokens/s", "CPU s (all ranks / busiest)", "activations held for backward MiB per rank",
         "KV carry MiB per rank", "largest rank's peak of both MiB", "parameters MiB per rank"],
        [[r["variant"], f"{r['step_ms'] / 1e3:.2f}", f"{r['tokens_per_s']:.0f}",
          f"{r['cpu_s']:.1f} / {r['busiest_cpu_s']:.1f}",
          " / ".join(f"{x:.0f}" for x in r["saved_peak_mib"]), " / ".join(f"{x:.0f}" for x in r["kv_mib"]),
          f"{r['max_rank_mib']:.0f}", " / ".join(f"{x:.1f}" for x in r["param_mib"])] for r in rows])
    return lines, rows


def loss_checks(losses: dict[str, list[float]]) -> list[dict]:
    """Every variant trains the same model on the same batches from the same weights: its loss after each step
    equals the first variant's (rel 1e-5), so no variant is timed doing something else."""
    names = list(losses)
    checks = []
    for name in names[1:]:
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses[name], losses[names[0]]))
        checks.append({"target": f"{name}: losses equal {names[0]}'s every step (rel <= 1e-5)", "value": worst,
                       "met": worst <= 1e-5})
    return checks


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = benchmark_parser(__doc__)
    ap.add_argument("--seq-len", type=int, default=8192)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (after one warm-up round)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of: " + ", ".join(VARIANTS))
    ap.add_argument("--json", metavar="PATH", help="report path (default benchmarks/results/sequence_parallel.json)")
    ap.add_argument("--timeout", type=float, default=3000.0)
    args = ap.parse_args()
    variants = chosen_variants(ap, args.variants, VARIANTS)
    if args.seq_len % (8 * WORLD):
        ap.error(f"--seq-len must be a multiple of {8 * WORLD} (4 slices of a multiple of 8, split 2 or 4 ways)")
    opts = {"seq_len": args.seq_len, "micro": args.micro, "rounds": args.rounds, "variants": variants}
    out_dir = Path(tempfile.mkdtemp(prefix="sequence_parallel-"))
    started = time.perf_counter()
    ranks = launch_workers(Path(__file__), WORLD, out_dir, opts, timeout_s=args.timeout)
    lines, rows = analyse(ranks, opts)
    print("\n" + "\n".join(lines))
    checks = loss_checks(ranks[0]["losses"])
    print_checks(checks)
    report = {"name": NAME, "options": opts, "table": lines, "rows": rows, "checks": checks, "ranks": ranks,
              "wall_s": time.perf_counter() - started}
    machine = machine_info(torch=ranks[0]["torch"], deepspeed=ranks[0]["deepspeed"], threads_per_rank=1,
                           cores_pinned=False, processes=WORLD)
    print(f"report: {write_report(report, Path(args.json) if args.json else results_path(NAME), machine=machine)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

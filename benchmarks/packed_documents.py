"""Packed documents on CPU: the token pipeline planned per batch against a fixed plan and stock DeepSpeed.

    flock /tmp/bench.lock python benchmarks/packed_documents.py            # GPT 8 x 256, rows of 2048, m 1 and 4
    flock /tmp/bench.lock python benchmarks/packed_documents.py --quick    # a short smoke run

Data: the example trainer's default corpus (the Python standard library's ``*.py`` files, sorted, 8 MB at most)
with every top-level definition as a document (a file is cut before each unindented ``def``, ``class``, ``@`` or
``if __name__`` line): lengths from a few bytes to tens of thousands, most short (the report gives the
percentiles). Each row is a random window of the concatenated stream, packed the Hugging Face way: position ids
restarting at 0 where a document starts (the window's first document at its start), label -100 where the next
token is in another document. Every round draws new rows, the same for every variant.

Two stages, one process per stage pinned to its own core with one torch thread, gloo; the reference GPT
(``partition_method="type:GPTBlock"``), micro-batch 1, m micro-batches. Variants, each built once per m:

* ``stock``: DeepSpeed's PipelineEngine (1F1B ``TrainSchedule``) on the same layers, each run under the row's
  document mask unsliced (the position ids travel with the activations, as an attention mask does in Megatron's
  pipeline);
* ``token fixed``: ``slices: "auto"``, 1f1b, ``packed``: the plan for the row length (planned for the causal
  prefix), the same for every batch;
* ``token fixed (mean docs)``: the best fixed plan for this corpus: planned once, from the same measured costs, for
  the mean document context of 64 sample steps, then run for every batch;
* ``token per-batch``: ``plan_per_batch``: each step's slicing planned for its rows' documents.

Every round runs one ``train_batch`` of every variant (order rotated per round). Reported: median step, tokens/s,
paired speedups, the slicings used, and rank 0's planning time per step (memo hits included) as a share of the
step. Beside each measured step, the planner's prediction for the slicing that variant ran on that round's rows
(measured costs read at the rows' document contexts, the 1f1b step simulated), and from it the per-batch plan's
gain over the best fixed plan as the model sees it: what planning per batch can win on these rows. Checked: the
variants' first-round losses agree (the same weights, rows and document mask: 1e-5).
"""
from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchlib.alternate import median
from benchlib.launch import launch_workers, pin_and_single_thread, run_as_worker
from benchlib.tables import ROOT, benchmark_parser, markdown_table, print_checks, results_path, write_report

NAME = "packed_documents"
NUM_STAGES = 2
VARIANTS = ("stock", "token fixed", "token fixed (mean docs)", "token per-batch")
_DEFINITION = re.compile(rb"\n(?=(?:def |class |@|if __name__))")


def corpus_documents(max_mb: float = 8.0) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document starts): the standard library's source as bytes, every top-level definition a document."""
    budget, lengths, chunks = int(max_mb * 2**20), [], []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        data = path.read_bytes()
        parts = [p + b"\n" for p in _DEFINITION.split(data) if p]
        chunks += parts
        lengths += [len(p) for p in parts]
        budget -= len(data)
        if budget <= 0:
            break
    starts = np.cumsum([0] + lengths[:-1], dtype=np.int64)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.int64), starts


def packed_rows(tokens: np.ndarray, starts: np.ndarray, seq_len: int, count: int, seed: int) -> list[tuple]:
    """``count`` micro-batches of one row: ``((ids, position_ids), labels)`` (``ds_terapipe.packed_rows``)."""
    import ds_terapipe

    rng = np.random.default_rng(seed)
    return [ds_terapipe.packed_rows(tokens, starts, [int(rng.integers(0, len(tokens) - seq_len - 1))], seq_len)
            for _ in range(count)]


def _stock_specs(cfg: Any) -> list:
    """The reference GPT's layers for stock DeepSpeed: the position ids ride along with the activations and each
    layer runs under the row's document mask (``packed_documents``), unsliced."""
    import torch
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    from ds_terapipe import packed_documents
    from ds_terapipe.models.gpt import GPTBlock, GPTEmbedding, GPTFinalNorm

    class Embedding(GPTEmbedding):
        def forward(self, inputs: Any) -> Any:
            ids, positions = inputs
            with packed_documents(positions):
                return super().forward(ids), positions

    class Carry(torch.nn.Module):
        def __init__(self, cls: type, *args: Any) -> None:
            super().__init__()
            self.inner = cls(*args)

        def forward(self, inputs: Any) -> Any:
            hidden, positions = inputs
            with packed_documents(positions):
                return self.inner(hidden), positions

    def head(embedding: Any, inputs: Any) -> Any:
        return embedding.head(inputs[0])

    return [TiedLayerSpec("embed", Embedding, cfg, tied_weight_attr="wte.weight"),
            *[LayerSpec(Carry, GPTBlock, cfg, i) for i in range(cfg.num_layers)],
            LayerSpec(Carry, GPTFinalNorm, cfg),
            TiedLayerSpec("embed", Embedding, cfg, forward_fn=head, tied_weight_attr="wte.weight")]


def _config(opts: dict, m: int, terapipe: dict | None) -> dict:
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": m,
                              "train_batch_size": m, "steps_per_print": 10**9, "gradient_clipping": 0.0,
                              "zero_optimization": {"stage": 0}}
    if terapipe is not None:
        config["terapipe"] = {"enabled": True, "seq_len": opts["seq_len"], "slices": "auto", "schedule": "1f1b",
                              "packed": True, "p2p_timeout_s": 900.0, "profile": opts["profile"],
                              "plan_cache": opts["plan_cache"], **terapipe}
    return config


def _build(variant: str, cfg: Any, opts: dict, m: int, slices: list[int] | None = None) -> Any:
    import deepspeed
    import torch

    import ds_terapipe
    from ds_terapipe.models.gpt import causal_lm_loss, gpt_layer_specs

    torch.manual_seed(1234)
    if variant == "stock":
        model = deepspeed.pipe.PipelineModule(_stock_specs(cfg), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                              partition_method="type:Carry")
        terapipe = None
    else:
        model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=NUM_STAGES, loss_fn=causal_lm_loss,
                                                vocab_size=cfg.vocab_size, partition_method="type:GPTBlock")
        terapipe = {"plan_per_batch": True} if variant == "token per-batch" else \
            ({"slices": slices} if slices is not None else {})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    init = deepspeed.initialize if variant == "stock" else ds_terapipe.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=_config(opts, m, terapipe))
    return engine


def _document_cost(engine: Any, context: np.ndarray) -> Any:
    """Rank 0: the engine's measured costs for its row length, read at a document ``context``
    (:func:`~ds_terapipe.planner.documents.document_context`)."""
    from ds_terapipe.planner.cost import PipelineCost
    from ds_terapipe.planner.documents import within_documents

    cost = PipelineCost.from_dict(engine.plans[engine.seq_len].cost, num_stages=engine.num_chunks)
    return within_documents(cost, context, engine.terapipe.granularity)


def _rows_context(engine: Any, batches: list) -> np.ndarray:
    from ds_terapipe.planner.documents import document_context

    return document_context([b[0][1].numpy() for b in batches], engine.terapipe.granularity)


def _mean_docs_slices(engine: Any, tokens: np.ndarray, starts: np.ndarray, opts: dict, m: int) -> list[int]:
    """Rank 0: the plan for the corpus's mean document context (64 sample steps), from the engine's costs."""
    from ds_terapipe.runtime.planning.plan import solve_slicing

    seq_len = opts["seq_len"]
    samples = [_rows_context(engine, packed_rows(tokens, starts, seq_len, m, 10_000 + i)) for i in range(64)]
    cost = _document_cost(engine, np.mean(samples, axis=0))
    return list(solve_slicing(engine, cost, engine.plans[seq_len].stage_meta, seq_len).slices)


def _predicted_ms(engine: Any, batches: list, slices: list[int], m: int) -> float:
    """Rank 0: the planner's prediction for running ``slices`` on these rows: the engine's measured costs read at
    the rows' document contexts, the step simulated under the 1f1b schedule."""
    from ds_terapipe.planner.schedule import build_schedule
    from ds_terapipe.planner.simulate import simulate

    cost = _document_cost(engine, _rows_context(engine, batches))
    return simulate(build_schedule("1f1b", NUM_STAGES, m, len(slices)), cost, list(slices)).makespan_ms


def worker_main(out_dir: Path, opts: dict) -> None:
    rank = int(os.environ["RANK"])
    pin_and_single_thread(rank, True)
    import ds_terapipe
    import torch.distributed as dist

    from ds_terapipe.models.gpt import GPTConfig

    ds_terapipe.init_distributed(dist_backend="gloo")
    seq_len = opts["seq_len"]
    cfg = GPTConfig(num_layers=opts["layers"], hidden=opts["hidden"], num_heads=opts["heads"],
                    vocab_size=256, max_seq_len=seq_len, seed=1234)
    tokens, starts = corpus_documents()
    engines: dict[tuple[int, str], Any] = {}
    for m in opts["ms"]:
        for variant in VARIANTS:
            slices = None
            if variant == "token fixed (mean docs)":
                box = [_mean_docs_slices(engines[(m, "token fixed")], tokens, starts, opts, m) if rank == 0 else None]
                dist.broadcast_object_list(box, src=0)
                slices = box[0]
            engines[(m, variant)] = _build(variant, cfg, opts, m, slices)
            if rank == 0:
                print(f"[rank 0] m={m} {variant}: built, slices {list(getattr(engines[(m, variant)], 'slices', []))}",
                      flush=True)
    times: dict[str, list[float]] = {}
    losses: dict[str, list[float]] = {}
    used: dict[str, list[list[int]]] = {}
    predicted: dict[str, list[float]] = {}   # rank 0: the planner's step time for the slicing each variant ran
    for m in opts["ms"]:
        order = list(VARIANTS)
        for rnd in range(opts["warmup"] + opts["steps"]):
            batches = packed_rows(tokens, starts, seq_len, m, seed=1000 * m + rnd)
            for variant in order[rnd % len(order):] + order[:rnd % len(order)]:
                key = f"m={m} {variant}"
                engine = engines[(m, variant)]
                dist.barrier()
                t0 = time.perf_counter()
                loss = engine.train_batch(iter(batches))
                dist.barrier()
                ms = (time.perf_counter() - t0) * 1e3
                losses.setdefault(key, []).append(float(loss))
                used.setdefault(key, []).append(list(getattr(engine, "slices", [seq_len])))
                if rnd >= opts["warmup"]:
                    times.setdefault(key, []).append(ms)
                    if rank == 0 and variant != "stock":
                        predicted.setdefault(key, []).append(
                            _predicted_ms(engines[(m, "token fixed")], batches, used[key][-1], m))
                if rank == 0:
                    print(f"[rank 0] m={m} round {rnd} {variant}: {ms:.0f} ms, slices {used[key][-1]}", flush=True)
    planning = {f"m={m}": engines[(m, "token per-batch")].batch_planner.planning_ms for m in opts["ms"]}
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "times": times, "losses": losses,
                                                          "slices": used, "planning_ms": planning,
                                                          "predicted_ms": predicted}))


def main() -> int:
    if run_as_worker(worker_main):
        return 0
    ap = benchmark_parser(__doc__)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 4], help="micro-batches per step (micro-batch size 1)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=6, help="timed rounds (one step of every variant each)")
    ap.add_argument("--quick", action="store_true", help="seq 512, 4 layers, 2 rounds: a smoke run")
    ap.add_argument("--json", metavar="PATH", help=f"report path (default {results_path(NAME).relative_to(ROOT)}; "
                                                   "--quick: the --out directory)")
    ap.add_argument("--out", metavar="DIR", help="worker logs (default: a temporary directory)")
    ap.add_argument("--timeout", type=float, default=3600.0)
    args = ap.parse_args()
    if args.quick:
        args.seq_len, args.layers, args.steps = 512, 4, 2
    out = Path(args.out or tempfile.mkdtemp(prefix="packed_documents-"))
    opts = {"seq_len": args.seq_len, "layers": args.layers, "hidden": args.hidden, "heads": args.heads,
            "ms": args.ms, "warmup": args.warmup, "steps": args.steps, "plan_cache": str(out / "plans"),
            "profile": {"num_contexts": 3, "warmup": 1, "repeats": 3}}   # the default slice lengths: 8 to L
    ranks = launch_workers(Path(__file__), NUM_STAGES, out, opts, timeout_s=args.timeout)
    _, starts = corpus_documents()
    lengths = np.diff(np.append(starts, starts[-1] + 1))[:-1]
    rows, checks, per_m = [], [], {}
    for m in args.ms:
        keys = [f"m={m} {v}" for v in VARIANTS]
        step = {k: [max(r["times"][k][i] for r in ranks) for i in range(args.steps)] for k in keys}
        med = {k: median(step[k]) for k in keys}
        paired = {(a, b): median([x / y for x, y in zip(step[a], step[b])]) for a in keys for b in keys}
        planning = ranks[0]["planning_ms"][f"m={m}"][args.warmup:]
        share = median([p / s for p, s in zip(planning, step[f"m={m} token per-batch"])])
        pred = ranks[0]["predicted_ms"]
        for k in keys:
            distinct = {tuple(s) for s in ranks[0]["slices"][k]}
            rows.append([str(m), k.split(" ", 1)[1], f"{med[k]:.0f}", f"{median(pred[k]):.0f}" if k in pred else "-",
                         f"{m * args.seq_len / med[k] * 1e3:,.0f}",
                         f"{paired[(f'm={m} stock', k)]:.2f}x", f"{paired[(f'm={m} token fixed', k)]:.2f}x",
                         f"{len(distinct)}: {min(len(s) for s in distinct)}-{max(len(s) for s in distinct)} slices"])
        # the same comparison by the planner's own model: what planning per batch wins on these rows by its account
        predicted_gain = min(median([x / y for x, y in zip(pred[f"m={m} {fixed}"], pred[f"m={m} token per-batch"])])
                             for fixed in ("token fixed", "token fixed (mean docs)"))
        first = [ranks[0]["losses"][k][0] for k in keys]
        agree = max(abs(x - first[0]) / abs(first[0]) for x in first)
        best_fixed = min(paired[(f"m={m} token fixed", f"m={m} token per-batch")],
                         paired[(f"m={m} token fixed (mean docs)", f"m={m} token per-batch")])
        vs_stock = paired[(f"m={m} stock", f"m={m} token per-batch")]
        floor = 1.4 if m == 1 else 1.1
        checks += [{"target": f"m={m}: token per-batch >= {floor}x stock", "value": vs_stock, "met": vs_stock >= floor},
                   {"target": f"m={m}: token per-batch >= 1.05x the best fixed plan", "value": best_fixed,
                    "met": best_fixed >= 1.05},
                   {"target": f"m={m}: planning <= 2% of the step", "value": share, "met": share <= 0.02},
                   {"target": f"m={m}: first-round losses agree (rel <= 1e-5)", "value": agree, "met": agree <= 1e-5}]
        per_m[m] = {"step_ms": step, "median_ms": med, "planning_ms": planning, "planning_share": share,
                    "predicted_ms": {k: pred[k] for k in keys if k in pred},
                    "predicted_gain_over_best_fixed": predicted_gain}
    table = markdown_table(["m", "variant", "step ms", "predicted ms", "tokens/s", "vs stock", "vs token fixed",
                            "slicings used"], rows)
    print("\n".join(table))
    for m in args.ms:
        print(f"m={m}: per-batch over the best fixed plan as the planner predicts it (same rows, same slicings): "
              f"{per_m[m]['predicted_gain_over_best_fixed']:.3f}x")
    print_checks(checks)
    docs = {"count": int(len(lengths)), **{f"p{q}": float(np.percentile(lengths, q)) for q in (10, 50, 90, 99)}}
    print(f"documents: {docs}")
    report = {"opts": opts, "documents": docs, "per_m": per_m, "table": table, "checks": checks,
              "slices": ranks[0]["slices"], "losses": ranks[0]["losses"]}
    path = Path(args.json) if args.json else (out / f"{NAME}.json" if args.quick else results_path(NAME))
    print(f"report: {write_report(report, path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

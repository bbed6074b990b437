"""Command line planner: how to slice sequences for a token-level pipeline, and what it buys.

    ds-terapipe plan --model gpt3-175b --device v100 --stages 48 --seq-len 2048 --micro-batch 1
    ds-terapipe plan --cost cost.json --stages 4 --seq-len 2048 --json
    ds-terapipe simulate --model gpt3-13b --device a100 --stages 8 --seq-len 2048 --microbatches 4 \
        --schedule 1f1b --trace timeline.json --plot timeline.png
    ds-terapipe plan --model gpt3-175b --device v100 --stages 48 --seq-len 2048 --schedule interleaved-1f1b \
        --virtual-stages 2
    ds-terapipe compare --model gpt3-13b --device a100 --stages 8 --seq-len 2048 --microbatches 8
    ds-terapipe presets
    ds-terapipe schedules

``plan`` solves the slicing (``planner.slicing.plan_slicing``) under the analytic cost of a model preset on a
device preset, or under a measured cost file (``--cost``, the format of ``planner/cost.py``), and prints the
slices, the predicted step time with and without slicing, the speedup and the bubble. ``simulate`` runs the
event simulator (``planner.simulate``) on the planned slicing or on ``--slices``, and can write a Chrome trace
(open in https://ui.perfetto.dev) and a PNG timeline. ``--stages K`` is the pipeline ranks; schedules with
virtual stages (``--virtual-stages V``) cut the model into K*V chunks, placed as the schedule says, and the
timelines keep one row per rank with the actions naming their chunks. ``compare`` plans every registered schedule
at its default chunks per rank for the same model, pipeline and batch and ranks them by predicted step time:
which schedule to write in the config. ``schedules`` prints the table of registered schedules
(``planner.registry``), the same table README shows.

Only the planner is imported (numpy and the standard library; matplotlib only for ``--plot``), never torch or
deepspeed, so the command starts fast. Every mistake a user can make ends in one line on stderr,
``ds-terapipe: error: ...``, naming the argument, the value and the fix, and exit status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from .log import LOG_FORMAT, env_log_level
from .planner._checks import check_int, check_number, too_many_units
from .planner.presets import DEVICE_PRESETS, MODEL_PRESETS, analytic_pipeline_cost, preset_memory_model
from .planner.registry import schedule_names, schedule_table

logger = logging.getLogger(__name__)

__all__ = ["main", "build_parser"]

PROG = "ds-terapipe"
_DEFAULT_GRANULARITY = 8
_GIB = 1024 ** 3


class UsageError(Exception):
    """A user error: printed as one line and exit status 2, never a traceback."""


# --------------------------------------------------------------------------------------------------------------
# Argument parsing

class _Parser(argparse.ArgumentParser):
    """argparse, but its errors become UsageError so every user error reads the same (one line, exit 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; see '{self.prog} --help'")


def _parsed(convert: Callable[[str], Any], noun: str, check: Callable[[Any, str], Any]) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert`` the text, then ``check`` it with the planner's own validator, so the CLI
    and the planner refuse the same values with the same words."""
    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        try:
            return check(value, repr(text))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


_positive_int = _parsed(int, "an integer; pass a whole number >= 1",
                        lambda v, name: check_int(v, name, fix="pass a whole number >= 1"))
#: The largest count of ranks, chunks or micro-batches the CLI takes: beyond it a simulation of the schedule runs
#: for minutes (100,000 micro-batches take seconds) and a mistyped number would look like a hang.
_MAX_COUNT = 100_000


def _check_count(value: int, name: str) -> int:
    check_int(value, name, fix="pass a whole number >= 1")
    if value > _MAX_COUNT:
        raise ValueError(f"{name} = {value} must be <= {_MAX_COUNT:,}; pass a whole number from 1 to {_MAX_COUNT:,}")
    return value


_count = _parsed(int, f"an integer; pass a whole number from 1 to {_MAX_COUNT:,}", _check_count)


def _check_gib(value: float, name: str) -> float:
    """A positive number of GiB whose bytes are finite too (1e308 GiB is not)."""
    check_number(value, name, positive=True, fix="pass e.g. 32")
    if not math.isfinite(value * _GIB):
        raise ValueError(f"{name} = {value:g} GiB is too large to count in bytes; pass e.g. 32, or drop the flag "
                         "for no cap")
    return value


_gib = _parsed(float, "a number; pass e.g. 32", _check_gib)


def _slice_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts; pass e.g. "
                                         "512,512,1024") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} has a slice shorter than 1 token; every slice needs >= 1")
    return values


def _preset_name(presets: dict[str, Any]) -> Any:
    def parse(text: str) -> str:
        return text.lower() if text.lower() in presets else text  # choices then names the valid ones
    return parse


def _add_planning_args(p: argparse.ArgumentParser, schedule: bool = True) -> None:
    """The pipeline, cost and search arguments; ``schedule``: also ``--schedule`` / ``--virtual-stages`` (compare
    plans every schedule at its own chunks per rank, so it has neither)."""
    g = p.add_argument_group("pipeline and cost model")
    g.add_argument("--model", type=_preset_name(MODEL_PRESETS), choices=list(MODEL_PRESETS),
                   help="model preset for the analytic cost (see 'ds-terapipe presets')")
    g.add_argument("--device", type=_preset_name(DEVICE_PRESETS), choices=list(DEVICE_PRESETS),
                   help="device preset for the analytic cost")
    g.add_argument("--cost", metavar="FILE.json",
                   help="measured cost file (format: docs/cost_format.md); replaces --model/--device. An engine "
                        "plan-cache file (terapipe-plan-<key>.json under terapipe.plan_cache) is read too: its "
                        "\"cost\" entry, the costs the engine profiled")
    g.add_argument("--stages", type=_count, metavar="K",
                   help="pipeline stages, i.e. ranks (implied by a cost file with a \"stages\" list or "
                        "\"num_stages\": its chunks / V)")
    g.add_argument("--seq-len", type=_positive_int, required=True, metavar="L", help="tokens per sequence")
    g.add_argument("--micro-batch", type=_count, default=1, metavar="B",
                   help="sequences per micro-batch (default 1)")
    g.add_argument("--microbatches", type=_count, default=1, metavar="M",
                   help="micro-batches per step and pipeline (default 1)")
    if schedule:
        g.add_argument("--schedule", choices=schedule_names(), default="gpipe",
                       help="pipeline schedule (default gpipe; see 'ds-terapipe schedules')")
        g.add_argument("--virtual-stages", type=_count, default=None, metavar="V",
                       help="chunks per rank (default: the schedule's, 1 for gpipe/1f1b, 2 for the others); the "
                            "model is cut into K*V chunks placed as the schedule says, and a --cost file describes "
                            "chunks")
    g.add_argument("--vocab", type=_positive_int, metavar="V",
                   help="replace the --model preset's vocabulary (e.g. 256000): the embedding and LM head grow")
    g.add_argument("--window", type=_positive_int, metavar="W",
                   help="sliding-window attention of W keys on the --model preset's layers (Mistral's): a slice's "
                        "attention stops growing with its prefix past W")
    g.add_argument("--attention-chunk", type=_positive_int, metavar="C",
                   help="chunked attention of C tokens on the --model preset's layers (Llama 4's "
                        "attention_chunk_size): a query sees the earlier keys of its own chunk only")
    g.add_argument("--full-every", type=_positive_int, metavar="K",
                   help="with --window or --attention-chunk: full attention on every K-th layer, the window or "
                        "chunks on the others (Gemma 2: 2, Gemma 3: 6, transformers' sliding_window_pattern; "
                        "Llama 4: 4)")
    g.add_argument("--sequence-parallel", type=_count, default=1, metavar="N",
                   help="N sequence-parallel ranks inside each stage split every slice's tokens (Ulysses; with "
                        "--model): compute and activations / N, two all-to-alls per attention layer and direction "
                        "over the device preset's link; N must divide the heads (planner/sequence.py)")
    b = p.add_argument_group("balanced stages (with --model)")
    b.add_argument("--balance", action="store_true",
                   help="choose layer boundaries and slicing together (embedding and head costed); print the "
                        "partition report: busy time per rank, imbalance, speedup over the naive layout")
    b.add_argument("--vocab-parallel", action="store_true",
                   help="also cost the LM head split over the ranks (vocabulary parallelism, with its per-slice "
                        "collectives); implies --balance and plans that layout")
    s = p.add_argument_group("slicing search")
    s.add_argument("--granularity", type=_positive_int, default=None, metavar="G",
                   help=f"slice lengths are multiples of G, which must divide --seq-len (default "
                        f"{_DEFAULT_GRANULARITY}; smaller: finer plans, slower planning)")
    s.add_argument("--max-slices", type=_positive_int, metavar="N", help="at most N slices")
    s.add_argument("--memory-gb", type=_gib, metavar="X",
                   help="activation memory cap per device in GiB (weights and optimizer state excluded); "
                        "needs --model")
    s.add_argument("--split-batch", action="store_true",
                   help="also split each micro-batch into equal sub-batches (TeraPipe section 3.4)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("-v", "--verbose", action="count", default=0, help="log planner progress (-vv: debug)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Plan and simulate token-level (TeraPipe) pipeline slicing.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{plan,simulate,compare,presets,schedules}")
    plan = sub.add_parser("plan", help="find the fastest slicing and its predicted speedup",
                          description="Find the fastest slicing of sequences for a pipeline and print it with the "
                                      "predicted step time, with and without slicing.")
    _add_planning_args(plan)
    plan.set_defaults(func=_cmd_plan)
    sim = sub.add_parser("simulate", help="simulate a planned or given slicing; write trace and timeline",
                         description="Simulate a schedule under the cost model for the planned slicing (or "
                                     "--slices) and print makespan, bubble and units in flight per stage.")
    _add_planning_args(sim)
    sim.add_argument("--slices", type=_slice_list, metavar="S1,S2,...",
                     help="simulate this slicing instead of planning one (must sum to --seq-len)")
    sim.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (Perfetto, chrome://tracing)")
    sim.add_argument("--plot", metavar="OUT.png", help="write a PNG timeline (needs matplotlib)")
    sim.set_defaults(func=_cmd_simulate)
    cmp = sub.add_parser("compare", help="plan every schedule for the same pipeline and rank them",
                         description="Plan every registered schedule at its default chunks per rank for the same "
                                     "model, pipeline and batch, and print them fastest first: predicted step, "
                                     "speedup over its own unsliced run, bubble and (with --model) activation "
                                     "memory. Schedules the cost, the sizes or --memory-gb rule out are listed "
                                     "with why.")
    _add_planning_args(cmp, schedule=False)
    cmp.set_defaults(func=_cmd_compare, schedule=None, virtual_stages=None)
    pre = sub.add_parser("presets", help="list model and device presets",
                         description="List the model and device presets of the analytic cost model.")
    pre.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    pre.add_argument("-v", "--verbose", action="count", default=0, help=argparse.SUPPRESS)
    pre.set_defaults(func=_cmd_presets)
    sch = sub.add_parser("schedules", help="list the pipeline schedules (--schedule NAME)",
                         description="List the registered schedules: placement, bubble, memory, deferred W "
                                     "default. The README's table is this output.")
    sch.add_argument("-v", "--verbose", action="count", default=0, help=argparse.SUPPRESS)
    sch.set_defaults(func=_cmd_schedules)
    return parser


# --------------------------------------------------------------------------------------------------------------
# From arguments to a cost model

def _load_cost(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The PipelineCost the arguments describe and a JSON-safe description of where it came from."""
    from .planner.cost import PipelineCost

    if args.cost is None:
        for flag, value in (("--model", args.model), ("--device", args.device), ("--stages", args.stages)):
            if value is None:
                raise UsageError(f"{flag} is required without --cost; pass {flag} "
                                 + ("K" if flag == "--stages" else "NAME (see 'ds-terapipe presets')")
                                 + " or use a measured --cost FILE.json")
        num_layers = MODEL_PRESETS[args.model].num_layers
        v = _virtual_stages(args)
        if args.stages * v > num_layers:
            if v == 1:
                raise UsageError(f"--stages {args.stages} exceeds the {num_layers} layers of {args.model}; use "
                                 f"--stages <= {num_layers}")
            raise UsageError(f"--stages {args.stages} x --virtual-stages {v} = {args.stages * v} chunks exceeds the "
                             f"{num_layers} layers of {args.model} (a chunk needs a layer); use --stages x "
                             f"--virtual-stages <= {num_layers}")
        cost = analytic_pipeline_cost(_model_spec(args), args.device, args.stages * v)
        source = {"kind": "analytic", "model": args.model, "device": args.device, **_window_source(args)}
        if args.sequence_parallel > 1:
            cost = _sequence_parallel(args, cost, v)
            source["sequence_parallel"] = args.sequence_parallel
        return cost, source

    if args.sequence_parallel > 1:
        raise UsageError(f"--sequence-parallel {args.sequence_parallel} needs --model NAME (the all-to-alls are "
                         "costed from its layers and width); a --cost file holds one rank's times: drop one of them")

    if args.vocab is not None:
        raise UsageError(f"--vocab {args.vocab} changes a --model preset; a --cost file already holds its head's "
                         "cost: drop --vocab or use --model")
    for flag, value in (("--window", args.window), ("--attention-chunk", args.attention_chunk),
                        ("--full-every", args.full_every)):
        if value is not None:
            raise UsageError(f"{flag} {value} changes a --model preset's attention; a --cost file's times were "
                             f"measured on the model's own layers, windows included: drop {flag} or use --model")
    if args.device is not None:
        logger.warning("--device %s is not used with --cost %s (the measured file is the device)",
                       args.device, args.cost)
    if args.model is not None and args.memory_gb is None:
        logger.warning("--model %s is only used with --memory-gb; with --cost %s the file gives the times",
                       args.model, args.cost)
    obj, entry = _read_cost_file(args)
    where = f"--cost {args.cost}" + (" (its \"cost\" entry)" if entry else "")
    if args.stages is None and "num_stages" not in obj and not isinstance(obj.get("stages"), list):
        raise UsageError(f"--stages is required: {where} has one \"points\" list for every stage and "
                         "no \"num_stages\"; pass --stages K")
    v = _virtual_stages(args)
    chunks = _file_chunks(obj)
    if v > 1 and args.stages is not None and chunks is not None and chunks != args.stages * v:
        raise UsageError(_chunks_mismatch(args, chunks, v))
    try:
        cost = PipelineCost.from_dict(obj, num_stages=None if args.stages is None else args.stages * v)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{where}: {_one_line(exc)}") from None
    if cost.num_chunks % v:
        raise UsageError(f"--cost {args.cost} describes {cost.num_chunks} stages, not a multiple of --virtual-stages "
                         f"{v}: with virtual stages a cost file gives one entry per chunk (ranks x {v}); profile "
                         "per chunk or pass --virtual-stages 1")
    _warn_extrapolation(args, obj)
    source = {"kind": "measured", "file": str(Path(args.cost))}
    return cost, ({**source, "entry": "cost"} if entry else source)


def _read_cost_file(args: argparse.Namespace) -> tuple[dict[str, Any], bool]:
    """The cost object of --cost and whether it is the "cost" entry of an engine plan-cache file (which holds
    "key", "plan", "cost", "stage_meta": ``runtime/planning/plan_cache.py``), read as the file's own costs."""
    from .planner.cost import CostFileError, read_cost_json

    try:
        obj = read_cost_json(args.cost)
    except CostFileError as exc:
        raise UsageError(f"--cost {args.cost}: {exc.reason}") from None
    if not isinstance(obj, dict):
        raise UsageError(f"--cost {args.cost}: the top level is a JSON {type(obj).__name__}, not an object; write "
                         "{\"points\": [...]} or {\"stages\": [...]} (see docs/cost_format.md)")
    if not ("plan" in obj and "cost" in obj and "points" not in obj and "stages" not in obj):
        return obj, False
    cost = obj["cost"]
    if cost is None:
        raise UsageError(f"--cost {args.cost} is an engine plan-cache file whose \"cost\" is null (its plan was not "
                         "profiled); pass the plan-cache file of a run with \"slices\": \"auto\", or a cost file")
    if not isinstance(cost, dict):
        raise UsageError(f"--cost {args.cost} is an engine plan-cache file whose \"cost\" is a JSON "
                         f"{type(cost).__name__}, not an object; pass a terapipe-plan-<key>.json or a cost file")
    if "layer_kinds" in cost:
        raise UsageError(f"--cost {args.cost} is a layer-partition cache file (terapipe-partition-<key>.json): its "
                         "\"cost\" holds per-layer-kind times, not per-stage ones; pass the terapipe-plan-<key>.json "
                         "next to it, or a cost file")
    plan = obj["plan"] if isinstance(obj["plan"], dict) else {}
    profiled = f" (profiled for {plan['schedule']})" if isinstance(plan.get("schedule"), str) else ""
    _note_once(args, logging.INFO, f"--cost {args.cost} is an engine plan-cache file: planning from its \"cost\" "
                                   f"entry{profiled}")
    return cost, True


def _file_chunks(obj: dict[str, Any]) -> int | None:
    """How many chunks a cost object times by itself (its "stages" list or its "num_stages"); None when the
    count comes from --stages (or the value is invalid, which ``PipelineCost.from_dict`` then reports)."""
    if isinstance(obj.get("stages"), list):
        return len(obj["stages"])
    n = obj.get("num_stages")
    return n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else None


def _chunks_mismatch(args: argparse.Namespace, chunks: int, v: int) -> str:
    """A cost file of ``chunks`` chunks for --stages p of a schedule placing v chunks per rank, said the way
    compare says it: the file times chunks, the schedule needs p x v of them; and what to do."""
    from .planner.registry import get_schedule

    p = args.stages
    what = f"--schedule {args.schedule}" + (f" --virtual-stages {v}" if args.virtual_stages is not None else "")
    fixes = [f"profile {v} chunks per rank ({p * v} in all)"]
    if chunks % v == 0:
        try:
            get_schedule(args.schedule).placement(chunks // v, v)
            n = chunks // v
            fixes.append(f"pass --stages {n} to plan {n} rank{'s' if n > 1 else ''} x {v} chunks from this file")
        except ValueError:
            pass
    fixes.append(f"plan it with {'--stages ' + str(chunks) + ' ' if chunks != p else ''}--schedule 1f1b "
                 "(one chunk per rank)")
    return (f"--cost {args.cost} times {chunks} chunks, not {p} ranks x {v}: {what} places {v} chunks on each of "
            f"the --stages {p} ranks, so it needs a cost of {p} x {v} = {p * v} chunks; "
            + ", ".join(fixes[:-1]) + f" or {fixes[-1]}")


def _warn_extrapolation(args: argparse.Namespace, obj: dict[str, Any]) -> None:
    """One warning when --seq-len goes past what the cost file measured: past its longest slice (the unsliced
    run is one slice of --seq-len tokens), or past its longest context for a last slice of its shortest measured
    length. The stage measured least decides; the planner's own warning also covers slices shorter than measured."""
    stages = obj["stages"] if isinstance(obj.get("stages"), list) else [obj]
    ranges = []
    for st in stages:
        points = st.get("points") or obj.get("points") or []
        ranges.append((max(p["slice"] for p in points), max(p.get("context", 0) for p in points),
                       min(p["slice"] for p in points)))
    longest, context = min(r[0] for r in ranges), min(r[1] for r in ranges)
    shortest = max(r[2] for r in ranges)
    if args.seq_len <= longest and args.seq_len - shortest <= context:
        return
    _note_once(args, logging.WARNING,
               f"--seq-len {args.seq_len} is beyond --cost {args.cost}: its longest measured slice is {longest} "
               f"tokens and its longest context {context}, so the plan extrapolates the times past them; profile "
               f"slices and context up to {args.seq_len} tokens for a reliable plan")


def _note_once(args: argparse.Namespace, level: int, message: str) -> None:
    """Log ``message`` once per command: compare loads the cost once per schedule (``args.noted``, which its
    per-schedule copies share)."""
    noted = getattr(args, "noted", None)
    if noted is not None:
        if message in noted:
            return
        noted.add(message)
    logger.log(level, message)


def _model_spec(args: argparse.Namespace) -> Any:
    """The --model preset with --vocab and --window / --full-every applied."""
    from .planner.presets import resolve_model

    if args.window is not None and args.attention_chunk is not None:
        raise UsageError(f"--window {args.window} and --attention-chunk {args.attention_chunk}: a layer attends "
                         "within a sliding window or within chunks; drop one of them")
    if args.full_every is not None and args.window is None and args.attention_chunk is None:
        raise UsageError(f"--full-every {args.full_every} picks the layers of full attention among windowed (or "
                         "chunked) ones; add --window W or --attention-chunk C (the other layers') or drop "
                         "--full-every")
    return resolve_model(args.model, args.vocab, window=args.window, full_every=args.full_every,
                         attention_chunk=args.attention_chunk)


def _window_source(args: argparse.Namespace) -> dict[str, Any]:
    """--window or --attention-chunk and --full-every for the cost's description (nothing without either)."""
    if args.attention_chunk is not None:
        return {"attention_chunk": args.attention_chunk, "full_every": args.full_every}
    return {} if args.window is None else {"window": args.window, "full_every": args.full_every}


def _sequence_parallel(args: argparse.Namespace, cost: Any, virtual_stages: int) -> Any:
    """The analytic cost with every chunk split over --sequence-parallel ranks; refused when N does not divide the
    heads (a rank takes whole heads)."""
    from .planner.presets import get_device_preset, split_layers
    from .planner.sequence import sequence_parallel_cost

    spec, n = MODEL_PRESETS[args.model], args.sequence_parallel
    kv_heads = spec.num_kv_heads or spec.num_heads
    if kv_heads % n or spec.hidden % n:
        divisors = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0 and spec.hidden % d == 0]
        raise UsageError(f"--sequence-parallel {n} does not divide the {kv_heads} key/value heads of {args.model} "
                         f"(each rank takes whole heads); use one of {divisors}")
    device = get_device_preset(args.device)
    return sequence_parallel_cost(cost, n, split_layers(spec.num_layers, args.stages * virtual_stages),
                                  hidden=spec.hidden, link_gbps=device.link_gbps,
                                  link_latency_ms=device.link_latency_ms, kv_fraction=kv_heads / spec.num_heads)


def _virtual_stages(args: argparse.Namespace) -> int:
    """--virtual-stages, or the schedule's default; refused here (one line) when the schedule cannot place it."""
    from .planner.registry import get_schedule

    spec = get_schedule(args.schedule)
    v = spec.virtual_stages if args.virtual_stages is None else args.virtual_stages
    try:
        spec.placement(args.stages or 1, v)
    except ValueError as exc:
        raise UsageError(f"--schedule {args.schedule} --virtual-stages {v}: {exc}") from None
    return v


def _memory_model(args: argparse.Namespace, num_stages: int, estimate: bool = False) -> Any:
    """The activation-memory model for --memory-gb (None without it), or, with ``estimate``, for reporting the
    estimate whenever --model names the layers (None without --model)."""
    if args.memory_gb is None and not (estimate and args.model is not None):
        return None
    if args.model is None:
        raise UsageError(f"--memory-gb {args.memory_gb:g} needs --model NAME to estimate activation memory (a cost "
                         "file has no layer counts); add --model or drop --memory-gb")
    num_layers = MODEL_PRESETS[args.model].num_layers
    if num_stages > num_layers:
        raise UsageError(f"--memory-gb needs --model {args.model} split over {num_stages} stages, but it has only "
                         f"{num_layers} layers; use a model with at least {num_stages} layers")
    memory = preset_memory_model(args.model, num_stages)
    # a rank of a sequence-parallel stage stashes 1/N of every slice's tokens: the memory of a model 1/N as wide
    return dataclasses.replace(memory, hidden=memory.hidden // args.sequence_parallel)


def _granularity(args: argparse.Namespace) -> int:
    g = _DEFAULT_GRANULARITY if args.granularity is None else args.granularity
    if args.seq_len % g:
        divisor = math.gcd(args.seq_len, g)
        raise UsageError(f"--granularity {g} does not divide --seq-len {args.seq_len}; pick a granularity that "
                         f"divides it (e.g. --granularity {divisor})")
    too_fine = too_many_units(args.seq_len, g, names=("--seq-len ", "--granularity "))
    if too_fine:
        raise UsageError(too_fine)
    return g


def _plan(args: argparse.Namespace, estimate_memory: bool = False) -> tuple[Any, Any, dict[str, Any], float]:
    """(cost, SlicingPlan, cost description, seconds spent building the cost and solving)."""
    from .planner.slicing import plan_slicing

    t0 = time.perf_counter()
    granularity = _granularity(args)
    cost, source = _load_cost(args)
    v = _virtual_stages(args)
    num_ranks = cost.num_chunks // v
    memory = _memory_model(args, num_ranks, estimate_memory)
    if args.memory_gb is not None:
        _check_memory(args, memory, num_ranks, granularity, v)
    plan = plan_slicing(cost, args.seq_len, num_microbatches=args.microbatches, micro_batch_size=args.micro_batch,
                        granularity=granularity, schedule=args.schedule,
                        memory_limit_bytes=None if args.memory_gb is None else args.memory_gb * _GIB,
                        split_batch=args.split_batch, max_slices=args.max_slices, memory=memory,
                        virtual_stages=v, deferred_weight_grads=cost.has_weight_terms)
    return cost, plan, source, time.perf_counter() - t0


def _check_memory(args: argparse.Namespace, memory: Any, num_stages: int, granularity: int,
                  virtual_stages: int = 1) -> None:
    """Refuse a --memory-gb no allowed plan meets, in the CLI's terms (flags and GiB, not the planner's API names
    and bytes), suggesting only changes that lower the estimate. The estimate never grows with the slice count,
    so the most slices allowed give the smallest one; the planner refuses exactly the same cases."""
    from .planner.slicing import memory_shortfall

    short = memory_shortfall(memory, args.memory_gb * _GIB, schedule=args.schedule, num_stages=num_stages,
                             num_microbatches=args.microbatches, micro_batch_size=args.micro_batch,
                             seq_len=args.seq_len, granularity=granularity, max_slices=args.max_slices,
                             split_batch=args.split_batch, virtual_stages=virtual_stages)
    if short is None:
        return
    fixes = ["raise --memory-gb", "add --stages", "raise --sequence-parallel",
             *short.fixes(schedule="use --schedule {}", split_batch="add --split-batch",
                          max_slices="raise --max-slices")]
    raise UsageError(f"--memory-gb {args.memory_gb:g} cannot be met: the smallest activation estimate of any "
                     f"allowed plan is {short.smallest_bytes / _GIB:.3g} GiB on the busiest stage; "
                     f"{', '.join(fixes[:-1])} or {fixes[-1]}")


# --------------------------------------------------------------------------------------------------------------
# Output helpers

def _one_line(exc: BaseException) -> str:
    """The first line of an exception's message (schedule errors append a rank x step grid)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _json_default(x: Any) -> Any:
    if hasattr(x, "tolist"):  # numpy scalars and arrays
        return x.tolist()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def _print_json(obj: dict[str, Any]) -> None:
    print(json.dumps(obj, default=_json_default))


def _runs(values: Sequence[int]) -> str:
    """``64 64 64 72`` -> ``3x64 72``: a long slicing stays readable."""
    out: list[str] = []
    k = 0
    while k < len(values):
        j = k
        while j < len(values) and values[j] == values[k]:
            j += 1
        out.append(f"{j - k}x{values[k]}" if j - k > 1 else str(values[k]))
        k = j
    return " ".join(out)


def _describe(source: dict[str, Any], num_stages: int, virtual_stages: int = 1) -> str:
    chunks = f" ({virtual_stages} chunks each)" if virtual_stages != 1 else ""
    if source["kind"] == "analytic":
        window = ""
        kind = ("window", "window") if source.get("window") is not None else \
            ("attention_chunk", "attention chunks of") if source.get("attention_chunk") is not None else None
        if kind is not None:
            full = source.get("full_every")
            window = f" ({kind[1]} {source[kind[0]]}" + (f", full attention every {full} layers)" if full else ")")
        return f"{source['model']}{window} on {num_stages} x {source['device']}{chunks} (analytic cost)"
    return f"{num_stages} stages{chunks}, measured cost {source['file']}"


def _plan_lines(plan: Any, source: dict[str, Any], seconds: float) -> list[str]:
    split = ""
    if len(plan.batch_splits) > 1:
        split = f", split into {len(plan.batch_splits)} sub-batches of {plan.batch_splits[0]}"
    lines = [
        f"pipeline:    {_describe(source, plan.num_stages, plan.virtual_stages)}, {plan.schedule}, "
        f"seq_len {plan.seq_len}, "
        f"{plan.num_microbatches} micro-batch(es) of {plan.micro_batch_size}{split}",
        f"slices:      {plan.num_slices} of granularity {plan.granularity}: {_runs(plan.slices)}",
        f"             --slices {','.join(map(str, plan.slices))}",
        f"step time:   {plan.predicted_ms:.4g} ms sliced vs {plan.unsliced_ms:.4g} ms unsliced: "
        f"speedup {plan.speedup:.2f}x, bubble {100 * plan.bubble_fraction:.1f}%",
    ]
    if plan.memory_bytes is not None:
        lines.append(f"memory:      ~{plan.memory_bytes / _GIB:.3g} GiB activations + KV cache on the busiest stage")
    lines.append(f"planned in {seconds:.2f} s")
    return lines


# --------------------------------------------------------------------------------------------------------------
# Commands

def _layouts(args: argparse.Namespace) -> tuple[Any, Any, Any, dict[str, Any], float]:
    """--balance / --vocab-parallel: (Layouts, the chosen layout's chunk costs, its plan, source, seconds)."""
    from .planner.partition import analytic_layouts

    flag = "--vocab-parallel" if args.vocab_parallel else "--balance"
    if args.cost is not None or args.model is None or args.device is None or args.stages is None:
        raise UsageError(f"{flag} needs per-layer costs: pass --model NAME --device NAME --stages K (a --cost file "
                         "has per-stage costs only)")
    for other, given in (("--memory-gb", args.memory_gb), ("--split-batch", args.split_batch),
                         ("--sequence-parallel", args.sequence_parallel > 1)):
        if given:
            raise UsageError(f"{other} is not supported with {flag}; drop one of them")
    t0 = time.perf_counter()
    v = _virtual_stages(args)
    layouts = analytic_layouts(_model_spec(args), args.device, args.stages, args.seq_len,
                               vocab_parallel=args.vocab_parallel, num_microbatches=args.microbatches,
                               micro_batch_size=args.micro_batch, granularity=_granularity(args),
                               schedule=args.schedule, virtual_stages=v, max_slices=args.max_slices)
    chosen = layouts.chosen
    source = {"kind": "analytic", "model": args.model, "device": args.device, "vocab": args.vocab,
              **_window_source(args), "vocab_parallel": args.vocab_parallel, "parts": list(chosen.parts)}
    return layouts, chosen.cost, chosen.plan, source, time.perf_counter() - t0


def _cmd_plan(args: argparse.Namespace) -> int:
    layouts = None
    if args.balance or args.vocab_parallel:
        layouts, _, plan, source, seconds = _layouts(args)
    else:
        _, plan, source, seconds = _plan(args)
    if args.json:
        _print_json({**plan.to_dict(), "plan_seconds": seconds, "cost": source,
                     **({} if layouts is None else {"partition": layouts.to_dict()})})
    else:
        lines = _plan_lines(plan, source, seconds)
        print("\n".join(lines[:-1] + ([] if layouts is None else ["partition:"] + layouts.report_lines())
                        + lines[-1:]))
    return 0


def _cost_file_chunks(args: argparse.Namespace) -> int | None:
    """How many chunks a --cost file times (its "stages" list, its "num_stages", else one shared "points" list
    for each of the --stages ranks); None without a file or when the file cannot be read (``_plan`` says why)."""
    if args.cost is None:
        return None
    try:
        obj, _ = _read_cost_file(args)
    except UsageError:
        return None
    chunks = _file_chunks(obj)
    return args.stages if chunks is None else chunks


def _cmd_compare(args: argparse.Namespace) -> int:
    """Every schedule planned for the same pipeline, fastest first; the ones that cannot run listed with why.

    Each schedule runs at its default chunks per rank (``ScheduleSpec.virtual_stages``), so the analytic cost is
    built per schedule (K or K x 2 chunks); a --cost file fixes the chunk count, and the schedules whose chunks
    per rank do not fit it are listed as refused (with the reason) rather than silently planned on another model.
    A --memory-gb cap refuses the schedules that cannot meet it the same way."""
    from .planner.registry import get_schedule

    if args.balance or args.vocab_parallel:
        flag = "--vocab-parallel" if args.vocab_parallel else "--balance"
        raise UsageError(f"{flag} is not supported by compare (each schedule would get its own layer boundaries); "
                         f"compare without it, then 'ds-terapipe plan {flag} --schedule NAME' for the one you pick")
    args.noted = set()   # a note about the cost file is logged once, not once per schedule
    chunks = _cost_file_chunks(args)
    rows, refused, source = [], [], None
    for name in schedule_names():
        v = get_schedule(name).virtual_stages
        one = argparse.Namespace(**{**vars(args), "schedule": name, "virtual_stages": None})
        try:
            if chunks is not None and (chunks % v or (args.stages is not None and args.stages * v != chunks)):
                raise UsageError(f"--cost {args.cost} times {chunks} chunks, not {args.stages or 'K'} ranks x {v}: "
                                 f"profile {v} chunk(s) per rank to compare {name}")
            _, plan, source, seconds = _plan(one, estimate_memory=True)
        except (UsageError, ValueError) as exc:
            refused.append({"schedule": name, "virtual_stages": v, "reason": _one_line(exc)})
            continue
        rows.append({**plan.to_dict(), "plan_seconds": seconds})
    if not rows:
        raise UsageError("no schedule can be planned for these arguments: "
                         + "; ".join(f"{r['schedule']}: {r['reason']}" for r in refused))
    rows.sort(key=lambda r: r["predicted_ms"])
    if args.json:
        _print_json({"cost": source, "plans": rows, "refused": refused})
        return 0
    first = rows[0]
    lines = [f"pipeline:    {_describe(source, first['num_stages'])}, seq_len {first['seq_len']}, "
             f"{first['num_microbatches']} micro-batch(es) of {first['micro_batch_size']}",
             "",
             f"{'schedule':<17} {'v':>2} {'slices':>6} {'step ms':>9} {'unsliced':>9} {'speedup':>8} "
             f"{'bubble':>7} {'memory GiB':>10}"]
    for r in rows:
        memory = "-" if r.get("memory_bytes") is None else f"{r['memory_bytes'] / _GIB:.3g}"
        lines.append(f"{r['schedule']:<17} {r['virtual_stages']:>2} {len(r['slices']):>6} "
                     f"{r['predicted_ms']:>9.4g} {r['unsliced_ms']:>9.4g} {r['speedup']:>7.2f}x "
                     f"{100 * r['bubble_fraction']:>6.1f}% {memory:>10}")
    lines += [f"{r['schedule']:<17} {r['virtual_stages']:>2} refused: {r['reason']}" for r in refused]
    lines += ["", f"fastest: {first['schedule']} ({100 * (rows[1]['predicted_ms'] / first['predicted_ms'] - 1):.1f}% "
              f"ahead of {rows[1]['schedule']})" if len(rows) > 1 else f"fastest: {first['schedule']}",
              f"             config: \"schedule\": \"{first['schedule']}\", \"virtual_stages\": "
              f"{first['virtual_stages']}, \"slices\": \"auto\"  (planned here: --slices "
              f"{','.join(map(str, first['slices']))})"]
    print("\n".join(lines))
    return 0


def _given_slicing(args: argparse.Namespace) -> None:
    """--slices replaces the search: refuse search options rather than silently ignore them."""
    total = sum(args.slices)
    if total != args.seq_len:
        raise UsageError(f"--slices {','.join(map(str, args.slices))} sums to {total} but --seq-len is "
                         f"{args.seq_len}; make the slices add up to the sequence length")
    for flag, given in (("--granularity", args.granularity is not None), ("--max-slices", args.max_slices),
                        ("--memory-gb", args.memory_gb), ("--split-batch", args.split_batch)):
        if given:
            raise UsageError(f"{flag} only shapes the slicing search and has no effect with --slices; drop one "
                             "of them")


def _write_timelines(args: argparse.Namespace, result: Any, meta: dict[str, Any], title: str
                     ) -> tuple[str | None, str | None]:
    """--trace and --plot; returns the paths written (None where not asked for)."""
    if args.trace is None and args.plot is None:
        return None, None
    from . import trace

    trace_path = plot_path = None
    if args.trace is not None:
        try:
            trace_path = str(trace.events_to_chrome_trace(result.events, args.trace, metadata=meta))
        except OSError as exc:
            raise UsageError(f"--trace {args.trace}: cannot write ({exc.strerror or exc}); pick a writable path") \
                from None
    if args.plot is not None:
        try:
            plot_path = str(trace.plot_timeline(result.events, args.plot, title=title))
        except ImportError:
            raise UsageError(f"--plot {args.plot} needs matplotlib, which is not installed; pip install matplotlib "
                             "(or drop --plot)") from None
        except OSError as exc:
            raise UsageError(f"--plot {args.plot}: cannot write ({exc.strerror or exc}); pick a writable path") \
                from None
    return trace_path, plot_path


def _cmd_simulate(args: argparse.Namespace) -> int:
    from .planner.schedule import build_schedule
    from .planner.simulate import simulate

    plan = layouts = None
    plan_seconds = 0.0
    if (args.balance or args.vocab_parallel) and args.slices is not None:
        raise UsageError("--slices with --balance/--vocab-parallel: the partition is planned together with its "
                         "slicing; drop --slices")
    if args.balance or args.vocab_parallel:
        layouts, cost, plan, source, plan_seconds = _layouts(args)
        slices, batch_splits = list(plan.slices), list(plan.batch_splits)
    elif args.slices is not None:
        _given_slicing(args)
        cost, source = _load_cost(args)
        slices, batch_splits = list(args.slices), [args.micro_batch]
    else:
        cost, plan, source, plan_seconds = _plan(args)
        slices, batch_splits = list(plan.slices), list(plan.batch_splits)
    v = _virtual_stages(args)
    num_ranks = cost.num_chunks // v
    units, batch = args.microbatches * len(batch_splits), batch_splits[0]  # sub-batches are pipeline units too
    t0 = time.perf_counter()
    # a cost measured with deferred weight gradients (its backward leaves them out) runs with the W actions, as
    # the engine that measured it does; without them that work would vanish from the step
    deferred = cost.has_weight_terms
    result = simulate(build_schedule(args.schedule, num_ranks, units, len(slices), deferred, virtual_stages=v),
                      cost, slices, micro_batch_size=batch)
    unsliced = simulate(build_schedule(args.schedule, num_ranks, args.microbatches, 1, deferred, virtual_stages=v),
                        cost, [args.seq_len], micro_batch_size=args.micro_batch)
    sim_seconds = time.perf_counter() - t0
    speedup = unsliced.makespan_ms / result.makespan_ms if result.makespan_ms > 0 else 1.0
    meta = {"schedule": args.schedule, "num_stages": num_ranks, "virtual_stages": v, "seq_len": args.seq_len,
            "slices": slices,
            "num_microbatches": args.microbatches, "micro_batch_size": args.micro_batch,
            "batch_splits": batch_splits, "deferred_weight_grads": deferred, "makespan_ms": result.makespan_ms,
            "step_ms": result.step_ms, "cost": source}
    what = "sub-batches" if len(batch_splits) > 1 else "micro-batch(es)"
    title = (f"{_describe(source, num_ranks, v)}: {args.schedule}, {len(slices)} slices x {units} {what}, "
             f"makespan {result.makespan_ms:.4g} ms, bubble {100 * result.bubble_fraction:.1f}%")
    trace_path, plot_path = _write_timelines(args, result, meta, title)
    if args.json:
        _print_json({**meta, "bubble_fraction": result.bubble_fraction, "busy_ms": list(result.busy_ms),
                     "peak_in_flight": list(result.peak_in_flight), "unsliced_makespan_ms": unsliced.makespan_ms,
                     "speedup": speedup, "plan": None if plan is None else plan.to_dict(),
                     "plan_seconds": plan_seconds, "simulate_seconds": sim_seconds,
                     "trace": trace_path, "plot": plot_path,
                     **({} if layouts is None else {"partition": layouts.to_dict()})})
        return 0
    lines = _plan_lines(plan, source, plan_seconds)[:-1] if plan is not None else [
        f"pipeline:    {_describe(source, num_ranks, v)}, {args.schedule}, seq_len {args.seq_len}, "
        f"{args.microbatches} micro-batch(es) of {args.micro_batch}",
        f"slices:      {len(slices)} given: {_runs(slices)}"]
    lines += [
        f"simulated:   makespan {result.makespan_ms:.4g} ms vs {unsliced.makespan_ms:.4g} ms unsliced: "
        f"speedup {speedup:.2f}x, bubble {100 * result.bubble_fraction:.1f}%"
        + (f"; whole step (cost file's \"step\") {result.step_ms:.4g} ms" if result.tail_ms else ""),
        f"in flight:   peak units per {'stage' if v == 1 else 'rank (chunk-units)'} "
        f"{_runs(list(result.peak_in_flight))}",
        f"busy:        {min(result.busy_ms):.4g}..{max(result.busy_ms):.4g} ms per {'stage' if v == 1 else 'rank'}",
    ]
    lines += ["weights:     deferred W actions (the cost file's backward leaves the weight gradients out)"] \
        if deferred else []
    lines += ["partition:"] + layouts.report_lines() if layouts is not None else []
    lines += [f"trace:       {trace_path} (open in https://ui.perfetto.dev)"] if trace_path else []
    lines += [f"timeline:    {plot_path}"] if plot_path else []
    lines.append(f"planned in {plan_seconds:.2f} s, simulated in {sim_seconds:.2f} s" if plan is not None
                 else f"simulated in {sim_seconds:.2f} s")
    print("\n".join(lines))
    return 0


def _cmd_schedules(args: argparse.Namespace) -> int:
    print(schedule_table())
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    models = {name: {"num_layers": m.num_layers, "hidden": m.hidden, "num_heads": m.num_heads, "vocab": m.vocab,
                     "seq_len": m.seq_len} for name, m in MODEL_PRESETS.items()}
    devices = {name: {f.name: getattr(d, f.name) for f in dataclasses.fields(d) if f.name != "name"}
               for name, d in DEVICE_PRESETS.items()}
    if args.json:
        _print_json({"models": models, "devices": devices})
        return 0
    lines = ["models (--model):", f"  {'name':<10} {'layers':>6} {'hidden':>7} {'heads':>5} {'vocab':>6} "
             f"{'seq_len':>7}"]
    lines += [f"  {n:<10} {m['num_layers']:>6} {m['hidden']:>7} {m['num_heads']:>5} {m['vocab']:>6} "
              f"{m['seq_len']:>7}" for n, m in models.items()]
    # eff: of peak for GEMMs; bw eff: of bandwidth for weight-bound GEMMs; launch ms: the floor of one kernel
    lines += ["devices (--device):", f"  {'name':<6} {'TFLOPS':>7} {'GB/s':>6} {'eff':>5} {'bw eff':>6} "
              f"{'launch ms':>9} {'layer ms':>8} {'link Gb/s':>9} {'link ms':>7}"]
    lines += [f"  {n:<6} {d['peak_tflops']:>7g} {d['mem_bw_gbps']:>6g} {d['efficiency']:>5g} "
              f"{d['bandwidth_efficiency']:>6g} {d['kernel_launch_ms']:>9g} {d['per_layer_overhead_ms']:>8g} "
              f"{d['link_gbps']:>9g} {d['link_latency_ms']:>7g}" for n, d in devices.items()]
    print("\n".join(lines))
    return 0


# --------------------------------------------------------------------------------------------------------------
# Entry point

def _log_level(verbose: int) -> int:
    """-v: INFO, -vv: DEBUG; otherwise DS_TERAPIPE_LOG_LEVEL, else WARNING (planner progress is opt-in)."""
    if verbose:
        return logging.DEBUG if verbose > 1 else logging.INFO
    try:
        return env_log_level(default="WARNING")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _silence_stdout() -> None:
    """After a closed pipe, point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # stdout is not a real file (e.g. captured in-process)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0, or 2 for a user error, whose one-line message is on stderr)."""
    # The CLI is the application: it configures logging (the library only adds a NullHandler). basicConfig does
    # nothing where the embedding program already configured the root logger.
    logging.basicConfig(format=LOG_FORMAT)
    pkg_logger = logging.getLogger("ds_terapipe")
    saved_level = pkg_logger.level
    try:
        args = build_parser().parse_args(argv)
        pkg_logger.setLevel(_log_level(args.verbose))
        return int(args.func(args))
    except UsageError as exc:
        message = str(exc)
    except (ValueError, TypeError, OSError) as exc:  # the planner's own refusals: already name value and fix
        if isinstance(exc, BrokenPipeError):  # e.g. `ds-terapipe plan ... | head -1`: not the user's error
            _silence_stdout()
            return 1
        logger.debug("planner error", exc_info=True)
        message = _one_line(exc)
    except KeyboardInterrupt:
        return 130
    finally:
        pkg_logger.setLevel(saved_level)
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

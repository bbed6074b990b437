"""Cost-based layer partitioning at init: ``TokenPipelineModule(..., partition_method="terapipe")``.

DeepSpeed's ``partition_method`` offers ``uniform``, ``parameters`` and ``type:``; none of them knows that the LM
head of a 50k-256k vocabulary costs as much as several blocks, or that the input embedding writes a dense
gradient per slice, and its ``profile`` method raises NotImplementedError. This module adds two methods that
:class:`~ds_terapipe.runtime.execution.module.TokenPipelineModule` accepts:

* ``"terapipe"``: every rank builds one instance of each distinct layer kind (the embedding and the head
  included; layer specs that differ only in integer arguments, such as a layer index, are one kind), runs the
  sampled input through them once to get each kind's realistic input, and times forward and backward of each
  kind on its own device over the profiler's grid of slice lengths and contexts (``runtime/planning/profile.py``; the
  last layer with the loss when the module samples token ids, ``vocab_size=V``). The points are gathered; global rank 0
  takes each point's median over the ranks,
  fits one cost per kind, and the planner (``planner/partition.py``) chooses the layer boundaries together with
  the slicing to minimise the simulated step. Rank 0 broadcasts the boundaries: one decision for every rank.
  The chosen partition, the naive one and the predicted busy time per rank are logged and, with
  ``plan_cache``, cached next to the slicing plans (``runtime/planning/plan_cache.py``), so a restart skips profiling.
  The settings (sequence length, micro-batches, schedule, ...) come from the DeepSpeed config:
  ``TokenPipelineModule(layers, ..., **ds_terapipe.partition_kwargs(ds_config))``.
  With ``vocab_parallel`` (one chunk per rank) the head is not among the layers partitioned: the layers are timed
  as they run under it (``runtime/features/vocab_cost.py``: no loss on the last one, a split tied embedding without its
  table), every rank also times its head shard's work per slice and the pipeline's links, and the planner charges
  that share and the passes' collectives to every rank (``VocabShareCost``).
* ``"parts:0,5,9,12"``: the user's own boundaries (DeepSpeed's ``parts``: stage s holds layers
  ``parts[s]:parts[s+1]``), checked.

The engine's ``slices: "auto"`` still profiles the chosen stages and plans their slicing as usual (the same
planner, now from whole-stage measurements); the slicing chosen here is logged for comparison.
Profiling builds extra layer instances under ``torch.random.fork_rng``, so the model's own weights are the same
with and without it. The layer kinds are timed in full on every rank (a few layers, not the model).
"""

from __future__ import annotations

import functools
import logging
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.pipe import LayerSpec, TiedLayerSpec

from ...config import parse_terapipe_config
from ...planner.cost import MeasuredCost
from ...planner.partition import VocabShareCost, plan_partition
from ...planner.registry import get_schedule
from ..slicing.context import current_slice, slice_scope
from ..execution.collective import agree_or_raise, mark_collective
from ..planning.plan_cache import CacheEntry, load_cached, partition_cache_entry, store_partition
from ..planning.profile import median_link, median_points, profile_stage
from .vocab_cost import profiling_shard, share_runner, split_embedding_runner, time_links

__all__ = ["TERAPIPE_METHOD", "PartitionSettings", "partition_kwargs", "custom_parts", "layer_kinds"]

logger = logging.getLogger(__name__)

TERAPIPE_METHOD = "terapipe"
_PARTS_PREFIX = "parts:"
_PROFILE_SEED = 4321


@dataclass(frozen=True)
class PartitionSettings:
    """What the cost-based partition plans for: the DeepSpeed config's batch settings and ``terapipe`` section.

    ``seq_len``: tokens per sequence; ``num_microbatches``: ``gradient_accumulation_steps``;
    ``micro_batch_size``: ``train_micro_batch_size_per_gpu``; ``schedule``, ``granularity``, ``max_slices``:
    as the ``terapipe`` keys; ``plan_cache``: the cache directory (None: no cache); ``slice_lengths``,
    ``num_contexts``, ``warmup``, ``repeats``: the profiler's grid (``terapipe.profile``).
    """

    seq_len: int
    num_microbatches: int = 1
    micro_batch_size: int = 1
    schedule: str = "gpipe"
    granularity: int = 8
    max_slices: Optional[int] = None
    plan_cache: Optional[str] = None
    slice_lengths: Optional[tuple[int, ...]] = None
    num_contexts: int = 3
    warmup: int = 1
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("seq_len", "num_microbatches", "micro_batch_size", "granularity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PartitionSettings.{name} = {value!r} must be an int >= 1")
        if self.seq_len % self.granularity:
            raise ValueError(f"PartitionSettings: seq_len = {self.seq_len} is not a multiple of granularity = "
                             f"{self.granularity}; pick a granularity dividing it")
        get_schedule(self.schedule)

    @classmethod
    def from_config(cls, ds_config: dict) -> "PartitionSettings":
        """From a DeepSpeed config dict with a ``terapipe`` section (``seq_len`` required)."""
        cfg = parse_terapipe_config(ds_config)
        if cfg.seq_len is None:
            raise ValueError("partition_method=\"terapipe\" plans for one sequence length: set terapipe.seq_len in "
                             "the DeepSpeed config")
        prof = cfg.profile
        return cls(seq_len=cfg.seq_len, num_microbatches=int(ds_config.get("gradient_accumulation_steps", 1)),
                   micro_batch_size=int(ds_config.get("train_micro_batch_size_per_gpu", 1)),
                   schedule=cfg.schedule, granularity=cfg.granularity, max_slices=cfg.max_slices,
                   plan_cache=cfg.plan_cache,
                   slice_lengths=None if prof.slice_lengths is None else tuple(prof.slice_lengths),
                   num_contexts=prof.num_contexts, warmup=prof.warmup, repeats=prof.repeats)


def partition_kwargs(ds_config: dict) -> dict[str, Any]:
    """The :class:`TokenPipelineModule` keywords for cost-based partitioning under this DeepSpeed config::

        model = TokenPipelineModule(layers, num_stages=2, loss_fn=..., vocab_size=V,
                                    **ds_terapipe.module_chunk_kwargs(terapipe), **ds_terapipe.partition_kwargs(cfg))
    """
    return {"partition_method": TERAPIPE_METHOD, "partition_settings": PartitionSettings.from_config(ds_config)}


# --------------------------------------------------------------------------------------------------------------
# Layer kinds

def _layer_kind(spec: Any) -> str:
    """Layers of one kind cost the same: same class (and tied forward), same non-integer arguments."""
    if isinstance(spec, LayerSpec):
        args = [repr(a) for a in spec.module_args if isinstance(a, bool) or not isinstance(a, int)]
        kwargs = sorted((k, repr(v)) for k, v in spec.module_kwargs.items() if isinstance(v, bool) or
                        not isinstance(v, int))
        tied = ""
        if isinstance(spec, TiedLayerSpec):
            fn = spec.forward_fn
            tied = f" tied={spec.key} forward={getattr(fn, '__qualname__', repr(fn)) if fn is not None else None}"
        return f"{spec.typename.__module__}.{spec.typename.__qualname__}({', '.join(args)}; {kwargs}){tied}"
    if isinstance(spec, torch.nn.Module):
        shapes = [tuple(p.shape) for p in spec.parameters()]
        return f"module {type(spec).__qualname__} {shapes}"
    return f"callable {getattr(spec, '__qualname__', type(spec).__qualname__)}"


def layer_kinds(specs: Sequence[Any]) -> list[str]:
    """The kind of every layer, in order (what the cost-based partition times once each)."""
    return [_layer_kind(s) for s in specs]


def _runner(spec: Any, device: torch.device, prepare: Optional[Any] = None) -> tuple[Any, list[torch.nn.Parameter]]:
    """A callable ``x -> y`` running one instance of the layer, and its parameters; ``prepare(module)`` changes
    a built instance first (the split input embedding under vocabulary parallelism)."""
    if isinstance(spec, LayerSpec):
        module = spec.build().to(device)
        if prepare is not None:
            prepare(module)
        if isinstance(spec, TiedLayerSpec) and spec.forward_fn is not None:
            fn = spec.forward_fn
            return (lambda x: fn(module, x)), list(module.parameters())
        return module, list(module.parameters())
    if isinstance(spec, torch.nn.Module):
        return spec, list(spec.parameters())
    return spec, []


def _with_loss(run: Any, loss_fn: Any, labels: torch.Tensor) -> Any:
    """The last layer timed with the loss (the softmax is the head's cost too), on the running slice's labels."""
    def run_with_loss(x: Any) -> torch.Tensor:
        ctx = current_slice()
        return loss_fn(run(x), labels if ctx is None else labels[:, ctx.start:ctx.end])
    return run_with_loss


def _profile_kinds(module: "torch.nn.Module", settings: PartitionSettings, device: torch.device,
                   shard: Optional[Any] = None, split: Optional[Any] = None, table: Optional[Any] = None) -> dict:
    """This rank's points per layer kind (``{"kinds": {kind: points}}``), in the cost-file format. With vocabulary
    parallelism (``shard``: this rank's head shard, ``split``: the input embedding split with it, or None) the
    layers run as they will (the last one without the loss, the split embedding without its table) and
    ``"share"`` holds the points of this rank's vocabulary work per slice (``runtime/features/vocab_cost.py``)."""
    specs = module._layer_specs
    kinds = layer_kinds(specs)
    seq_len, batch = settings.seq_len, settings.micro_batch_size
    gen = torch.Generator().manual_seed(_PROFILE_SEED)
    sample = module.sample_input(batch, seq_len, gen)
    labels = module.sample_input(batch, seq_len, gen) if module.vocab_size is not None else None
    x: Any = tuple(t.to(device) for t in sample) if isinstance(sample, tuple) else sample.to(device)
    ids = x if split is not None else None
    runners: dict[str, tuple[Any, list]] = {}
    inputs: dict[str, Any] = {}
    last = kinds[-1]
    points: dict[str, list] = {}

    def profile(run: Any, params: list, stage_input: Any) -> list:
        return profile_stage(run, params, stage_input, seq_len, settings.granularity, batch,
                             slice_lengths=None if settings.slice_lengths is None else list(settings.slice_lengths),
                             num_contexts=settings.num_contexts, warmup=settings.warmup, repeats=settings.repeats)

    with torch.random.fork_rng(devices=[]):   # extra layer instances must not move the model's RNG stream
        for index, (spec, kind) in enumerate(zip(specs, kinds)):
            if kind not in runners:
                prepare = None
                if split is not None and index == split.layer:
                    prepare = functools.partial(split_embedding_runner, split=split, table=table)
                runners[kind] = _runner(spec, device, prepare)
                inputs[kind] = x
            with torch.no_grad(), slice_scope(None):
                x = runners[kind][0](x)
        for kind, (run, params) in runners.items():
            if kind == last and shard is None and module.loss_fn is not None and labels is not None:
                run = _with_loss(run, module.loss_fn, labels.to(device))
            points[kind] = profile(run, params, inputs[kind])
        if shard is None:
            return {"kinds": points}
        if labels is None:
            labels = torch.randint(0, shard.vocab_size, (batch, seq_len), generator=gen)
        run, params = share_runner(shard, labels.to(device), ids, table)
        return {"kinds": points, "share": profile(run, params, x), "hidden": int(x.shape[-1])}


def _naive_ends(kinds: Sequence[str]) -> tuple[int, int]:
    """Layers before the first and after the last of the most frequent kind (the blocks): embedding and head."""
    block = Counter(kinds).most_common(1)[0][0]
    return kinds.index(block), kinds[::-1].index(block)


# --------------------------------------------------------------------------------------------------------------
# Deciding

def _decide_on_rank0(decide: Any) -> Any:
    """``decide()`` on global rank 0, broadcast; if it raises, every rank raises its message together."""
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload = [("ok", decide())]
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            payload = [("error", f"{type(err).__name__}: {err}")]
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status != "ok":
        raise mark_collective(ValueError(f"terapipe partition: planning on global rank 0 failed: {value}"))
    return value


def _cache_entry(module: "torch.nn.Module", settings: PartitionSettings, kinds: list[str],
                 num_chunks: int) -> CacheEntry:
    material = {"kinds": kinds, "num_ranks": module.num_stages, "num_chunks": num_chunks,
                "placement": list(module.placement), "world": dist.get_world_size(),
                "settings": {k: v for k, v in asdict(settings).items() if k != "plan_cache"},
                "loss": getattr(module.loss_fn, "__qualname__", repr(module.loss_fn)),
                "vocab_parallel": None if module.vocab_head_spec is None else
                _layer_kind(module.vocab_head_spec.layer),
                "device": get_accelerator().device_name(), "torch": torch.__version__,
                "threads": torch.get_num_threads()}
    return partition_cache_entry(settings.plan_cache, material)


def _cost_partition(module: "torch.nn.Module", num_chunks: int) -> tuple[tuple[int, ...], dict]:
    """Profile, plan on rank 0, broadcast: the boundaries and the partition report (collective)."""
    settings = module.partition_settings
    if not isinstance(settings, PartitionSettings):
        raise ValueError("partition_method=\"terapipe\" needs partition_settings (sequence length, micro-batches, "
                         "schedule): build the module with **ds_terapipe.partition_kwargs(ds_config), or pass "
                         "partition_settings=PartitionSettings(seq_len=..., ...)")
    if not module.has_sampler():
        raise ValueError("partition_method=\"terapipe\" times each layer kind on a sample input: build the module "
                         "with vocab_size=V or input_sampler=fn")
    num_ranks, v = module.num_stages, module.virtual_stages
    kinds = layer_kinds(module._layer_specs)
    entry = _cache_entry(module, settings, kinds, num_chunks)

    def from_cache() -> Optional[dict]:
        cached = load_cached(entry)
        return None if cached is None else {**cached["plan"], "source": "cache"}

    decided = _decide_on_rank0(from_cache)
    if decided is not None:
        return tuple(decided["parts"]), decided
    device = torch.device(get_accelerator().device_name(module.local_rank))
    shard = split = table = links = None
    if module.vocab_head_spec is not None:
        # its refusals raise alike on every rank, but an out-of-memory building the whole layer on one rank would
        # leave the others in the broadcasts below: every rank learns of it first
        problem = None
        try:
            with torch.random.fork_rng(devices=[]):
                shard, split, table = profiling_shard(module, module.vocab_head_spec, device)
        except Exception as err:  # noqa: BLE001 - raised below, on every rank
            logger.exception("terapipe partition: building the output layer's shard failed on rank %d",
                             dist.get_rank())
            problem = (f"terapipe partition: building the output layer's shard to profile failed (rank "
                       f"{dist.get_rank()}: {type(err).__name__}: {err})")
        agree_or_raise(problem, RuntimeError)
        if num_ranks > 1:
            links = time_links(module, settings.micro_batch_size * settings.seq_len * shard.weight.shape[1],
                               shard.weight.dtype, device, warmup=settings.warmup, repeats=settings.repeats)
    try:
        mine: Any = ("ok", {**_profile_kinds(module, settings, device, shard, split, table), "links": links})
    except Exception as err:  # noqa: BLE001 - every rank learns of it below, none waits in the gather
        logger.exception("terapipe partition: profiling failed on rank %d", dist.get_rank())
        mine = ("error", f"rank {dist.get_rank()}: {type(err).__name__}: {err}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    failed = [g[1] for g in gathered if g[0] != "ok"]
    if failed:
        raise mark_collective(RuntimeError(f"terapipe partition: profiling the layer kinds failed ({failed[0]})"))

    def solve() -> dict:
        points = {kind: median_points([g[1]["kinds"][kind] for g in gathered]) for kind in gathered[0][1]["kinds"]}
        costs = {kind: MeasuredCost(p, where=f"layer kind {kind}") for kind, p in points.items()}
        first, last = _naive_ends(kinds)
        share, stored = None, {}
        if shard is not None:  # the head is not among the layers: every rank pays its share per slice
            share_points = median_points([g[1]["share"] for g in gathered])
            link = median_link([g[1]["links"] for g in gathered])
            head = MeasuredCost(share_points, where="vocabulary-parallel share", position_wise=True)
            share = VocabShareCost(head, num_ranks, gathered[0][1]["hidden"], link_latency_ms=link["latency_ms"],
                                   link_gbps=link["gbps"], bytes_per_element=shard.weight.element_size(),
                                   head_is_shard=True, split_embedding=split is not None)
            last += 1  # plan_partition's naive layout counts the head among the last chunk's pinned layers
            stored = {"vocab_share": share_points, "links": link, "split_embedding": split is not None}
        plan = plan_partition([costs[k] for k in kinds], settings.seq_len, num_ranks=num_ranks,
                              num_microbatches=settings.num_microbatches,
                              micro_batch_size=settings.micro_batch_size, granularity=settings.granularity,
                              schedule=settings.schedule, virtual_stages=v, first=first, last=last,
                              vocab_share=share, max_slices=settings.max_slices)
        report = {**plan.to_dict(), "source": "profiled"}
        store_partition(entry, report, {"layer_kinds": kinds, "points": points, **stored})
        return report

    decided = _decide_on_rank0(solve)
    return tuple(decided["parts"]), decided


def _parse_parts(method: str, num_layers: int, num_chunks: int) -> tuple[int, ...]:
    text = method[len(_PARTS_PREFIX):]
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != num_chunks + 1 or parts[0] != 0 or parts[-1] != num_layers or \
            any(b <= a for a, b in zip(parts[:-1], parts[1:])):
        even = ",".join(str(round(num_layers * c / num_chunks)) for c in range(num_chunks + 1))
        raise ValueError(f"partition_method={method!r}: give {num_chunks + 1} increasing boundaries from 0 to "
                         f"{num_layers} (the layer count), one chunk of >= 1 layer per stage or virtual stage, "
                         f"e.g. \"parts:{even}\"")
    return parts


def custom_parts(module: "torch.nn.Module", method: Union[str, Any], num_chunks: int
                 ) -> Optional[tuple[int, ...]]:
    """The boundaries for ``"terapipe"`` or ``"parts:..."`` (collective for ``"terapipe"``), None for DeepSpeed's
    own methods. Sets ``module.partition_report`` (the chosen and naive layouts; None for other methods)."""
    module.partition_report = None
    if not isinstance(method, str):
        return None
    name = method.lower()
    if name.startswith(_PARTS_PREFIX):
        return _parse_parts(name, len(module._layer_specs), num_chunks)
    if name != TERAPIPE_METHOD:
        return None
    parts, report = _cost_partition(module, num_chunks)
    module.partition_report = report
    if dist.get_rank() == 0:
        logger.info("terapipe partition (%s%s): layers per chunk %s (naive %s), slices %s, predicted %.4g ms vs "
                    "%.4g ms naive (%.3fx), busy ms per rank %s, imbalance %.3f (naive %.3f)", report["source"],
                    ", vocabulary-parallel head: its share on every rank" if report.get("vocab_parallel") else "",
                    report["layers_per_chunk"],
                    [b - a for a, b in zip(report["naive_parts"][:-1], report["naive_parts"][1:])],
                    report["slices"], report["predicted_ms"], report["naive_ms"], report["speedup"],
                    [round(b, 3) for b in report["busy_ms"]], report["imbalance"], report["naive_imbalance"])
    return parts

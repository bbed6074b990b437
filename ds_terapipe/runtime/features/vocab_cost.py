"""What vocabulary parallelism costs each rank, measured at init for the cost-based partition.

With ``vocab_parallel`` and ``partition_method="terapipe"`` the layers DeepSpeed partitions no longer include the
output layer: every rank holds a shard of it and, per (micro-batch, slice), runs ``VF``/``VB`` (its shard's
logits, the softmax statistics, its weight gradient and its part of the hidden-state gradient;
``runtime/features/vocab.py``) and, with a tied head whose input embedding is split, ``EF``/``EB`` (its rows' lookup and
their gradient; ``runtime/features/vocab_embedding.py``). So the partition must weigh the layers as they run under
vocabulary parallelism and add the same share to every rank (``planner/partition.py``'s ``VocabShareCost``):

* :func:`profiling_shard`: this rank's shard, built as the module will build it (rows ``[r*R, (r+1)*R)`` of the
  output layer as given), and whether the tied input embedding will be split with it.
* :func:`split_embedding_runner`: the embedding layer with its token table replaced by the split stand-in, which
  outside a schedule looks up this rank's rows without gradient: the first stage's own work under the split
  (position embeddings and the rest of the layer; no dense (V, H) gradient per slice).
* :func:`share_runner`: the shard's per-slice work, timed by the same profiler as the layers: logits over R rows,
  log-sum-exp and target logit, and in backward the logits' gradient, the shard's weight gradient and the hidden
  gradient (VF + VB's arithmetic); with the split embedding also this rank's lookup and its row gradient (EF, EB).
* :func:`time_links`: one broadcast of a slice's hidden states and one of a single value over the pipeline's
  group, fitted to the (latency, bandwidth) the planner's collective model takes.

The collectives (one broadcast of the hidden states and labels, one small all-reduce, a reduce of the hidden
gradient; with the split embedding a broadcast of ids, a reduce and a broadcast of (B, T, H)) are modelled from
the links, not timed one by one; the planner charges them inside each rank's per-slice compute.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..slicing.context import current_slice
from ..slicing.devices import synchronize
from .vocab_shard import EmbeddingShard, HeadSpec, VocabRows, VocabShardHead, build_full
from .vocab_embedding import EmbeddingSplit, SplitTokenEmbedding, lookup_rows, plan_embedding_split

__all__ = ["link_terms", "profiling_shard", "split_embedding_runner", "share_runner", "time_links"]


def profiling_shard(module: "torch.nn.Module", spec: HeadSpec, device: torch.device
                    ) -> tuple[VocabShardHead, Optional[EmbeddingSplit], VocabRows]:
    """This rank's shard of the output layer (its rows of the layer as built from the spec) and the embedding
    split the module will install, decided as at build with the input embedding assumed on the first stage
    (layer 0 always is; a later tied user is costed as split, and if it lands elsewhere it is not)."""
    full, weight, bias = build_full(spec)
    split = plan_embedding_split(full, spec, module._layer_specs, lambda layer: 0, tuple(weight.shape))
    del full
    head = VocabShardHead(torch.zeros(0, weight.shape[1]), None, weight.shape[0], module.stage_id,
                          module.num_stages, spec)
    with torch.no_grad():
        head.weight = torch.nn.Parameter(head.take_rows(weight).to(device))
        head.bias = None if bias is None else torch.nn.Parameter(head.take_rows(bias).to(device))
    table: VocabRows = head
    if split is not None and not split.tied:  # an untied table's rows: its values do not matter for timing
        table = EmbeddingShard(torch.randn_like(head.weight) * 0.02, head.vocab_size, head.rank, head.num_shards)
    return head, split, table


def split_embedding_runner(layer: torch.nn.Module, split: EmbeddingSplit, table: VocabRows) -> None:
    """Give a profiling instance of the input embedding the split stand-in (in place), as ``install_split`` does."""
    parent_path, _, name = split.path.rpartition(".")
    parent = layer.get_submodule(parent_path) if parent_path else layer
    setattr(parent, name, SplitTokenEmbedding(getattr(parent, name), table))


def share_runner(head: VocabShardHead, labels: torch.Tensor, ids: Optional[torch.Tensor],
                 table: Optional[VocabRows] = None
                 ) -> tuple[Callable[[torch.Tensor], tuple[torch.Tensor, ...]], list[torch.nn.Parameter]]:
    """``hidden (B, T, H) -> outputs`` whose forward and backward do this rank's vocabulary work of one slice
    (labels (B, S) and, for the split embedding, token ids (B, S) are cut to the running slice, looked up in
    ``table``: the head's rows when tied, the untied embedding's own), and its parameters. The arithmetic is
    VF's and VB's (by autograd here, by hand there: the same products)."""
    table = head if table is None else table
    def run(hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx = current_slice()
        lab = labels if ctx is None else labels[:, ctx.start:ctx.end]
        logits = F.linear(hidden, head.weight, head.bias).float()  # (B, T, R)
        if head.num_valid < head.rows:
            logits = logits.masked_fill(torch.arange(head.rows, device=logits.device) >= head.num_valid,
                                        float("-inf"))
        index = lab - head.offset
        in_shard = (index >= 0) & (index < head.num_valid)
        target = logits.gather(-1, index.clamp(0, head.rows - 1).unsqueeze(-1)).squeeze(-1)
        loss = (torch.logsumexp(logits, dim=-1) - torch.where(in_shard, target, 0.0)).sum()
        if ids is None:
            return (loss, )
        part = lookup_rows(table, ids if ctx is None else ids[:, ctx.start:ctx.end])[0]
        return loss, part  # (), (B, T, H): EF's lookup; its backward is EB's row gradient
    params = list(head.parameters()) + ([] if table is head or ids is None else list(table.parameters()))
    return run, params


def time_links(module: "torch.nn.Module", num_elements: int, dtype: torch.dtype, device: torch.device, *,
               warmup: int = 1, repeats: int = 3) -> dict[str, float]:
    """Milliseconds of a broadcast of one value and of ``num_elements`` over this pipeline's ranks, as the
    (latency per hop, Gbit/s) of ``VocabShareCost``'s model: ceil(log2 p) hops plus 2(p-1)/p of the bytes.
    Collective over the pipeline group: every rank of it calls this at the same point."""
    p = module.num_stages
    group = module._grid.get_pipe_parallel_group()
    src = module._grid.stage_to_global(0)
    small = torch.zeros(1, dtype=dtype, device=device)
    big = torch.zeros(num_elements, dtype=dtype, device=device)

    def once(t: torch.Tensor) -> float:
        synchronize()
        t0 = time.perf_counter()
        dist.broadcast(t, src, group=group)
        synchronize()
        return (time.perf_counter() - t0) * 1e3

    times: dict[str, list[float]] = {"small": [], "big": []}
    for rep in range(warmup + repeats):
        for name, t in (("small", small), ("big", big)):
            ms = once(t)
            if rep >= warmup:
                times[name].append(ms)
    volume_bits = 2.0 * (p - 1) / p * num_elements * big.element_size() * 8.0
    return link_terms(statistics.median(times["small"]), statistics.median(times["big"]),
                      max(1, math.ceil(math.log2(p))), volume_bits)


def link_terms(small_ms: float, big_ms: float, hops: int, volume_bits: float) -> dict[str, float]:
    """(latency per hop, Gbit/s) from the median times of a broadcast of one value and of ``volume_bits``.

    The big message's own time is the difference of the two; where that is under a tenth of the big one's time (a
    fast link, or a stall among the small one's samples) it says nothing, and a near-zero difference would make the
    link nearly infinitely fast and every vocabulary collective free: the whole time is taken then, a lower bound
    on the link's speed."""
    per_ms = big_ms - small_ms if big_ms - small_ms >= 0.1 * big_ms else big_ms
    return {"latency_ms": small_ms / hops, "gbps": volume_bits / (max(per_ms, 1e-6) * 1e6)}

"""Sequence parallelism inside pipeline stages (Ulysses), as the planner sees it: what a slice costs on a stage
whose N sequence-parallel ranks split its tokens, what a rank holds, and which pipeline x sequence x data layout
of a world is fastest under a memory cap.

With degree N every rank of a stage's sequence group holds 1/N of each slice's tokens: the position-wise layers run
on that share, and attention runs on the whole slice for 1/N of the heads after an all-to-all (queries, keys and
values in; the output back), so a slice's compute is the unsplit stage's divided by N and each attention layer adds
two all-to-alls per direction. Per rank each all-to-all sends (N-1)/N of its share: queries and outputs of B x T/N
x H values, keys and values of B x T/N x H x (kv heads / heads) each. The p2p between stages carries each rank's
token share (1/N of the activations) to its peer. Activations and the KV carry are 1/N per rank; the parameters
are replicated over the sequence group, their gradients averaged over it as over the data replicas, and the
optimizer state sharded over both (ZeRO 1 over data x sequence ranks, as DeepSpeed's Ulysses arranges it).

:class:`SequenceParallelCost` wraps a chunk's cost with that arithmetic, so ``plan_slicing`` and ``simulate`` plan a
sequence-parallel pipeline unchanged; :func:`plan_layouts` enumerates the layouts of a world and plans each.
The engine runs it as this arithmetic has it (:mod:`ds_terapipe.runtime.slicing.sequence`: queries, keys and
values in one all-to-all, the output in another); with ``slices: "auto"`` it plans from each rank's measured
share instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Optional, Sequence

import numpy as np

from .cost import ArrayLike, ChunkCostView, PipelineCost, StageCost, comm_time_ms
from .roofline import DeviceSpec, TransformerSpec

__all__ = ["LayoutEstimate", "SequenceParallelCost", "block_params", "plan_layouts", "sequence_parallel_cost"]


class SequenceParallelCost(ChunkCostView):
    """A chunk's cost when its ``degree`` sequence-parallel ranks split every slice's tokens (see the module
    docstring); ``layers`` attention layers in the chunk, ``kv_fraction`` = kv heads / heads."""

    def __init__(self, chunk: StageCost, degree: int, *, layers: int, hidden: int, link_gbps: float,
                 link_latency_ms: float = 0.005, kv_fraction: float = 1.0, bytes_per_element: int = 2) -> None:
        if degree < 1:
            raise ValueError(f"sequence-parallel degree {degree} must be >= 1")
        super().__init__(chunk)
        self.degree, self.layers, self.hidden = int(degree), int(layers), int(hidden)
        self.link_gbps, self.latency = float(link_gbps), float(link_latency_ms)
        self.kv_fraction, self.bytes_per_element = float(kv_fraction), int(bytes_per_element)

    def all_to_all_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        """The all-to-alls of one direction (forward or backward) of a slice, over every attention layer."""
        n = self.degree
        if n == 1:
            return np.zeros(np.broadcast_shapes(np.shape(slice_len), np.shape(batch)))
        share = np.asarray(batch, float) * np.asarray(slice_len, float) / n * self.hidden   # values per tensor
        values = share * (2.0 + 2.0 * self.kv_fraction)   # queries and output, keys and values
        sent = values * self.bytes_per_element * (n - 1) / n
        return self.layers * comm_time_ms(2 * self.latency * (n - 1), self.link_gbps, sent)

    def forward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.chunk.forward_ms(slice_len, context, batch)) / self.degree + \
            self.all_to_all_ms(slice_len, batch)

    def backward_ms(self, slice_len: ArrayLike, context: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.chunk.backward_ms(slice_len, context, batch)) / self.degree + \
            self.all_to_all_ms(slice_len, batch)

    def weight_ms(self, tokens: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.chunk.weight_ms(tokens, batch)) / self.degree

    def comm_ms(self, slice_len: ArrayLike, batch: ArrayLike = 1) -> Any:
        return np.asarray(self.chunk.comm_ms(slice_len, batch)) / self.degree   # each rank's token share

    def covers(self, slice_len: ArrayLike, context: ArrayLike, batch: Optional[ArrayLike] = None) -> bool:
        return self.chunk.covers(slice_len, context, batch)

    def cache_key(self) -> Hashable:
        return ("sequence-parallel", self.chunk.cache_key(), self.degree, self.layers, self.hidden, self.link_gbps,
                self.latency, self.kv_fraction, self.bytes_per_element)


def sequence_parallel_cost(cost: PipelineCost, degree: int, layers: Sequence[int], *, hidden: int,
                           link_gbps: float, link_latency_ms: float = 0.005, kv_fraction: float = 1.0,
                           bytes_per_element: int = 2) -> PipelineCost:
    """``cost`` with every chunk split over ``degree`` sequence-parallel ranks; ``layers``: attention layers per
    chunk."""
    if len(layers) != cost.num_chunks:
        raise ValueError(f"layers has {len(layers)} entries but the cost has {cost.num_chunks} chunks")
    return PipelineCost([SequenceParallelCost(st, degree, layers=n, hidden=hidden, link_gbps=link_gbps,
                                              link_latency_ms=link_latency_ms, kv_fraction=kv_fraction,
                                              bytes_per_element=bytes_per_element)
                         for st, n in zip(cost.stages, layers)], meta=cost.meta, step=cost.step, vocab=cost.vocab)


def block_params(spec: TransformerSpec) -> float:
    """Parameters of one block: its Linears' weights (``TransformerSpec.linears``; norms and biases left out)."""
    return float(sum(k * n for k, n in spec.linears))


@dataclass(frozen=True)
class LayoutEstimate:
    """One layout of the world: ``stages`` x ``sequence`` x ``data`` ranks, its plan and what a rank holds."""

    stages: int
    sequence: int
    data: int
    slices: tuple[int, ...]
    step_ms: float
    tokens_per_s: float
    activation_bytes: float
    model_state_bytes: float
    fits: bool

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def plan_layouts(spec: TransformerSpec, device: str | DeviceSpec, world: int, *, micro_batches: int,
                 memory_cap_bytes: float, sequence_link_gbps: float, schedule: str = "1f1b",
                 granularity: int = 1024, max_slices: Optional[int] = None, activation_factor: float = 34.0,
                 param_bytes: int = 2, optimizer_bytes: int = 12) -> list[LayoutEstimate]:
    """Every pipeline x sequence x data layout of ``world`` ranks (sequence degrees dividing the kv heads and the
    width, stages dividing the layers), each planned for ``spec.seq_len`` tokens with ``micro_batches`` per
    replica under the memory left by the model states (``memory_cap_bytes`` per rank: the planner then needs enough
    slices); fastest first, layouts that cannot fit marked ``fits=False`` (planned without the cap).
    ``activation_factor``: ``MemoryModel``'s (34 without recomputation, ~2 with every layer checkpointed)."""
    from .presets import analytic_pipeline_cost, split_layers
    from .slicing import MemoryModel, plan_slicing

    kv_heads = spec.num_kv_heads or spec.num_heads
    out = []
    for stages in (p for p in range(1, world + 1) if world % p == 0 and spec.num_layers % p == 0):
        for sequence in (n for n in range(1, world // stages + 1)
                         if (world // stages) % n == 0 and kv_heads % n == 0 and spec.hidden % n == 0):
            data = world // (stages * sequence)
            layers = split_layers(spec.num_layers, stages)
            cost = sequence_parallel_cost(analytic_pipeline_cost(spec, device, stages, lm_head=False), sequence,
                                          layers, hidden=spec.hidden, link_gbps=sequence_link_gbps,
                                          kv_fraction=kv_heads / spec.num_heads)
            # a rank stashes 1/N of every slice's tokens: the memory of a model 1/N as wide
            memory = MemoryModel(tuple(layers), spec.hidden // sequence, param_bytes, activation_factor)
            states = max(layers) * block_params(spec) * (2 * param_bytes + optimizer_bytes / (data * sequence))
            kw = dict(num_microbatches=micro_batches, granularity=granularity, schedule=schedule,
                      max_slices=max_slices)
            fits = memory_cap_bytes > states
            try:
                plan = plan_slicing(cost, spec.seq_len, memory=memory,
                                    memory_limit_bytes=memory_cap_bytes - states if fits else None, **kw)
            except ValueError:   # the cap cannot be met with any slicing
                plan, fits = plan_slicing(cost, spec.seq_len, **kw), False
            activations = memory.peak_bytes(schedule=schedule, num_stages=stages, num_microbatches=micro_batches,
                                            micro_batch_size=1, num_splits=1, seq_len=spec.seq_len,
                                            num_slices=len(plan.slices))
            tokens = micro_batches * data * spec.seq_len / (plan.predicted_ms / 1e3)
            out.append(LayoutEstimate(stages, sequence, data, tuple(plan.slices), float(plan.predicted_ms),
                                      float(tokens), float(activations), float(states),
                                      fits and activations + states <= memory_cap_bytes))
    return sorted(out, key=lambda e: (not e.fits, -e.tokens_per_s))

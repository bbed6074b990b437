"""One micro-batch of a stage cut into n equal slices, run and timed as the engine runs a stage (slice context, KV
buffers, backwards later slices first): what ``slice_overhead.py`` and ``gpu_slices.py`` measure."""
from __future__ import annotations

import time
from typing import Any

import torch

#: ``sliced``: weight gradients in the backward, a device sync after every slice (per-slice times);
#: ``fused``: deferred weight gradients, one W pass over the micro-batch (one GEMM per Linear);
#: ``per-slice W``: deferred, W computed slice by slice; ``unsynced``: not deferred, no per-slice sync;
#: ``in-gemm``: as ``unsynced``, each Linear's weight gradient added into ``.grad`` inside its GEMM (the engine's
#: way where nothing hooks the accumulation; needs ``enable_fused_grad_accumulation`` on the stage)
VARIANTS = ("sliced", "fused", "per-slice W", "unsynced", "in-gemm")


def bounds(seq_len: int, n: int) -> list[tuple[int, int]]:
    return [(i * seq_len // n, (i + 1) * seq_len // n) for i in range(n)]


def run_variant(stage: torch.nn.Module, x0: torch.Tensor, n: int, variant: str) -> dict[str, Any]:
    """One micro-batch in n slices: milliseconds of F, B and W (per slice for ``sliced``, totals otherwise)."""
    from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope
    from ds_terapipe.runtime.slicing.deferred import WeightGradStash
    from ds_terapipe.runtime.slicing.devices import synchronize
    seq_len = x0.shape[1]
    deferred = variant in ("fused", "per-slice W")
    per_slice = variant == "sliced"
    state = MicroBatchState(0, seq_len, n)
    state.weight_stash = WeightGradStash() if deferred else None
    state.fuse_grad_accumulation = variant == "in-gemm"
    for p in stage.parameters():
        p.grad = None
    marks: list[float] = []   # host times after device syncs: per slice for ``sliced``, per phase otherwise

    def mark() -> None:
        synchronize()
        marks.append(time.perf_counter())

    outs = []
    mark()
    for i, (a, b) in enumerate(bounds(seq_len, n)):
        x = x0[:, a:b].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, a, b, state)):
            outs.append(stage(x))
        if per_slice:
            mark()
    if not per_slice:
        mark()
    for y in reversed(outs):
        y.backward(torch.full_like(y, 1e-3))
        if per_slice:
            mark()
    del outs
    if not per_slice:
        mark()
    if variant == "fused":
        state.weight_stash.flush()
    elif variant == "per-slice W":
        for i in range(n):
            params, grads = state.weight_stash.compute(slice_index=i)
            if params:
                torch.autograd.backward(params, grads)
    mark()
    ms = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
    if per_slice:
        return {"F": ms[:n], "B": ms[n:2 * n][::-1], "W": ms[2 * n]}   # B per slice in token order
    return {"F": ms[0], "B": ms[1], "W": ms[2]}


def _micro_batch(stage: torch.nn.Module, x0: torch.Tensor, n: int) -> None:
    """One not-deferred micro-batch in n slices (F in order, B later slices first), with no device sync."""
    from ds_terapipe.runtime.slicing.context import MicroBatchState, SliceContext, slice_scope
    seq_len = x0.shape[1]
    state = MicroBatchState(0, seq_len, n)
    outs = []
    for i, (a, b) in enumerate(bounds(seq_len, n)):
        x = x0[:, a:b].detach().requires_grad_()
        with slice_scope(SliceContext(0, i, a, b, state)):
            outs.append(stage(x))
    for y in reversed(outs):
        y.backward(torch.full_like(y, 1e-3))


def graphed_ms(stage: torch.nn.Module, x0: torch.Tensor, n: int, replays: int = 5) -> float:
    """The not-deferred micro-batch in n slices captured as one CUDA graph: median milliseconds of a replay.

    What a stage would cost with no host in the way (no kernel launches from Python): the ceiling of capturing a
    slice's kernels. Warmed up on a side stream, as graph capture requires; the gradients live in the graph's pool.
    """
    from ds_terapipe.runtime.slicing.devices import synchronize
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            for p in stage.parameters():
                p.grad = None
            _micro_batch(stage, x0, n)
    torch.cuda.current_stream().wait_stream(side)
    for p in stage.parameters():
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _micro_batch(stage, x0, n)
    took = []
    for _ in range(replays + 1):
        synchronize()
        start = time.perf_counter()
        graph.replay()
        synchronize()
        took.append((time.perf_counter() - start) * 1e3)
    del graph
    for p in stage.parameters():
        p.grad = None
    return sorted(took[1:])[len(took[1:]) // 2]

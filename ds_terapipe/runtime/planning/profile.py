"""On-device profiling: how long this stage's layers take per slice, measured where they run.

The planner needs, per stage, forward and backward time of a slice of ``s`` tokens after a prefix of ``c``
tokens (attention cost grows with the prefix). :func:`profile_stage` times that over a small grid of
``(s, c)`` points on this rank's own device; with deferred weight gradients it also times each slice's deferred
weight-gradient pass, which :func:`weight_cost` fits per slice and per token. :func:`measure_costs` runs it on
every stage, adds what the rest of a step costs (:mod:`ds_terapipe.runtime.planning.step_profile`: optimizer, gradient
reductions, sync, p2p) and gathers everything into one :class:`~ds_terapipe.planner.cost.PipelineCost` on global
rank 0, which plans (:mod:`ds_terapipe.runtime.planning.plan`). :func:`recheck_costs` re-times one slice length against
costs from the plan cache.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ...planner.cost import PipelineCost
from ...planner.refit import measured_over_predicted
from ..execution.p2p import as_tuple
from ..execution.stage import PipelineStage
from ..slicing.context import MicroBatchState, SliceContext, cut_tokens, slice_scope
from ..slicing.deferred import WeightGradAccumulator, WeightGradStash
from ..slicing.devices import synchronize
from .slice_check import probe_pass
from .step_profile import measure_step_terms


__all__ = ["MeasuredCosts", "measure_costs", "median_link", "median_points", "profile_stage", "recheck_costs",
           "weight_cost"]


class MeasuredCosts(NamedTuple):
    """Every stage's costs, gathered on global rank 0 (a tuple, so ``cost, meta, seconds = measured`` works)."""

    cost: PipelineCost
    #: per stage (chunk), what the memory model needs: ``{"layers": int, "hidden": int | None, "bytes": int}``
    stage_meta: tuple[dict, ...]
    seconds: float


def _default_lengths(seq_len: int, granularity: int) -> list[int]:
    lengths, s = [], granularity
    while s < seq_len:
        lengths.append(s)
        s *= 2
    lengths.append(seq_len)
    if len(lengths) > 6:  # keep the small end sparse: the planner rarely picks tiny slices
        lengths = [lengths[0]] + lengths[-5:]
    return lengths


def _slice_leaves(stage_input: Any, start: int, end: int, seq_len: int) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """Tokens ``[start, end)`` of the stage input as fresh leaves (floats require grad): what ``run`` takes, and
    the leaves whose gradients the backward computes."""
    leaves = tuple(t.detach().requires_grad_(t.is_floating_point())
                   for t in as_tuple(cut_tokens(stage_input, start, end, seq_len)))
    return (leaves[0] if len(leaves) == 1 else leaves), leaves


def _differentiable(outputs: Any) -> list[torch.Tensor]:
    return [t for t in as_tuple(outputs) if t.is_floating_point() and t.requires_grad]


def _backward(out: list[torch.Tensor], params: list[torch.nn.Parameter], leaves: tuple[torch.Tensor, ...]) -> None:
    """Backward of one slice through ``torch.autograd.grad``: ``.grad`` (and DeepSpeed's hooks) stay untouched."""
    wrt = [p for p in params if p.requires_grad] + [t for t in leaves if t.requires_grad]
    torch.autograd.grad(out, wrt, [torch.ones_like(t) for t in out], allow_unused=True)


def profile_stage(run: Callable[[Any], Any], params: list[torch.nn.Parameter], stage_input: Any, seq_len: int,
                  granularity: int, batch: int, *, slice_lengths: Optional[list[int]] = None, num_contexts: int = 3,
                  warmup: int = 1, repeats: int = 3, deferred: bool = False, burst: Optional[int] = None,
                  clock: Callable[[], float] = time.perf_counter, sequence: Any = None,
                  fused: Sequence[torch.nn.Parameter] = (), lead_in: bool = False) -> list[dict]:
    """Time forward and backward of this stage's layers for slices of length s after a prefix of c tokens.

    Backward uses ``torch.autograd.grad``, so parameter ``.grad`` (and DeepSpeed's gradient hooks) are never
    touched. With ``deferred`` (weight gradients deferred, ``runtime/slicing/deferred.py``) the backward measured is the
    input-gradient part the runtime runs per slice, and each point also gets ``weight_ms``: that slice's
    deferred weight-gradient work, timed after its backward (:func:`weight_cost` fits it; not a cost-file key).
    ``clock`` (seconds) is a parameter so tests can drive the timing. Returns points in the planner's cost-file
    format. ``sequence`` (this rank's SequenceShare under sequence parallelism): each slice runs as the engine runs
    it, this rank's share of its tokens with the all-to-alls around attention (every rank of the sequence group
    profiles the same grid in the same order, so their collectives pair), and a point is a rank's time for the
    whole slice.

    ``burst``: how many copies of a point run back to back between two device syncs (each with its own prefix
    and KV buffers), the time divided by that count. Why: on an accelerator the runtime issues a stage's slices
    one after another without waiting, so the host launches the next slice's kernels while the device runs the
    current ones; a point timed alone from an idle device also pays the host's head start, which for a short
    slice is a large share (measured on one H100: a Llama-70B-shaped layer's 512-token forward 4.2 ms alone
    against 3.0 ms in a run of 16 slices, and the plan that summed such points over-predicted the sliced
    micro-batch by 20-50%). Default: 3 on an accelerator, 1 on a CPU, where nothing runs asynchronously.

    ``lead_in``: one more copy runs first in each phase (forward, backward, W), untimed, and the burst is timed from
    its end to the last copy's end on the device (accelerator events; the host clock on a CPU). The timed copies
    then start with the device already busy, as a slice does in a run of slices, so the burst's start (the sync and
    the host's head start) is not spread over them. Used by ``benchmarks/gpu_slices.py`` to measure whether it
    predicts short slices better than the default; the engine's own profile does not use it.

    ``fused`` (the engine's :meth:`fused_parameters`): the Linears' weights (and biases) whose gradients training
    adds into ``.grad`` inside their GEMMs. The backward is then timed that way, adding into stand-in ``.grad``
    tensors that replace theirs while the profile runs (the real ones are put back untouched), so its points
    include those accumulations; the step profile's per-backward accumulation term leaves these parameters out.
    With ``deferred`` the Linears' gradients go to the W passes instead, so no stand-ins are made (they would be a
    whole set of weight-sized tensors at init for nothing) and nothing is added in place.
    """
    fuse = bool(fused) and not deferred
    with _stand_in_grads(fused if fuse else ()):
        return _profile_points(run, params, stage_input, seq_len, granularity, batch, slice_lengths, num_contexts,
                               warmup, repeats, deferred, burst, clock, sequence, fuse, lead_in)


@contextmanager
def _stand_in_grads(weights: Sequence[torch.nn.Parameter]) -> Iterator[None]:
    """Zeroed ``.grad`` stand-ins for ``weights`` while the profile adds into them; their own put back after."""
    own = [w.grad for w in weights]
    try:
        for w in weights:
            w.grad = torch.zeros_like(w)
        yield
    finally:
        for w, grad in zip(weights, own):
            w.grad = grad


def _profile_points(run: Callable[[Any], Any], params: list[torch.nn.Parameter], stage_input: Any, seq_len: int,
                    granularity: int, batch: int, slice_lengths: Optional[list[int]], num_contexts: int,
                    warmup: int, repeats: int, deferred: bool, burst: Optional[int], clock: Callable[[], float],
                    sequence: Any, fuse: bool, lead_in: bool = False) -> list[dict]:
    lengths = slice_lengths or _default_lengths(seq_len, granularity)
    grid = []
    for length in lengths:
        if length % granularity or length > seq_len or length < 1:
            raise ValueError(f"terapipe.profile.slice_lengths: {length} must be a multiple of granularity "
                             f"{granularity} and <= seq_len {seq_len}")
        free = (seq_len - length) // granularity
        contexts = sorted({round(free * k / max(1, num_contexts - 1)) * granularity for k in range(num_contexts)})
        grid.extend((length, context) for context in contexts)
    samples: dict[tuple[int, int], tuple[list[float], list[float], list[float]]] = {
        point: ([], [], []) for point in grid}
    # W of each slice goes into one running sum per weight, as the runtime's accumulator does (addmm_ into the
    # step's sum, no fresh gradient per slice)
    into = WeightGradAccumulator() if deferred else None
    # Rounds over the whole grid, not a point's repeats back to back: on a shared host a burst of foreign load
    # then spoils one sample of many points, which the median rejects, instead of every sample of a few points,
    # which skews the fitted model and with it the plan (seen: 4 or 13 slices where 6-8 are best).
    first = as_tuple(stage_input)[0]
    if burst is None:
        burst = 1 if first.device.type == "cpu" else 3
    mark, elapsed_ms = _marks(first.device, clock, lead_in)
    for rep in range(warmup + repeats):
        for length, context in grid:
            states = []
            for _ in range(burst + lead_in):
                # the timed slice ends its micro-batch: its backward takes the KV cache's gradient in with one
                # kernel, as every slice's does in training (a cache reaching further would be filled first)
                state = MicroBatchState(0, context + length, 2)
                state.weight_stash = WeightGradStash() if deferred else None
                state.fuse_grad_accumulation = fuse
                if context > 0:
                    lo, hi = (0, context) if sequence is None else sequence.bounds(0, context)
                    with torch.no_grad(), slice_scope(SliceContext(0, 0, 0, context, state, sequence=sequence)):
                        run(cut_tokens(stage_input, lo, hi, seq_len))
                states.append(state)
            lo, hi = (context, context + length) if sequence is None else sequence.bounds(context, context + length)
            units = [_slice_leaves(stage_input, lo, hi, seq_len) for _ in states]
            times = _time_burst(run, params, states, units, length, context, sequence, deferred, into, lead_in,
                                mark, elapsed_ms)
            del units, states   # this point's KV buffers and inputs, before the next point builds its own
            if rep >= warmup:
                for sample, ms in zip(samples[(length, context)], times):
                    sample.append(ms / burst)
    return [{"batch": batch, "slice": length, "context": context, "forward_ms": statistics.median(fwd),
             "backward_ms": statistics.median(bwd), **({"weight_ms": statistics.median(wgt)} if deferred else {})}
            for (length, context), (fwd, bwd, wgt) in samples.items()]


def _marks(device: torch.device, clock: Callable[[], float],
           lead_in: bool) -> tuple[Callable[[], Any], Callable[[Any, Any], float]]:
    """``(mark, elapsed_ms)`` for :func:`_time_burst`: the host clock read after a device sync; with ``lead_in``
    events recorded on the accelerator's current stream (read after the burst's last sync), or on a CPU, where work
    is done when its call returns, the host clock without a sync."""
    if not lead_in:
        def synced() -> float:
            synchronize()
            return clock()
        return synced, lambda a, b: (b - a) * 1e3
    if device.type == "cpu":
        return clock, lambda a, b: (b - a) * 1e3
    accelerator = get_accelerator()

    def mark() -> Any:
        event = accelerator.Event(enable_timing=True)
        event.record()
        return event
    return mark, lambda a, b: a.elapsed_time(b)


def _time_burst(run: Callable[[Any], Any], params: list[torch.nn.Parameter], states: list[MicroBatchState],
                units: list[tuple[Any, Any]], length: int, context: int, sequence: Any, deferred: bool,
                into: Optional[WeightGradAccumulator], lead_in: bool, mark: Callable[[], Any],
                elapsed_ms: Callable[[Any, Any], float]) -> tuple[float, float, float]:
    """One point's burst, phase by phase (its copies' forwards, backwards, then W passes): each phase's total ms
    (W 0 without ``deferred``). A phase runs from the previous phase's end mark to its own; with ``lead_in`` it
    runs from the end of its first copy instead, that copy untimed (``profile_stage``'s ``lead_in``)."""
    outs: list[list[torch.Tensor]] = []
    spans: list[tuple[Any, Any]] = []
    start = None
    if lead_in:
        synchronize()
    else:
        start = mark()

    def phase(items: Iterable[tuple[Any, ...]], step: Callable[..., Any]) -> None:
        nonlocal start
        for k, item in enumerate(items):
            step(*item)
            if lead_in and k == 0:
                start = mark()
        end = mark()
        spans.append((start, end))
        start = end

    def forward(state: MicroBatchState, unit: tuple[Any, Any]) -> None:
        with slice_scope(SliceContext(0, 1, context, context + length, state, sequence=sequence)):
            outs.append(_differentiable(run(unit[0])))

    phase(zip(states, units), forward)
    phase(zip(outs, units), lambda out, unit: _backward(out, params, unit[1]))
    if deferred:
        phase(((state,) for state in states), lambda state: state.weight_stash.compute(into))
    synchronize()
    times = [elapsed_ms(a, b) for a, b in spans]
    return times[0], times[1], times[2] if deferred else 0.0


def weight_cost(points: list[dict], batch: int) -> tuple[float, float]:
    """``(ms per pass, ms per token)`` of the deferred weight-gradient pass, per sequence, fitted to the
    ``weight_ms`` that :func:`profile_stage` measured with ``deferred``: a W pass over s tokens = a + b * s.

    Why two terms: a W pass is one GEMM per Linear over its tokens, and each GEMM reads (and writes) a
    weight-sized gradient once, so a W per slice costs more at the same token count than one W per micro-batch
    (fitted on the benchmark CPU, a stage of 4 GPT blocks of width 512: 2.5-8 ms per pass beside 0.35 ms per
    token; on one H100, a GPT-3-175B-shaped layer: ~1.5 ms per pass, the weights' read). Least squares over every
    point (context does not matter to W: the Linears see the slice alone); a negative intercept from noise is
    refitted through 0, a negative slope replaced by a constant per slice.
    """
    s = np.array([p["slice"] for p in points], dtype=float)
    w = np.array([p["weight_ms"] for p in points], dtype=float)
    if len(np.unique(s)) >= 2:
        b, a = np.polyfit(s, w, 1)
        if a >= 0 and b >= 0:
            return float(a) / batch, float(b) / batch
        if b < 0:   # noise swamped the slope: a constant per slice
            return float(np.mean(w)) / batch, 0.0
    rate = float(np.sum(w * s) / np.sum(s * s))
    return 0.0, max(rate, 0.0) / batch


def measure_costs(engine: "PipelineStage", stage_input: Optional[dict[int, Any]] = None,
                  seq_len: Optional[int] = None, *, errors_to_caller: bool = False
                  ) -> Union[MeasuredCosts, Exception, None]:
    """Profile every chunk's layers now and gather the costs (collective: every rank calls it).

    Engine init calls it for ``slices: "auto"``. Called again later it tells how far the costs a plan was made
    from have moved: on a shared host the same work can run 10-20% slower a few minutes on, and a prediction
    compared with steps timed later carries that drift as error unless its costs are measured in the same window
    (``benchmarks/pipeline_speedup.py`` re-profiles after its rounds). ``stage_input`` (this rank's chunk inputs
    by chunk id, ``seq_len`` tokens, default ``terapipe.seq_len``) defaults to a fresh probe pass.

    With one chunk per rank the cost model's stages are the ranks; with virtual stages they are the chunks, in
    chunk order (what the planner simulates). Returns ``(PipelineCost, stage_meta, seconds)`` as
    :class:`MeasuredCosts` on global rank 0, None elsewhere. With ``errors_to_caller``, an error of rank 0's
    assembly of the gathered costs (after every rank has left) is returned instead of raised, for the caller to
    hand to every rank (a decision broadcast from rank 0) rather than leave them waiting.
    """
    cfg = engine.terapipe
    seq_len = cfg.seq_len if seq_len is None else seq_len
    if stage_input is None:
        stage_input = probe_pass(engine, seq_len)
    started = time.perf_counter()
    params = list(engine.module.parameters())
    mine = []
    for chunk in engine.local_chunks:
        chunk_input = stage_input[chunk]
        with engine.on_chunk(chunk):
            points = profile_stage(engine.module, params, chunk_input, seq_len, cfg.granularity,
                                   engine.micro_batch_size, slice_lengths=cfg.profile.slice_lengths,
                                   num_contexts=cfg.profile.num_contexts, warmup=cfg.profile.warmup,
                                   repeats=cfg.profile.repeats, deferred=cfg.deferred_weight_grads,
                                   sequence=engine.sequence, fused=engine.fused_parameters())
            weight = {}
            if cfg.deferred_weight_grads:
                per_slice, per_token = weight_cost(points, engine.micro_batch_size)
                weight = {"weight_ms_per_slice": per_slice, "weight_ms_per_token": per_token}
                points = [{k: v for k, v in p.items() if k != "weight_ms"} for p in points]
            first = as_tuple(chunk_input)[0]
            mine.append({"chunk": chunk, "points": points, "weight": weight,
                         "layers": len(engine.module.forward_funcs),
                         "hidden": first.shape[-1] if first.is_floating_point() else None,
                         "bytes": first.element_size() if first.is_floating_point() else 4})
    # The vocabulary links, the step terms' reductions and the gather below block without a deadline: each comes
    # after a barrier that watches the abort flag (the first two inside their functions, after this rank's own
    # timings), so a rank whose profiling raised (a layer, or memory, on any stage: the last stage's head runs the
    # longest slices) stops its peers within seconds, naming it.
    share = _measure_vocab_share(engine, seq_len) if engine.module.vocab_head is not None else None
    terms = measure_step_terms(engine, warmup=cfg.profile.warmup, repeats=cfg.profile.repeats)
    profile_s = time.perf_counter() - started
    engine.barrier("profiling")
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"dp": _first_replica_id(engine), "stage": engine.stage_id, "chunks": mine,
                                      "terms": terms, "share": share})
    if dist.get_rank() != 0:
        return None
    try:
        return _assemble(engine, gathered, profile_s)
    except Exception as err:  # noqa: BLE001 - see errors_to_caller
        if not errors_to_caller:
            raise
        return err


def _assemble(engine: "PipelineStage", gathered: list[Any], profile_s: float) -> MeasuredCosts:
    """Rank 0: the gathered measurements as one cost model (the first replica and sequence rank of each stage)."""
    chunks = sorted((c for g in gathered if g["dp"] == 0 for c in g["chunks"]), key=lambda c: c["chunk"])
    ranks = sorted((g for g in gathered if g["dp"] == 0), key=lambda g: g["stage"])
    stage_meta = [{k: c[k] for k in ("layers", "hidden", "bytes")} for c in chunks]
    hidden = next((m["hidden"] for m in stage_meta if m["hidden"]), None)
    for m in stage_meta:
        m["hidden"] = hidden
    cost = PipelineCost.from_dict({"stages": [{"points": c["points"], **c["weight"],
                                               **_comm_of(ranks[engine.placement[c["chunk"]]]["terms"], hidden,
                                                          max(m["bytes"] for m in stage_meta))}
                                              for c in chunks],
                                   "step": _step_of(ranks, engine.placement),
                                   "vocab": _vocab_of([g["share"] for g in ranks], engine.num_stages)},
                                  num_stages=engine.num_chunks)
    return MeasuredCosts(cost, tuple(stage_meta), profile_s)


def _measure_vocab_share(engine: "PipelineStage", seq_len: int) -> dict[str, Any]:
    """This rank's vocabulary passes per slice, timed like the layers (its shard's logits, softmax statistics and
    gradients; with the split embedding its lookup and row gradient too: ``features/vocab_cost.share_runner``),
    and the pipeline's links for the passes' collectives (collective over the pipeline group).

    Why: with vocabulary parallelism the output layer is not among the chunks' layers; unmeasured, the plan and
    every simulation of the executed schedule would leave out the passes every rank runs per slice."""
    from ..features.vocab_cost import share_runner, time_links   # the feature's probes, used only here

    cfg = engine.terapipe
    head = engine.module.vocab_head
    hidden_size, dtype, device = head.weight.shape[1], head.weight.dtype, head.weight.device
    batch = engine.micro_batch_size
    gen = torch.Generator().manual_seed(1234)
    labels = torch.randint(0, head.vocab_size, (batch, seq_len), generator=gen).to(device)
    ids = labels.roll(1, dims=1) if head.embedding is not None else None
    hidden = torch.randn(batch, seq_len, hidden_size, generator=gen).to(device=device, dtype=dtype)
    run, params = share_runner(head, labels, ids, engine.module.vocab_embed)
    points = profile_stage(run, params, hidden, seq_len, cfg.granularity, batch,
                           slice_lengths=cfg.profile.slice_lengths, num_contexts=1, warmup=cfg.profile.warmup,
                           repeats=cfg.profile.repeats)
    engine.barrier("profiling the vocabulary passes")   # before the broadcasts: they would not see a failed peer
    links = None
    if engine.num_stages > 1:
        links = time_links(engine.module, batch * seq_len * hidden_size, dtype, device, warmup=cfg.profile.warmup,
                           repeats=cfg.profile.repeats)
    return {"points": [{k: p[k] for k in ("batch", "slice", "context", "forward_ms", "backward_ms")} for p in points],
            "links": links, "hidden": int(hidden_size), "bytes": head.weight.element_size(),
            "split_embedding": head.embedding is not None}


def _vocab_of(shares: list[Optional[dict]], num_ranks: int) -> Optional[dict]:
    """The cost file's ``vocab`` object from the pipeline's measured shares (None without vocabulary
    parallelism): each point's median over the ranks (equal shards; one rank's noise does not decide)."""
    if not shares or shares[0] is None:
        return None
    first = shares[0]
    return {"points": median_points([s["points"] for s in shares]), "num_ranks": num_ranks,
            "hidden": first["hidden"], **median_link([s["links"] for s in shares]),
            "bytes_per_element": first["bytes"], "split_embedding": first["split_embedding"]}


def median_points(per_rank: list[list[dict]]) -> list[dict]:
    """Each point's median over the ranks (the same grid everywhere): one rank's noisy sample does not decide."""
    return [dict(same[0], forward_ms=statistics.median(p["forward_ms"] for p in same),
                 backward_ms=statistics.median(p["backward_ms"] for p in same)) for same in zip(*per_rank)]


def _first_replica_id(engine: "PipelineStage") -> int:
    """0 on the ranks whose measurements stand for their stage (data-parallel replica 0 and, under sequence
    parallelism, sequence rank 0: the others measured the same chunks), else 1."""
    sequence_rank = 0 if engine.sequence is None else engine.sequence.rank
    return 0 if engine.grid.data_parallel_id == 0 and sequence_rank == 0 else 1


def median_link(per_rank: list[Optional[dict]]) -> dict[str, float]:
    """The pipeline group's link (``time_links``: latency per hop, Gbit/s) as the ranks' medians; one rank (no
    link measured) gets a link its collectives never use."""
    links = [x for x in per_rank if x is not None]
    if not links:
        return {"latency_ms": 0.0, "gbps": 1.0}
    return {k: statistics.median(x[k] for x in links) for k in ("latency_ms", "gbps")}


#: How a plan-cache hit re-times its slice length: one warm-up round, then three timed ones whose median is kept.
#: Three, not two: a median of two is their mean, and one stall of the host (a sub-millisecond point on a shared
#: CPU, once stalled by 40 ms) would then rescale every cached cost of the chunk 30x.
RECHECK_ROUNDS = {"warmup": 1, "repeats": 3}


def recheck_costs(engine: "PipelineStage", stage_input: dict[int, Any], seq_len: int,
                  cost: dict, slice_len: int) -> Optional[dict[int, dict[str, float]]]:
    """How fast this device runs now relative to ``cost`` (collective): every chunk times slices of
    ``slice_len`` tokens at two contexts once more (:data:`RECHECK_ROUNDS`) and global rank 0 returns,
    per chunk, measured / predicted for forward, backward and (deferred) weight gradients; None elsewhere.

    Why: a plan-cache hit reuses costs profiled in an earlier launch; on a shared host (or another host of the
    same type) the same layers can run 20-30% slower or faster minutes later, and a plan's predicted step is then
    off by that much (measured: -23% through the example trainer). :func:`~ds_terapipe.planner.cost.scaled_cost`
    applies the ratios.
    """
    cfg = engine.terapipe
    params = list(engine.module.parameters())
    mine = []
    for chunk in engine.local_chunks:
        with engine.on_chunk(chunk):
            mine.append((chunk, profile_stage(engine.module, params, stage_input[chunk], seq_len, cfg.granularity,
                                              engine.micro_batch_size, slice_lengths=[slice_len], num_contexts=2,
                                              **RECHECK_ROUNDS, deferred=cfg.deferred_weight_grads,
                                              sequence=engine.sequence, fused=engine.fused_parameters())))
    engine.barrier("re-timing the cached costs")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (_first_replica_id(engine), mine))
    if dist.get_rank() != 0:
        return None
    samples = [(chunk, kind, p["slice"], p["context"], 1, p[key])
               for dp, chunks in gathered if dp == 0 for chunk, points in chunks for p in points
               for kind, key in (("F", "forward_ms"), ("B", "backward_ms"), ("W", "weight_ms")) if key in p]
    return measured_over_predicted(cost, samples, engine.micro_batch_size, per_action=False)


def _comm_of(terms: dict, hidden: Optional[int], element_bytes: int) -> dict:
    """A chunk's ``comm`` (its rank's link to the next rank), with what sizes its messages; {} on the last rank."""
    if terms["latency_ms"] is None:
        return {}
    comm: dict[str, Any] = {"latency_ms": terms["latency_ms"]}
    if terms["gbps"] is not None and hidden:
        comm["gbps"] = terms["gbps"]
        return {"comm": comm, "hidden": hidden, "bytes_per_element": element_bytes}
    return {"comm": comm}


def _step_of(ranks: list[dict], placement: tuple[int, ...]) -> dict:
    """The cost file's ``step`` object from every rank's measured terms (``step_profile.measure_step_terms``)."""
    per_rank = [len([c for c in placement if c == r]) for r in range(len(ranks))]
    return {"action_ms": {"backward": [ranks[r]["terms"]["accumulate_ms"] / per_rank[r] for r in placement]},
            # the rank's step tail: the deferred weight gradients' hand-over to .grad, then the optimizer
            "optimizer_ms": [g["terms"]["optimizer_ms"] + g["terms"].get("handover_ms", 0.0) for g in ranks],
            "grad_reduce_ms": [g["terms"]["grad_reduce_ms"] for g in ranks],
            "tied_reduce_ms": max([g["terms"]["tied_reduce_ms"] for g in ranks if g["terms"]["tied"]], default=0.0),
            "tied_ranks": [g["stage"] for g in ranks if g["terms"]["tied"]],
            "sync_ms": max(g["terms"]["sync_ms"] for g in ranks)}

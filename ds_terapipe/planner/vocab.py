"""Vocabulary passes: where the output layer's collectives go in every rank's stream.

With vocabulary parallelism (``terapipe.vocab_parallel``) the output layer is split by vocabulary rows over the
p ranks of a pipeline (``runtime/features/vocab.py``). Per unit (micro-batch b, slice i) two collectives of all p ranks
run: ``VF(b,i)`` (the last chunk's hidden states reach every rank, each computes its shard's logits, the softmax
statistics are combined, the loss is the unsharded cross entropy) and ``VB(b,i)`` (each rank's shard of the
weight gradient, the hidden-state gradient summed back to the last chunk). On the rank holding the last chunk
C-1 (the last rank with one chunk per rank or looped placement, rank 0 under ``dualpipev``'s V) ``VF(b,i)``
comes right after ``F(C-1,b,i)`` and ``VB(b,i)`` right before ``B(C-1,b,i)``. A collective is a rank's, but an
action names a chunk: every rank writes ``VF``/``VB`` with its last chunk and ``EF``/``EB`` with its first
(:func:`collective_chunk`), so on the anchor's rank they name the anchor chunk, whose buffers they use.

Collectives block until every rank joins, so every rank must meet them in one order, and no rank may wait in
one for a peer that waits on a receive behind it. :func:`add_vocab_passes` places them by time: it dry-runs the
lowered schedule (:func:`~ds_terapipe.planner.verify.replay`, lock-step), gives each collective the time of its
anchor on the last rank (half a step after ``F``, half a step before ``B``) and puts it, on every rank, between
the actions that run before and after that time. Every action then keeps a time larger than everything it
waits for (its receives' sends, the collectives before it), so the streams run without deadlock; ``replay``
checks it (collectives complete once all ranks arrived) and ``validate`` checks the order is one.

With a tied head whose input embedding is split too (``embedding=True``), two more collectives per unit anchor
on chunk 0 (rank 0 in every placement): ``EF(b,i)`` right before ``F(0,b,i)`` (the token ids reach every rank, the
partial lookups
are summed to rank 0, whose forward starts from them) and ``EB(b,i)`` right after ``B(0,b,i)`` (the gradient of
the embedding's output reaches every rank, each adds its rows' weight gradient). They are placed by the same
rule, half a step before and after their anchors. Try it::

    python -c "from ds_terapipe.planner.vocab import *; print(vocab_schedule('1f1b', 3, 2, 2, embedding=True))"
    python -c "from ds_terapipe.planner.vocab import *; print(vocab_schedule('dualpipev', 2, 2, 2, embedding=True))"
"""
from __future__ import annotations

from .schedule import (EB, EF, VB, VF, Action, ActionKind, B, F, Schedule, _make, _trusted, add_communication,
                       build_schedule)
from .verify import collective_chunk, replay

__all__ = ["add_vocab_passes", "vocab_schedule"]


def add_vocab_passes(schedule: Schedule, embedding: bool = False) -> Schedule:
    """``schedule`` (lowered with :func:`add_communication`) with ``VF``/``VB`` on every rank, and ``EF``/``EB``
    with ``embedding`` (the input embedding split too).

    ``VF(b,i)`` for every F of the last chunk, ``VB(b,i)`` for every B of it; ``EF(b,i)`` for every F of chunk 0,
    ``EB(b,i)`` for every B of it (a forward-only schedule gets no VB, EB); the anchors are on the ranks the
    placement puts those chunks on (under ``dualpipev`` both on rank 0). Each rank writes a collective with its
    chunk of :func:`collective_chunk`.
    """
    if any(a.is_collective for st in schedule.stages for a in st):
        return schedule
    lowered = add_communication(schedule)
    steps = replay(lowered).steps
    last_chunk = lowered.num_chunks - 1
    # (time, 0: after its anchor / 1: before it, micro-batch, slice, kind): one order on every rank. Equal times
    # come from one rank's consecutive actions ("after F" sorts before "before B", as on that rank) or from the
    # anchors of chunk 0 and the last chunk at one step (any fixed order: both are between the same neighbours).
    events: list[tuple[float, int, int, int, ActionKind]] = []
    anchors = [(last_chunk, {F: (0.5, 0, VF), B: (-0.5, 1, VB)})]
    if embedding:
        anchors.append((0, {F: (-0.5, 1, EF), B: (0.5, 0, EB)}))
    for chunk, rule in anchors:
        rank = lowered.rank_of(chunk)
        for p, a in enumerate(lowered.stages[rank]):
            if a.chunk == chunk and a.kind in rule:
                shift, side, kind = rule[a.kind]
                events.append((steps[rank][p] + shift, side, a.microbatch, a.slice, kind))
    events.sort(key=lambda e: (e[0], e[1], e[2], e[3], e[4].value))
    streams = []
    for r, stream in enumerate(lowered.stages):
        chunk_of = {k: collective_chunk(lowered, r, k) for k in (VF, VB, EF, EB)}
        out: list[Action] = []
        k = 0
        for p, a in enumerate(stream):
            while k < len(events) and events[k][0] < steps[r][p]:
                out.append(_make(chunk_of[events[k][4]], events[k][4], events[k][2], events[k][3]))
                k += 1
            out.append(a)
        out.extend(_make(chunk_of[e[4]], e[4], e[2], e[3]) for e in events[k:])
        streams.append(tuple(out))
    return _trusted(lowered.name, lowered.num_stages, lowered.num_microbatches, lowered.num_slices, tuple(streams),
                    True, lowered.defers_weights, lowered.weights_per_slice, lowered.virtual_stages,
                    lowered.placement)


def vocab_schedule(name: str, num_stages: int, num_microbatches: int, num_slices: int,
                   deferred_weight_grads: bool = False, embedding: bool = False,
                   virtual_stages: int | None = None) -> Schedule:
    """A registered schedule lowered to what the runtime runs with ``vocab_parallel``: p2p plus vocabulary passes
    (with ``embedding``: the split input embedding's too), on ``num_stages`` ranks with ``virtual_stages`` chunks
    each (None: the schedule's default)."""
    return add_vocab_passes(add_communication(build_schedule(name, num_stages, num_microbatches, num_slices,
                                                             deferred_weight_grads, virtual_stages=virtual_stages)),
                            embedding)

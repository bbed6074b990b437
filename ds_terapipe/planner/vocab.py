"""Vocabulary passes: where the output layer's collectives go in every rank's stream.

With vocabulary parallelism (``terapipe.vocab_parallel``) the output layer is split by vocabulary rows over the
p ranks of a pipeline (``runtime/vocab.py``). Per unit (micro-batch b, slice i) two collectives of all p ranks
run: ``VF(b,i)`` (the last stage's hidden states reach every rank, each computes its shard's logits, the softmax
statistics are combined, the loss is the unsharded cross entropy) and ``VB(b,i)`` (each rank's shard of the
weight gradient, the hidden-state gradient summed back to the last stage). On the last rank ``VF(b,i)`` comes
right after ``F(K-1,b,i)`` and ``VB(b,i)`` right before ``B(K-1,b,i)``.

Collectives block until every rank joins, so every rank must meet them in one order, and no rank may wait in
one for a peer that waits on a receive behind it. :func:`add_vocab_passes` places them by time: it dry-runs the
lowered schedule (:func:`~ds_terapipe.planner.verify.replay`, lock-step), gives each collective the time of its
anchor on the last rank (half a step after ``F``, half a step before ``B``) and puts it, on every rank, between
the actions that run before and after that time. Every action then keeps a time larger than everything it
waits for (its receives' sends, the collectives before it), so the streams run without deadlock; ``replay``
checks it (collectives complete once all ranks arrived) and ``validate`` checks the order is one. Try it::

    python -c "from ds_terapipe.planner.vocab import *; print(vocab_schedule('1f1b', 3, 2, 2))"
"""
from __future__ import annotations

from .schedule import VB, VF, Action, ActionKind, B, F, Schedule, _make, _trusted, add_communication, build_schedule

__all__ = ["add_vocab_passes", "vocab_schedule", "vocab_anchor_violations"]


def add_vocab_passes(schedule: Schedule) -> Schedule:
    """``schedule`` (lowered with :func:`add_communication`; one chunk per rank) with ``VF``/``VB`` on every rank.

    ``VF(b,i)`` for every F of the last stage, ``VB(b,i)`` for every B of it (a forward-only schedule gets no VB).
    Raises ValueError for a schedule with several chunks per rank (not supported yet).
    """
    from .verify import replay  # verify builds on schedule, as this module does

    if not schedule.is_one_chunk_per_rank:
        raise ValueError(f"vocabulary passes need one chunk per rank; schedule {schedule.name!r} has "
                         f"{schedule.virtual_stages} chunks per rank (chunk -> rank {list(schedule.placement or ())}); "
                         "use gpipe or 1f1b with terapipe.vocab_parallel, or turn vocab_parallel off")
    if any(a.is_collective for st in schedule.stages for a in st):
        return schedule
    lowered = add_communication(schedule)
    steps = replay(lowered).steps
    last = lowered.num_stages - 1
    # (time, 0: after its anchor / 1: before it, kind, micro-batch, slice): one order on every rank. Equal times
    # come from one rank's consecutive F and B: "after F" sorts before "before B", as on that rank.
    events: list[tuple[float, int, int, int, ActionKind]] = []
    for p, a in enumerate(lowered.stages[last]):
        if a.kind is F:
            events.append((steps[last][p] + 0.5, 0, a.microbatch, a.slice, VF))
        elif a.kind is B:
            events.append((steps[last][p] - 0.5, 1, a.microbatch, a.slice, VB))
    events.sort(key=lambda e: (e[0], e[1], e[2], e[3]))
    streams = []
    for r, stream in enumerate(lowered.stages):
        out: list[Action] = []
        k = 0
        for p, a in enumerate(stream):
            while k < len(events) and events[k][0] < steps[r][p]:
                out.append(_make(r, events[k][4], events[k][2], events[k][3]))
                k += 1
            out.append(a)
        out.extend(_make(r, e[4], e[2], e[3]) for e in events[k:])
        streams.append(tuple(out))
    return _trusted(lowered.name, lowered.num_stages, lowered.num_microbatches, lowered.num_slices, tuple(streams),
                    True, lowered.defers_weights, lowered.weights_per_slice)


def vocab_anchor_violations(schedule: Schedule) -> list[str]:
    """The last rank's anchors: ``VF(b,i)`` once per unit right after ``F(K-1,b,i)`` (its outputs are the
    hidden states it hands over), ``VB(b,i)`` once per unit before ``B(K-1,b,i)`` and after ``VF(b,i)`` (the
    hidden-state gradient B starts from). Empty when the schedule has no vocabulary passes."""
    last = schedule.num_stages - 1
    stream = schedule.stages[last]
    if not any(a.is_collective for a in stream):
        return []
    out: list[str] = []
    pos: dict[tuple[ActionKind, int, int], int] = {}
    for p, a in enumerate(stream):
        key = (a.kind, a.microbatch, a.slice)
        if key in pos and a.kind in (F, B, VF, VB):
            out.append(f"rank {last} position {p}: {a} is a duplicate")
        pos.setdefault(key, p)
    has_backward = any(a.kind is B for a in stream)
    for b, i in schedule.units():
        f, vf, vb, bw = (pos.get((k, b, i)) for k in (F, VF, VB, B))
        if vf is None:
            out.append(f"rank {last}: {Action(last, VF, b, i)} is missing")
        elif f is None or vf < f:
            out.append(f"rank {last}: {Action(last, VF, b, i)} at position {vf} runs before the forward it hands on")
        if has_backward:
            if vb is None:
                out.append(f"rank {last}: {Action(last, VB, b, i)} is missing")
            elif vf is not None and vb < vf:
                out.append(f"rank {last}: {Action(last, VB, b, i)} at position {vb} runs before "
                           f"{Action(last, VF, b, i)}")
            elif bw is not None and bw < vb:
                out.append(f"rank {last}: {Action(last, B, b, i)} at position {bw} runs before "
                           f"{Action(last, VB, b, i)}, whose hidden-state gradient it needs")
    return out


def vocab_schedule(name: str, num_stages: int, num_microbatches: int, num_slices: int,
                   deferred_weight_grads: bool = False) -> Schedule:
    """A registered schedule lowered to what the runtime runs with ``vocab_parallel``: p2p plus vocabulary passes."""
    return add_vocab_passes(add_communication(build_schedule(name, num_stages, num_microbatches, num_slices,
                                                             deferred_weight_grads, virtual_stages=1)))

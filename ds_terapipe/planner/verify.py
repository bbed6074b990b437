"""Validator and dry run of schedules: the per-chunk rules, FIFO message pairing and deadlock detection.

How: :func:`validate` checks each chunk's own order (and, between chunks on one rank, the local hand-offs);
:func:`match_messages` pairs the k-th receive on a directed rank channel with the k-th send; :func:`replay` runs
all ranks under the runtime's p2p semantics (non-blocking sends, blocking receives, FIFO channels) and, on a
deadlock, prints the whole rank x step grid with the stuck actions marked. Split from ``schedule.py`` (the IR
and its passes), which re-exports these names. Try it::

    python -c "from ds_terapipe.planner.schedule import *; replay(build_schedule('dualpipev', 3, 2, 2))"
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .schedule import (
    _COLLECTIVES, _COMPUTE, _PEER_OFFSET, _RECVS, _SENDS, _SHARD, AG, RL, RS, B, F, RECV_B, RECV_F, SEND_B, SEND_F,
    W, Action, ActionKind, EB, EF, VB, VF, DeadlockError, PairingError, Schedule, ScheduleError, _message_of,
    add_communication, format_grid,
)

logger = logging.getLogger(__name__)

__all__ = ["ReplayResult", "collective_chunk", "collective_violations", "match_messages", "replay",
           "shard_violations", "validate", "vocab_anchor_violations"]

# Messages list at most this many violations; the exception keeps all of them.
_MAX_LISTED = 50


# --------------------------------------------------------------------------------------------- validation


def _raise_if(violations: list[str], cls: type[ScheduleError], what: str) -> None:
    if not violations:
        return
    listed = violations[:_MAX_LISTED]
    more = f"\n  ... and {len(violations) - _MAX_LISTED} more" if len(violations) > _MAX_LISTED else ""
    raise cls(f"{what}: {len(violations)} problem(s)\n  " + "\n  ".join(listed) + more, violations)


def validate(schedule: Schedule) -> None:
    """Check every per-chunk rule and list all violations in one :class:`ScheduleError`.

    Rules: each chunk runs F and B of every unit exactly once; F(c,b,i) after F(c,b,i-1); B(c,b,i) after
    F(c,b,i) and after B(c,b,i+1); with deferred weight gradients, every chunk runs W(c,b,0) once per
    micro-batch after B(c,b,0), or (per slice) W(c,b,i) once per unit after B(c,b,i); with comm, each chunk
    has exactly the messages its neighbours on other ranks need, RECV before and SEND after the compute it
    belongs to. Between two chunks on the same rank there is no message: F(c,b,i) after F(c-1,b,i) and
    B(c,b,i) after B(c+1,b,i) in that rank's stream. With one chunk per rank, chunk = stage = rank.
    Cross-rank order is :func:`replay`'s job.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"validate needs a Schedule, got {type(schedule).__name__}")
    m, n = schedule.num_microbatches, schedule.num_slices
    C, place, one = schedule.num_chunks, schedule.placement, schedule.is_one_chunk_per_rank
    assert place is not None
    deferred, per_slice = schedule.defers_weights, schedule.weights_per_slice

    def remote(c: int, other: int) -> bool:
        return 0 <= other < C and place[other] != place[c]

    needs = {F: lambda c: True, B: lambda c: True, W: lambda c: deferred, RECV_F: lambda c: remote(c, c - 1),
             SEND_F: lambda c: remote(c, c + 1), RECV_B: lambda c: remote(c, c + 1),
             SEND_B: lambda c: remote(c, c - 1)}

    def where(c: int) -> str:
        return f"stage {c}" if one else f"chunk {c} (rank {place[c]})"

    out: list[str] = []
    pos: list[dict[ActionKind, dict[tuple[int, int], int]]] = [{k: {} for k in ActionKind} for _ in range(C)]
    for s, stream in enumerate(schedule.stages):
        for p, a in enumerate(stream):
            c = a.chunk
            if a.kind in _COLLECTIVES or a.kind in _SHARD:
                continue  # checked by collective_violations / shard_violations below
            if a.microbatch >= m or a.slice >= n:
                out.append(f"{where(c)} position {p}: {a} is outside {m} micro-batches x {n} slices")
                continue
            if not needs[a.kind](c):
                peer = a.peer
                if one or not 0 <= peer < C:  # type: ignore[operator]
                    what = "stage" if one else "chunk"
                    out.append(f"{where(c)} position {p}: {a} has no peer ({what} {peer} does not exist)")
                else:
                    out.append(f"{where(c)} position {p}: {a} has no peer: chunk {peer} is on the same rank, a "
                               "local hand-off needs no message")
                continue
            table = pos[c][a.kind]
            if a.unit in table:
                out.append(f"{where(c)} position {p}: {a} is a duplicate (first at position {table[a.unit]})")
            else:
                table[a.unit] = p
    for c in range(C):
        here = pos[c]
        kinds = [k for k in ActionKind
                 if k not in _COLLECTIVES and k not in _SHARD and needs[k](c) and (k in _COMPUTE or schedule.has_comm)]
        down = pos[c - 1] if c > 0 and not remote(c, c - 1) else None      # local hand-off from chunk c-1
        up = pos[c + 1] if c + 1 < C and not remote(c, c + 1) else None    # local gradient from chunk c+1
        for b in range(m):
            for i in range(n):
                u = (b, i)
                for k in kinds:
                    if u not in here[k] and (k is not W or i == 0 or per_slice):
                        out.append(f"{where(c)}: {Action(c, k, b, i)} is missing")
                fp, bp = here[F].get(u), here[B].get(u)
                rules = [(here[F].get((b, i - 1)), c, F, i - 1, fp, F, i), (fp, c, F, i, bp, B, i),
                         (here[B].get((b, i + 1)), c, B, i + 1, bp, B, i)]
                if deferred and (i == 0 or per_slice):
                    rules.append((bp, c, B, i, here[W].get(u), W, i))
                if schedule.has_comm:
                    rules += [(here[RECV_F].get(u), c, RECV_F, i, fp, F, i),
                              (fp, c, F, i, here[SEND_F].get(u), SEND_F, i),
                              (here[RECV_B].get(u), c, RECV_B, i, bp, B, i),
                              (bp, c, B, i, here[SEND_B].get(u), SEND_B, i)]
                if down is not None:
                    rules.append((down[F].get(u), c - 1, F, i, fp, F, i))
                if up is not None:
                    rules.append((up[B].get(u), c + 1, B, i, bp, B, i))
                for first, c1, k1, i1, then, k2, i2 in rules:
                    # Absent actions are reported above; only present pairs in the wrong order are violations.
                    if first is not None and then is not None and first > then:
                        out.append(f"{where(c)}: {Action(c, k2, b, i2)} at position {then} runs before "
                                   f"{Action(c1, k1, b, i1)} at position {first}, which it needs")
    out += collective_violations(schedule) + vocab_anchor_violations(schedule) + shard_violations(schedule)
    _raise_if(out, ScheduleError, f"schedule {schedule.name!r} is invalid")


def shard_violations(schedule: Schedule) -> list[str]:
    """Sharded data parallelism's actions (``AG``/``RL``/``RS``), per rank: a chunk computes only between its
    ``AG`` and the ``RL``/``RS`` that ends the run; a run that computed a gradient ends with ``RS`` (else its
    gradients never reach the shards) and one that computed none with ``RL``; nothing is gathered twice, released
    ungathered, or left gathered at the end. A schedule without them has nothing to check."""
    if not any(a.kind in _SHARD for st in schedule.stages for a in st):
        return []
    out: list[str] = []
    for r, stream in enumerate(schedule.stages):
        gathered: dict[int, bool] = {}   # chunk -> whether its run so far computed a gradient
        for p, a in enumerate(stream):
            c = a.chunk
            if a.kind is AG:
                if c in gathered:
                    out.append(f"rank {r} position {p}: {a} gathers chunk {c}, which is gathered already")
                gathered[c] = False
            elif a.kind is RL or a.kind is RS:
                if c not in gathered:
                    out.append(f"rank {r} position {p}: {a} ends a run of chunk {c}, which is not gathered")
                    continue
                grads = gathered.pop(c)
                if grads and a.kind is RL:
                    out.append(f"rank {r} position {p}: {a} releases chunk {c} after a run that computed gradients; "
                               "it needs RS, or they never reach the shards")
                elif not grads and a.kind is RS:
                    out.append(f"rank {r} position {p}: {a} reduce-scatters chunk {c} after a run that computed no "
                               "gradient; it needs RL")
            elif a.kind in _COMPUTE:
                if c not in gathered:
                    out.append(f"rank {r} position {p}: {a} computes on chunk {c}, whose parameters are not gathered")
                else:
                    gathered[c] = gathered[c] or a.kind is not F
        for c in sorted(gathered):
            out.append(f"rank {r}: chunk {c} is still gathered at the end of the step (no RL/RS after its last run)")
    return out


def collective_violations(schedule: Schedule) -> list[str]:
    """Collectives (``VF``/``VB``, vocabulary parallelism) must reach every rank in one order: rank r's k-th
    collective is every rank's k-th. Their placement against F/B is ``planner/vocab.py``'s rule."""
    seqs = [[a for a in stream if a.kind in _COLLECTIVES] for stream in schedule.stages]
    if not any(seqs):
        return []
    out: list[str] = []
    first = [(a.kind, a.microbatch, a.slice) for a in seqs[0]]
    for r, seq in enumerate(seqs[1:], start=1):
        mine = [(a.kind, a.microbatch, a.slice) for a in seq]
        if len(mine) != len(first):
            out.append(f"rank {r} runs {len(mine)} collective(s), rank 0 runs {len(first)}: every rank of the "
                       "pipeline must join each one")
        for k, (x, y) in enumerate(zip(first, mine)):
            if x != y:
                out.append(f"rank {r}'s collective #{k} is {seq[k]}, rank 0's is {seqs[0][k]}: collectives must run "
                           "in one order on every rank")
                break
    return out


# ------------------------------------------------------------------------------------------------- replay


@dataclass(frozen=True)
class ReplayResult:
    """What a dry run did: the comm-augmented schedule it ran and, per rank, the step of each action.

    A step is a lock-step tick: each rank runs at most one action per step, and a receive runs at least one step
    after its send. ``order[r]`` lists rank r's actions in completion order (its stream, when the run succeeds).
    """

    schedule: Schedule
    order: tuple[tuple[Action, ...], ...]
    steps: tuple[tuple[int, ...], ...]
    num_steps: int


def match_messages(schedule: Schedule) -> tuple[dict[tuple[int, int], tuple[int, int]], ...]:
    """Pair receives with sends by FIFO order per directed channel; raise :class:`PairingError` on a mismatch.

    Returns, per rank, ``{recv position: (sender rank, send position)}``. A receive with no k-th send is left
    out: it waits forever, which :func:`replay` reports as a deadlock. Channel order is fixed by the streams alone
    (each rank runs its stream in order), so mismatches are found before running, wherever they are. Channels
    are between ranks: with several chunks per rank one channel may carry several chunks' messages, and the
    k-th receive must be for the k-th message sent (same kind, chunk and unit).
    """
    K, C, place = schedule.num_stages, schedule.num_chunks, schedule.placement
    assert place is not None
    one = schedule.is_one_chunk_per_rank
    sends: dict[tuple[int, int], list[tuple[int, int, Action]]] = {}
    recvs: dict[tuple[int, int], list[tuple[int, int, Action]]] = {}
    bad: list[str] = []
    for r, stream in enumerate(schedule.stages):
        for p, a in enumerate(stream):
            kind = a.kind
            if kind is F or kind is B or kind is W or kind in _COLLECTIVES or kind in _SHARD:
                continue
            peer = a.chunk + _PEER_OFFSET[kind]
            if not 0 <= peer < C:
                what = f"rank {peer}" if one else f"chunk {peer}"
                bad.append(f"{a} (rank {r}, position {p}) talks to {what}, which does not exist")
            elif place[peer] == r:
                bad.append(f"{a} (rank {r}, position {p}) talks to chunk {peer} on its own rank; a local hand-off "
                           "needs no message")
            elif kind is SEND_F or kind is SEND_B:
                sends.setdefault((r, place[peer]), []).append((r, p, a))
            else:
                recvs.setdefault((place[peer], r), []).append((r, p, a))
    _raise_if(bad, ScheduleError, f"schedule {schedule.name!r} has comm without a peer")
    matches: tuple[dict[tuple[int, int], tuple[int, int]], ...] = tuple({} for _ in range(K))
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        s_list, r_list = sends.get(channel, []), recvs.get(channel, [])
        for k, ((sr, sp, sa), (rr, rp, ra)) in enumerate(zip(s_list, r_list)):
            if (sa.unit != ra.unit) if one else (_message_of(sa) != _message_of(ra)):
                bad.append(f"channel {src}->{dst}: receive #{k} {ra} (rank {rr}, position {rp}) is paired with "
                           f"send #{k} {sa} (rank {sr}, position {sp}); FIFO delivery would hand unit "
                           f"{sa.microbatch}.{sa.slice} to {ra}. Make both ranks use the same unit order")
                break  # later pairs on this channel are shifted by the same mistake
            matches[rr][rp] = (sr, sp)
        else:
            for sr, sp, sa in s_list[len(r_list):]:
                bad.append(f"channel {src}->{dst}: send {sa} (rank {sr}, position {sp}) is never received: rank "
                           f"{dst} posts only {len(r_list)} receive(s) on this channel")
    _raise_if(bad, PairingError, f"schedule {schedule.name!r} mis-pairs messages")
    return matches


def replay(schedule: Schedule) -> ReplayResult:
    """Dry-run all ranks under the runtime's p2p semantics; raise on mis-paired messages or deadlock.

    Sends are non-blocking (buffered isend); a receive blocks until its FIFO-matched send has been issued. The
    comm-free schedule is lowered with :func:`add_communication` first. Per-stage rules are :func:`validate`'s.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"replay needs a Schedule, got {type(schedule).__name__}")
    lowered = add_communication(schedule)
    streams = lowered.stages
    matches = match_messages(lowered)
    _raise_if(collective_violations(lowered), ScheduleError, f"schedule {lowered.name!r} mis-orders collectives")
    K = lowered.num_stages
    # Per rank, the position of its k-th collective: a collective completes once every rank has reached its own.
    coll_pos = [[p for p, a in enumerate(st) if a.kind in _COLLECTIVES] for st in streams]
    coll_index = [{p: k for k, p in enumerate(ps)} for ps in coll_pos]
    steps: list[list[int]] = [[] for _ in range(K)]  # steps[r][p]: step of rank r's p-th action, once done
    done = [0] * K
    while True:
        progressed = False
        for r in range(K):
            stream, mine, match = streams[r], steps[r], matches[r]
            p = done[r]
            while p < len(stream):
                t = mine[p - 1] + 1 if p else 0
                if stream[p].kind in _COLLECTIVES:
                    k = coll_index[r][p]
                    if any(done[q] < coll_pos[q][k] for q in range(K)):
                        break  # some rank has not arrived yet
                    t = max([t] + [steps[q][coll_pos[q][k] - 1] + 1 for q in range(K) if coll_pos[q][k] > 0])
                elif stream[p].kind in _RECVS:
                    src = match.get(p)
                    if src is None or done[src[0]] <= src[1]:
                        break
                    t = max(t, steps[src[0]][src[1]] + 1)
                mine.append(t)
                p += 1
            if p != done[r]:
                done[r], progressed = p, True
        if all(done[r] == len(streams[r]) for r in range(K)):
            break
        if not progressed:
            raise _deadlock(lowered, done, matches)
    num_steps = max((st[-1] + 1 for st in steps if st), default=0)
    logger.debug("replayed %s: %d steps", lowered.name, num_steps)
    return ReplayResult(lowered, streams, tuple(tuple(st) for st in steps), num_steps)


def _deadlock(schedule: Schedule, done: Sequence[int], matches: Sequence[Mapping[tuple[int, int], object]]
              ) -> DeadlockError:
    """Explain who waits for whom, with the whole grid and each blocked rank's action marked."""
    streams, place = schedule.stages, schedule.placement
    assert place is not None
    sends_on: dict[tuple[int, int], int] = {}
    coll_pos = [[p for p, a in enumerate(st) if a.kind in _COLLECTIVES] for st in streams]
    for r, st in enumerate(streams):
        for a in st:
            if a.kind in _SENDS:
                ch = (r, place[a.chunk + _PEER_OFFSET[a.kind]])
                sends_on[ch] = sends_on.get(ch, 0) + 1
    marks: dict[tuple[int, int], str] = {}
    lines = []
    for r, st in enumerate(streams):
        p = done[r]
        if p == len(st):
            continue
        a = st[p]
        if a.kind in _COLLECTIVES:
            k = coll_pos[r].index(p)
            late = [q for q in range(len(streams)) if done[q] < coll_pos[q][k]]
            why = (f"waits in collective #{k} for rank(s) {late}, blocked at "
                   + ", ".join(f"{streams[q][done[q]]} (rank {q})" for q in late))
            marks[(r, p)] = f"{a} {why}"
            lines.append(f"rank {r} blocked at position {p} on {a}: {why}")
            continue
        src = matches[r].get(p)
        peer = place[a.chunk + _PEER_OFFSET[a.kind]]
        if src is None:
            k = sum(1 for x in st[:p] if x.kind in _RECVS and place[x.chunk + _PEER_OFFSET[x.kind]] == peer)
            why = (f"waits for send #{k} on channel {peer}->{r}, but rank {peer} issues only "
                   f"{sends_on.get((peer, r), 0)}: it waits forever")
        else:
            sr, sp = src
            state = "has finished" if done[sr] == len(streams[sr]) else \
                f"is itself blocked at position {done[sr]} on {streams[sr][done[sr]]}"
            why = f"waits for {streams[sr][sp]} (rank {sr}, position {sp}); rank {sr} {state}"
        marks[(r, p)] = f"{a} {why}"
        lines.append(f"rank {r} blocked at position {p} on {a}: {why}")
    msg = (f"schedule {schedule.name!r} deadlocks: every unfinished rank is blocked\n  " + "\n  ".join(lines)
           + "\n" + format_grid(streams, marks))
    return DeadlockError(msg, lines)


# -- the vocabulary passes' anchors (planner/vocab.py places them) ----------------------------------------------
def collective_chunk(schedule: Schedule, rank: int, kind: ActionKind) -> int:
    """The chunk a collective of ``kind`` on ``rank`` is written with: the rank's chunk nearest its anchor.

    A collective belongs to a rank, not to a chunk, but an action names a chunk of the rank that runs it. ``VF``/
    ``VB`` anchor on the last chunk: each rank writes them with its last chunk (on the rank that holds the last
    chunk, that chunk itself, whose buffers ``VB`` reads). ``EF``/``EB`` anchor on chunk 0: each rank's first
    chunk. With one chunk per rank both are the rank."""
    chunks = schedule.chunks_of(rank)
    return chunks[0] if kind in (EF, EB) else chunks[-1]


def vocab_anchor_violations(schedule: Schedule) -> list[str]:
    """The anchors of the vocabulary passes. On the rank of the last chunk C-1: ``VF(b,i)`` once per unit after
    ``F(C-1,b,i)`` (its outputs are the hidden states it hands over), ``VB(b,i)`` once per unit after ``VF(b,i)``
    and before ``B(C-1,b,i)`` (the hidden-state gradient B starts from). On the rank of chunk 0, when the schedule
    has ``EF``: ``EF(b,i)`` once per unit before ``F(0,b,i)`` (the embedding its forward starts from),
    ``EB(b,i)`` once per unit after ``B(0,b,i)`` (the gradient it hands on) and after ``EF(b,i)``. Every
    collective is written with its rank's chunk of :func:`collective_chunk`. Empty when the schedule has no
    vocabulary passes."""
    last = schedule.num_chunks - 1
    if not any(a.is_collective for st in schedule.stages for a in st):
        return []
    out = [f"rank {r} position {p}: {a} is written with chunk {a.chunk}; rank {r} writes {a.kind.value} with its "
           f"chunk {collective_chunk(schedule, r, a.kind)}"
           for r, st in enumerate(schedule.stages) for p, a in enumerate(st)
           if a.is_collective and a.chunk != collective_chunk(schedule, r, a.kind)]
    out += _anchor_violations(schedule, last, (F, VF), (VB, B), "the forward it hands on", "hidden-state gradient")
    if any(a.kind is EF for st in schedule.stages for a in st):
        out += _anchor_violations(schedule, 0, (EF, F), (B, EB), "the embedding it starts from",
                                  "embedding-output gradient")
    return out


def _anchor_violations(schedule: Schedule, chunk: int, forward: tuple[ActionKind, ActionKind],
                       backward: tuple[ActionKind, ActionKind], forward_need: str, backward_need: str) -> list[str]:
    """Per unit on the rank of ``chunk``: ``forward[0]`` before ``forward[1]``, ``backward[0]`` before
    ``backward[1]``, each once (F and B: those of ``chunk``); the collectives among them (VF, VB or EF, EB)
    present for every unit, the backward one after the forward one."""
    (k1, k2), (k3, k4) = forward, backward
    rank = schedule.rank_of(chunk)
    stream = schedule.stages[rank]
    out: list[str] = []
    pos: dict[tuple[ActionKind, int, int], int] = {}
    for p, a in enumerate(stream):
        if a.kind not in (k1, k2, k3, k4) or (not a.is_collective and a.chunk != chunk):
            continue
        key = (a.kind, a.microbatch, a.slice)
        if key in pos:
            out.append(f"rank {rank} position {p}: {a} is a duplicate")
        pos.setdefault(key, p)
    has_backward = any(a.kind is B for a in stream)
    coll_f = k1 if Action(0, k1, 0, 0).is_collective else k2
    coll_b = k3 if Action(0, k3, 0, 0).is_collective else k4

    def act(kind: ActionKind, b: int, i: int) -> Action:
        written = collective_chunk(schedule, rank, kind) if Action(0, kind, 0, 0).is_collective else chunk
        return Action(written, kind, b, i)

    for b, i in schedule.units():
        at = {k: pos.get((k, b, i)) for k in (k1, k2, k3, k4)}
        if at[coll_f] is None:
            out.append(f"rank {rank}: {act(coll_f, b, i)} is missing")
        elif at[k1] is not None and at[k2] is not None and at[k2] < at[k1]:
            out.append(f"rank {rank}: {act(k2, b, i)} at position {at[k2]} runs before "
                       f"{act(k1, b, i)}, {forward_need}")
        if not has_backward:
            continue
        if at[coll_b] is None:
            out.append(f"rank {rank}: {act(coll_b, b, i)} is missing")
        elif at[coll_f] is not None and at[coll_b] < at[coll_f]:
            out.append(f"rank {rank}: {act(coll_b, b, i)} at position {at[coll_b]} runs before "
                       f"{act(coll_f, b, i)}")
        elif at[k3] is not None and at[k4] is not None and at[k4] < at[k3]:
            out.append(f"rank {rank}: {act(k4, b, i)} at position {at[k4]} runs before "
                       f"{act(k3, b, i)}, whose {backward_need} it needs")
    return out

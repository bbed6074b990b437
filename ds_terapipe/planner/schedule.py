"""Schedule IR for token-level pipelines: which stage runs which (micro-batch, slice) unit, in what order.

How data flows: a sequence is cut into ``num_slices`` slices; a *unit* is one (micro-batch ``b``, slice ``i``).
``F(s,b,i)`` on stage ``s`` consumes the activation ``F(s-1,b,i)`` produced and reads the key/value cache of
slices ``< i`` of micro-batch ``b`` on stage ``s``; ``B(s,b,i)`` consumes the gradient from ``B(s+1,b,i)`` and adds
cache gradients that ``B(s,b,i-1)`` will propagate, hence later slices are backwarded first. With deferred weight
gradients (:func:`defer_weights`), ``B`` computes input gradients only and ``W`` actions compute the weight
gradients: either one ``W(s,b,0)`` per micro-batch and stage, after ``B(s,b,0)``, for all its slices, or one
``W(s,b,i)`` per unit right after ``B(s,b,i)`` (``per_slice``). W talks to no other stage.

A schedule is data (the torch.distributed.pipelining pattern): one ordered tuple of :class:`Action` per rank.
With virtual stages a rank holds several *chunks* (``Schedule.placement``: chunk -> rank), an action names its
chunk, and the dependencies above hold per chunk (``c`` for ``s``). Builders live one per module in
``planner/schedules/`` and are registered by name (``planner/registry.py``); :func:`build_schedule` dispatches
through the registry. Builders write compute-only schedules; :func:`add_communication` lowers them to the exact
send/recv streams the runtime executes (messages derived from the placement); ``verify.py`` holds
:func:`validate` (the per-chunk rules) and :func:`replay` (a dry run of all ranks under the runtime's p2p
semantics: non-blocking sends, blocking receives, FIFO channels), re-exported here. Try it::

    python -c "from ds_terapipe.planner.schedule import *; print(build_schedule('1f1b', 3, 2, 2))"
"""
from __future__ import annotations

import contextlib
import enum
import functools
import gc
import importlib
import logging
import operator
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._checks import check_int
from .registry import find_schedule, get_schedule, schedule_names

logger = logging.getLogger(__name__)

__all__ = [
    "SCHEDULES", "Action", "ActionKind", "DeadlockError", "PairingError", "ReplayResult", "Schedule",
    "ScheduleError", "WEIGHTS_PER_SLICE", "add_communication", "build_1f1b", "build_gpipe", "build_schedule",
    "check_placement", "check_sizes", "chunks_on", "defer_weights", "format_grid", "looped_placement",
    "match_messages", "replay", "schedule_from_strings", "stream_strings", "v_placement", "validate",
    "warmup_forwards", "without_weights",
]

_SIZE_FIX = "a pipeline needs at least one stage, micro-batch and slice"
# Grids longer than this elide rows far from any marked action (a K=48 comm stream has ~1500 rows).
_MAX_GRID_ROWS = 300


class ActionKind(str, enum.Enum):
    """What an action does. Values are the short codes used in the printable form of an :class:`Action`."""

    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT = "W"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    VOCAB_F = "VF"
    """Vocabulary-parallel forward of a unit's output layer: a collective of every rank of the pipeline
    (``planner/vocab.py``), in the same order on every rank."""
    VOCAB_B = "VB"
    """Its backward: each rank's shard of the output-layer gradient, the hidden-state gradient summed back."""
    VOCAB_EMBED_F = "EF"
    """Vocabulary-parallel input embedding of a unit (a tied head's embedding, split with it): the token ids reach
    every rank, each looks up its shard's rows, the partial embeddings are summed to the first stage."""
    VOCAB_EMBED_B = "EB"
    """Its backward: the embedding-output gradient reaches every rank, each adds its rows' weight gradient."""
    GATHER = "AG"
    """Sharded data parallelism (``planner/sharding.py``): all-gather the chunk's parameters over the rank's
    data-parallel replicas, which run the identical stream (a collective of the replicas, not of the pipeline).
    Written with micro-batch and slice 0: it belongs to a run of the chunk's actions, not to a unit."""
    RELEASE = "RL"
    """Free the chunk's gathered parameters after a run that computed no gradient (forwards only)."""
    REDUCE_SCATTER = "RS"
    """Reduce-scatter the gradients the run accumulated into each replica's shard, then free the parameters."""

    def __str__(self) -> str:  # str-mixin enums print their qualified name otherwise
        return self.value


F, B, W = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.WEIGHT
SEND_F, RECV_F, SEND_B, RECV_B = ActionKind.SEND_F, ActionKind.RECV_F, ActionKind.SEND_B, ActionKind.RECV_B
_COMPUTE = frozenset({F, B, W})
_SENDS = frozenset({SEND_F, SEND_B})
_RECVS = frozenset({RECV_F, RECV_B})
VF, VB = ActionKind.VOCAB_F, ActionKind.VOCAB_B
EF, EB = ActionKind.VOCAB_EMBED_F, ActionKind.VOCAB_EMBED_B
# Collectives among all ranks of a pipeline: not p2p (no peer), not per-chunk compute.
_COLLECTIVES = frozenset({VF, VB, EF, EB})
# Stage offset of the peer of each comm kind: activations flow to s+1, gradients to s-1.
# Sharded data parallelism's actions: collectives of the data-parallel replicas, no pipeline peer.
AG, RL, RS = ActionKind.GATHER, ActionKind.RELEASE, ActionKind.REDUCE_SCATTER
_SHARD = frozenset({AG, RL, RS})
_PEER_OFFSET = {SEND_F: +1, RECV_B: +1, RECV_F: -1, SEND_B: -1}
# ASCII digits only, so that parse accepts exactly what str writes.
_ACTION_RE = re.compile(r"([0-9]+)(SEND_F|RECV_F|SEND_B|RECV_B|VF|VB|EF|EB|AG|RL|RS|F|B|W)([0-9]+)\.([0-9]+)")


class ScheduleError(ValueError):
    """A schedule breaks a dependency rule. ``violations`` holds every problem found, one line each."""

    def __init__(self, message: str, violations: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.violations: tuple[str, ...] = tuple(violations)


class PairingError(ScheduleError):
    """The k-th receive on a channel is not for the k-th message sent on it: the wrong tensor would arrive."""


class DeadlockError(ScheduleError):
    """Every unfinished rank waits on a receive whose send is never issued."""


def _index(name: str, value: object) -> int:
    if isinstance(value, bool):
        raise TypeError(f"Action.{name} must be an int, got bool {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"Action.{name} must be an int, got {type(value).__name__} {value!r}") from None
    if out < 0:
        raise ValueError(f"Action.{name} must be >= 0, got {out}")
    return out


@dataclass(frozen=True, repr=False)
class Action:
    """One step of one chunk: a compute (F/B/W) or a p2p message for unit (microbatch, slice).

    ``chunk`` is the piece of the model the action runs on; the pipeline stage (rank) that holds it is the
    schedule's ``rank_of(chunk)``. With one chunk per stage, chunk ``c`` is stage ``c``.

    ``W`` (deferred weight gradients) covers a whole micro-batch, written with slice 0, or one slice when the
    schedule has a W per unit (see :func:`defer_weights`).

    A value: equal actions hash equal, and ``str`` gives the short form ``"1F0.2"`` that :meth:`parse` reads back,
    so schedules can be written, logged and compared as text.
    """

    chunk: int
    kind: ActionKind
    microbatch: int
    slice: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "chunk", _index("chunk", self.chunk))
        object.__setattr__(self, "microbatch", _index("microbatch", self.microbatch))
        object.__setattr__(self, "slice", _index("slice", self.slice))
        if not isinstance(self.kind, ActionKind):
            try:
                object.__setattr__(self, "kind", ActionKind(self.kind))
            except ValueError:
                valid = ", ".join(k.value for k in ActionKind)
                raise ValueError(f"Action.kind {self.kind!r} is not one of: {valid}") from None

    def __str__(self) -> str:
        return f"{self.chunk}{self.kind.value}{self.microbatch}.{self.slice}"

    __repr__ = __str__

    @classmethod
    def parse(cls, text: str) -> Action:
        """Read the short form written by ``str(action)``, e.g. ``"0RECV_B3.0"``."""
        if not isinstance(text, str):
            raise TypeError(f"Action.parse needs a str, got {type(text).__name__}")
        m = _ACTION_RE.fullmatch(text)
        if m is None:
            raise ValueError(f"cannot parse action {text!r}: expected '<chunk><kind><microbatch>.<slice>' "
                             f"with kind in {[k.value for k in ActionKind]}, e.g. '1F0.2'")
        return cls(int(m[1]), ActionKind(m[2]), int(m[3]), int(m[4]))

    @property
    def is_compute(self) -> bool:
        return self.kind in _COMPUTE

    @property
    def is_comm(self) -> bool:
        return self.kind not in _COMPUTE

    @property
    def is_collective(self) -> bool:
        """A collective of every rank of the pipeline (vocabulary parallelism): ``VF``, ``VB``, ``EF``, ``EB``."""
        return self.kind in _COLLECTIVES

    @property
    def is_shard(self) -> bool:
        """A data-parallel gather, release or reduce-scatter of the chunk's sharded states: ``AG``, ``RL``, ``RS``."""
        return self.kind in _SHARD

    @property
    def unit(self) -> tuple[int, int]:
        """(microbatch, slice): the pipeline unit this action belongs to."""
        return (self.microbatch, self.slice)

    @property
    def peer(self) -> int | None:
        """The chunk at the other end of a comm action (``None`` for compute actions, which talk to no one);
        its rank is the schedule's ``rank_of(peer)``."""
        off = _PEER_OFFSET.get(self.kind)
        return None if off is None else self.chunk + off


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered actions for ``num_microbatches`` micro-batches cut into ``num_slices`` slices each.

    The words mean one thing each, as in DeepSpeed: a *stage* is a position in the pipeline, one process of it
    (DeepSpeed's ``stage_id``; "rank" in the schedule means the same, ``num_ranks == num_stages``), and a *chunk*
    is a piece of the model that runs as one unit. ``stages[r]`` is what stage ``r`` executes, in order. With
    ``virtual_stages`` v > 1 the model is cut into ``num_stages * v`` chunks, an action names its chunk, and
    ``placement[c]`` is the stage that holds chunk ``c``. ``placement`` defaults to looped (chunk c on stage
    c mod p), which for v = 1 is chunk r on stage r.
    Immutable and hashable, so builders can be memoised and the simulator can cache what it derives.
    """

    name: str
    num_stages: int
    num_microbatches: int
    num_slices: int
    stages: tuple[tuple[Action, ...], ...] = field(repr=False)
    virtual_stages: int = 1
    placement: tuple[int, ...] | None = field(default=None, repr=False)

    has_comm: bool = field(init=False, repr=False, compare=False)
    """Whether send/recv actions are present (lowered by :func:`add_communication` or written by hand)."""

    defers_weights: bool = field(init=False, repr=False, compare=False)
    """Whether weight gradients run as separate ``W`` actions (see :func:`defer_weights`)."""

    weights_per_slice: bool = field(init=False, repr=False, compare=False)
    """Whether there is a ``W`` per unit (``W`` of a slice > 0 exists) rather than one per micro-batch."""

    def __post_init__(self) -> None:
        for attr in ("num_stages", "num_microbatches", "num_slices"):
            check_int(getattr(self, attr), attr, fix=_SIZE_FIX)
        check_int(self.virtual_stages, "virtual_stages", fix="use 1, or the chunks per rank of a schedule with "
                  "virtual stages")
        placement = check_placement(self.placement, self.num_stages, self.virtual_stages)
        object.__setattr__(self, "placement", placement)
        one = self.virtual_stages == 1 and placement == tuple(range(self.num_stages))
        stages = tuple(tuple(stream) for stream in self.stages)
        if len(stages) != self.num_stages:
            raise ValueError(f"Schedule.stages has {len(stages)} streams but num_stages={self.num_stages}; "
                             f"give one action sequence per stage")
        kinds: set[ActionKind] = set()
        w_per_slice = False
        num_chunks = len(placement)
        for s, stream in enumerate(stages):
            for p, a in enumerate(stream):
                if not isinstance(a, Action):
                    raise TypeError(f"Schedule.stages[{s}][{p}] must be an Action, got {type(a).__name__}")
                if one and a.chunk != s:
                    raise ValueError(f"Schedule.stages[{s}][{p}] is {a}, an action of stage {a.chunk}; "
                                     f"each stage's stream may only hold its own actions")
                if not one and (a.chunk >= num_chunks or placement[a.chunk] != s):
                    where = "does not exist" if a.chunk >= num_chunks else f"is placed on rank {placement[a.chunk]}"
                    raise ValueError(f"Schedule.stages[{s}][{p}] is {a}, an action of chunk {a.chunk}, which "
                                     f"{where}; rank {s}'s stream may only hold actions of its chunks "
                                     f"{list(chunks_on(placement, s))}")
                kinds.add(a.kind)
                w_per_slice = w_per_slice or (a.kind is W and a.slice > 0)
        object.__setattr__(self, "stages", stages)
        object.__setattr__(self, "has_comm", not kinds <= _COMPUTE)
        object.__setattr__(self, "defers_weights", W in kinds)
        object.__setattr__(self, "weights_per_slice", w_per_slice)

    @property
    def num_ranks(self) -> int:
        """The pipeline's stages, one stream each: ``num_stages`` under the name the runtime uses."""
        return self.num_stages

    @property
    def num_chunks(self) -> int:
        """Chunks (virtual stages) the model is cut into: ``num_ranks * virtual_stages``."""
        return self.num_stages * self.virtual_stages

    @property
    def is_one_chunk_per_rank(self) -> bool:
        """chunk r on rank r: the schedules from before virtual stages, whose lowering and messages are v = 1's."""
        return self.virtual_stages == 1 and self.placement == tuple(range(self.num_stages))

    def rank_of(self, chunk: int) -> int:
        return self.placement[chunk]  # type: ignore[index]

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        """The chunks rank ``rank`` holds, ascending."""
        return chunks_on(self.placement, rank)  # type: ignore[arg-type]

    @property
    def num_units(self) -> int:
        return self.num_microbatches * self.num_slices

    def units(self) -> tuple[tuple[int, int], ...]:
        """All (microbatch, slice) units in forward order: micro-batch major, slices ascending."""
        return tuple((b, i) for b in range(self.num_microbatches) for i in range(self.num_slices))

    def with_streams(self, name: str, streams: Sequence[Sequence[Action]]) -> Schedule:
        """A schedule on the same ranks, chunks and placement with other streams (checked)."""
        return Schedule(name, self.num_stages, self.num_microbatches, self.num_slices, tuple(map(tuple, streams)),
                        self.virtual_stages, self.placement)

    def compute_only(self) -> Schedule:
        """The same schedule with every comm action removed (undoes :func:`add_communication`)."""
        if not self.has_comm:
            return self
        return self.with_streams(self.name, [[a for a in stream if a.kind in _COMPUTE] for stream in self.stages])

    def __str__(self) -> str:
        head = (f"Schedule {self.name!r}: {self.num_stages} stages x {self.num_microbatches} micro-batches x "
                f"{self.num_slices} slices")
        if not self.is_one_chunk_per_rank:
            head += (f", {self.virtual_stages} chunks per rank (chunk -> rank {list(self.placement or ())}; "
                     "actions are written <chunk><kind><microbatch>.<slice>)")
        return head + "\n" + format_grid(self.stages)


def looped_placement(num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """Chunk c on rank c mod p (Megatron's interleaved 1F1B, looped BFS); v = 1: chunk r on rank r."""
    return tuple(c % num_ranks for c in range(num_ranks * virtual_stages))


def v_placement(num_ranks: int) -> tuple[int, ...]:
    """Chunks r and 2p-1-r on rank r (DualPipeV): the activations go down the ranks and come back up."""
    return tuple(range(num_ranks)) + tuple(reversed(range(num_ranks)))


def chunks_on(placement: Sequence[int], rank: int) -> tuple[int, ...]:
    return tuple(c for c, r in enumerate(placement) if r == rank)


def check_placement(placement: Sequence[int] | None, num_ranks: int, virtual_stages: int) -> tuple[int, ...]:
    """The chunk -> rank map as a tuple (looped when None); each rank must hold exactly ``virtual_stages``."""
    if placement is None:
        return looped_placement(num_ranks, virtual_stages)
    try:
        out = tuple(operator.index(r) for r in placement)
    except TypeError:
        raise TypeError(f"Schedule.placement must be a sequence of ranks (one per chunk), got {placement!r}") \
            from None
    counts = [0] * num_ranks
    for r in out:
        if 0 <= r < num_ranks:
            counts[r] += 1
    if len(out) != num_ranks * virtual_stages or any(c != virtual_stages for c in counts):
        raise ValueError(f"Schedule.placement = {list(out)} must give each of the {num_ranks} ranks exactly "
                         f"{virtual_stages} of the {num_ranks * virtual_stages} chunks; e.g. looped: chunk c on "
                         "rank c mod num_stages")
    return out


_new = object.__new__


def _make(chunk: int, kind: ActionKind, microbatch: int, slice_: int) -> Action:
    """Action without argument checks, for builders whose arguments are ints by construction (4x faster)."""
    a = _new(Action)
    d = a.__dict__
    d["chunk"], d["kind"], d["microbatch"], d["slice"] = chunk, kind, microbatch, slice_
    return a


def _trusted(name: str, num_stages: int, num_microbatches: int, num_slices: int,
             stages: tuple[tuple[Action, ...], ...], has_comm: bool, defers_weights: bool = False,
             weights_per_slice: bool = False, virtual_stages: int = 1,
             placement: tuple[int, ...] | None = None) -> Schedule:
    """Schedule without the per-action checks of ``__post_init__``, for builders whose output the tests validate
    over grids; at K=48 and 256 units the checks cost more than simulating the schedule."""
    sched = _new(Schedule)
    for attr, value in (("name", name), ("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("num_slices", num_slices), ("stages", stages), ("has_comm", has_comm),
                        ("defers_weights", defers_weights), ("weights_per_slice", weights_per_slice),
                        ("virtual_stages", virtual_stages),
                        ("placement", looped_placement(num_stages, virtual_stages) if placement is None
                         else placement)):
        object.__setattr__(sched, attr, value)
    return sched


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC while a builder allocates tens of thousands of acyclic actions: otherwise full
    collections triggered by the allocations (scanning every live object) take 2-5x the build itself."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def format_grid(stages: Sequence[Sequence[Action]], marks: Mapping[tuple[int, int], str] | None = None) -> str:
    """Render per-rank streams as a grid: one column per rank, one row per stream position.

    Rows are positions rather than wall-clock steps so every action appears exactly once, as in
    torch.distributed.pipelining's formatter. ``marks`` maps (rank, position) to a note; marked cells are
    written ``>action<`` and the notes are listed under the grid. Very long grids keep only rows near marks.
    """
    marks = dict(marks or {})
    num_rows = max((len(st) for st in stages), default=0)
    cells = [[(f">{st[p]}<" if (r, p) in marks else str(st[p])) if p < len(st) else "" for r, st in
              enumerate(stages)] for p in range(num_rows)]
    width = max([len(f"rank {len(stages) - 1}")] + [len(c) for row in cells for c in row])
    keep = set(range(num_rows))
    if num_rows > _MAX_GRID_ROWS:
        anchors = {p for (_, p) in marks} | {0, num_rows - 1}
        keep = {p for a in anchors for p in range(a - 8, a + 9) if 0 <= p < num_rows}
    lines = [("step   " + "  ".join(f"rank {r}".ljust(width) for r in range(len(stages)))).rstrip()]
    previous = -1
    for p in sorted(keep):
        if p != previous + 1:
            lines.append(f"  ... {p - previous - 1} rows elided")
        lines.append(f"{p:5d}  " + "  ".join(c.ljust(width) for c in cells[p]).rstrip())
        previous = p
    lines.extend(f"  rank {r} position {p}: {note}" for (r, p), note in sorted(marks.items()))
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- builders


def check_sizes(num_stages: int, num_microbatches: int, num_slices: int) -> None:
    """Refuse sizes a builder cannot build (each must be an int >= 1); builders call it before their cache."""
    for name, value in (("num_stages", num_stages), ("num_microbatches", num_microbatches),
                        ("num_slices", num_slices)):
        check_int(value, name, fix=_SIZE_FIX)


def build_schedule(name: str, num_stages: int, num_microbatches: int, num_slices: int,
                   deferred_weight_grads: bool = False, virtual_stages: int | None = None) -> Schedule:
    """Build a compute-only schedule by its registered name (``registry.schedule_names()``) on ``num_stages``
    pipeline ranks with ``virtual_stages`` chunks each (None: the schedule's default, 1 for ``gpipe`` and
    ``1f1b``); with ``deferred_weight_grads``, with the ``W`` actions the runtime runs for it
    (:func:`defer_weights` at the schedule's default placement), otherwise without any.

    The schedule's placement is asked first, so a ``virtual_stages`` it cannot place is refused with its rule.
    """
    spec = get_schedule(name)
    v = spec.virtual_stages if virtual_stages is None else virtual_stages
    check_sizes(num_stages, num_microbatches, num_slices)
    check_int(v, "virtual_stages", fix="use 1, or the chunks per rank of a schedule with virtual stages")
    spec.placement(num_stages, v)   # ValueError (rule, values, fix) for a v the schedule cannot run
    schedule = spec.builder(num_stages, num_microbatches, num_slices) if v == 1 else \
        spec.builder(num_stages, num_microbatches, num_slices, v)
    if deferred_weight_grads:
        return defer_weights(schedule)
    return without_weights(schedule) if schedule.defers_weights else schedule


def without_weights(schedule: Schedule) -> Schedule:
    """The same schedule with its ``W`` actions removed: backwards compute weight gradients too."""
    if not schedule.defers_weights:
        return schedule
    streams = tuple(tuple(a for a in st if a.kind is not W) for st in schedule.stages)
    return _trusted(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.num_slices, streams,
                    schedule.has_comm, False, False, schedule.virtual_stages, schedule.placement)


@functools.lru_cache(maxsize=64)
@_no_gc()
def defer_weights(schedule: Schedule, per_slice: bool | None = None) -> Schedule:
    """The same schedule with deferred weight gradients (``W`` actions) on every chunk.

    Per micro-batch (``per_slice=False``): ``W(c,b,0)`` right after ``B(c,b,0)``, the micro-batch's last
    backward on the chunk, for all its slices. Per slice (``True``): ``W(c,b,i)`` right after each ``B(c,b,i)``:
    the recorded pairs live only that long, as activations would. Either way, once lowered, W on a chunk that
    sends its gradient runs after ``SEND_B``, so the previous chunk is never kept waiting for it. ``None``: the
    schedule's default, the registered ``ScheduleSpec.weights_per_slice`` (per micro-batch for a schedule not
    registered). A schedule that already has W (a builder that places them itself) is returned unchanged.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"defer_weights needs a Schedule, got {type(schedule).__name__}")
    if schedule.has_comm:
        raise ValueError(f"defer_weights needs a compute-only schedule; {schedule.name!r} already has comm "
                         "(call add_communication after defer_weights)")
    if schedule.defers_weights:
        return schedule
    if per_slice is None:
        spec = find_schedule(schedule.name)
        per_slice = spec is not None and spec.weights_per_slice
    streams = []
    for stream in schedule.stages:
        out: list[Action] = []
        for a in stream:
            out.append(a)
            if a.kind is B and (per_slice or a.slice == 0):
                out.append(_make(a.chunk, W, a.microbatch, a.slice))
        streams.append(tuple(out))
    return _trusted(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.num_slices,
                    tuple(streams), False, True, per_slice and schedule.num_slices > 1, schedule.virtual_stages,
                    schedule.placement)


def _message_of(a: Action) -> tuple[ActionKind, int, int, int]:
    """What a comm action carries, the same for a send and the receive it pairs with: (F or B, the chunk that
    receives it, micro-batch, slice)."""
    if a.kind is SEND_F or a.kind is SEND_B:
        return (F if a.kind is SEND_F else B, a.chunk + _PEER_OFFSET[a.kind], a.microbatch, a.slice)
    return (F if a.kind is RECV_F else B, a.chunk, a.microbatch, a.slice)


@_no_gc()
def add_communication(schedule: Schedule) -> Schedule:
    """Lower a compute-only schedule to the exact p2p streams the runtime runs.

    ``RECV_F`` right before each F (s > 0), ``SEND_F`` right after it (s < K-1), ``RECV_B`` right before each B
    (s < K-1), ``SEND_B`` right after it (s > 0); ``W`` needs no message. A schedule that already has comm (or
    needs none: one stage) is returned unchanged, so the runtime may call this defensively; :func:`validate`
    checks hand-written comm.

    With several chunks per rank, messages are derived from the chunk -> rank map: a transfer between chunks on
    the same rank is a local hand-off (no message); rank p-1 -> rank 0 wraps. Channels are FIFO per directed
    pair of ranks and may then carry several flows (e.g. activations of chunks 0 -> 1 and 2 -> 3 and gradients
    of 2 -> 1 on rank 0 -> 1 when p = 2): a receive is posted where its compute needs it, preceded by the
    receives of other flows' messages the sender issued earlier on that channel (received early, kept until
    their compute), so the k-th receive always pairs with the k-th send. Within one flow the unit orders of
    the two chunks must agree, as with v = 1; :func:`replay` names the mis-paired messages otherwise.
    """
    if schedule.has_comm or schedule.num_stages == 1:
        return schedule
    if not schedule.is_one_chunk_per_rank:
        return _add_chunk_communication(schedule)
    last = schedule.num_stages - 1
    streams = []
    for s, stream in enumerate(schedule.stages):
        out: list[Action] = []
        for a in stream:
            b, i = a.microbatch, a.slice
            if a.kind is F:
                if s > 0:
                    out.append(_make(s, RECV_F, b, i))
                out.append(a)
                if s < last:
                    out.append(_make(s, SEND_F, b, i))
            elif a.kind is W:
                out.append(a)
            else:
                if s < last:
                    out.append(_make(s, RECV_B, b, i))
                out.append(a)
                if s > 0:
                    out.append(_make(s, SEND_B, b, i))
        streams.append(tuple(out))
    # Derived from an already checked schedule, one stage's actions per stream: no need to re-check.
    return _trusted(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.num_slices,
                    tuple(streams), True, schedule.defers_weights, schedule.weights_per_slice)


def _add_chunk_communication(schedule: Schedule) -> Schedule:
    place, C = schedule.placement, schedule.num_chunks
    assert place is not None
    # Per kind and chunk: the rank its output goes to / its input comes from, or -1 (none, or a local hand-off).
    out_rank = {F: [place[c + 1] if c + 1 < C and place[c + 1] != place[c] else -1 for c in range(C)],
                B: [place[c - 1] if c > 0 and place[c - 1] != place[c] else -1 for c in range(C)]}
    in_rank = {F: out_rank[B], B: out_rank[F]}
    step = {F: 1, B: -1}
    send_kind, recv_kind = {F: SEND_F, B: SEND_B}, {F: RECV_F, B: RECV_B}

    # Every rank's sends in stream order: channel (src rank, dst rank) -> [message], message -> index.
    sent: dict[tuple[int, int], list[tuple[ActionKind, int, int, int]]] = {}
    for r, stream in enumerate(schedule.stages):
        for a in stream:
            if a.kind is not W and out_rank[a.kind][a.chunk] >= 0:
                sent.setdefault((r, out_rank[a.kind][a.chunk]), []).append(
                    (a.kind, a.chunk + step[a.kind], a.microbatch, a.slice))
    index = {ch: {msg: k for k, msg in enumerate(msgs)} for ch, msgs in sent.items()}
    streams = []
    for r, stream in enumerate(schedule.stages):
        out: list[Action] = []
        append = out.append
        received: dict[tuple[int, int], set[int]] = {}
        nxt: dict[tuple[int, int], int] = {}
        for a in stream:
            kind = a.kind
            if kind is W:
                append(a)
                continue
            c, b, i = a.chunk, a.microbatch, a.slice
            src = in_rank[kind][c]
            if src >= 0:
                ch = (src, r)
                k = index.get(ch, {}).get((kind, c, b, i))
                got = received.setdefault(ch, set())
                if k is None:   # never sent: post it anyway, replay reports who waits forever
                    append(_make(c, recv_kind[kind], b, i))
                elif k not in got:
                    first = nxt.get(ch, 0)
                    if k > first:
                        pending = [j for j in range(first, k) if j not in got]
                        msgs = sent[ch]
                        # Another message of the same flow ahead of this one is a unit-order mismatch: post only
                        # this receive, as v = 1 does, and let FIFO pairing report it.
                        if not any(msgs[j][:2] == (kind, c) for j in pending):
                            for j in pending:
                                kj, to, mb, sl = msgs[j]
                                append(_make(to, recv_kind[kj], mb, sl))
                                got.add(j)
                    append(_make(c, recv_kind[kind], b, i))
                    got.add(k)
                    while first in got:
                        first += 1
                    nxt[ch] = first
            append(a)
            if out_rank[kind][c] >= 0:
                append(_make(c, send_kind[kind], b, i))
        streams.append(tuple(out))
    return _trusted(schedule.name, schedule.num_stages, schedule.num_microbatches, schedule.num_slices,
                    tuple(streams), True, schedule.defers_weights, schedule.weights_per_slice,
                    schedule.virtual_stages, schedule.placement)


def stream_strings(schedule: Schedule) -> tuple[str, ...]:
    """Each rank's stream as one space-separated line: a compact form for logs and golden tests."""
    return tuple(" ".join(map(str, st)) for st in schedule.stages)


def schedule_from_strings(name: str, num_microbatches: int, num_slices: int, lines: Iterable[str],
                          virtual_stages: int = 1, placement: Sequence[int] | None = None) -> Schedule:
    """Inverse of :func:`stream_strings`: build a (possibly hand-written) schedule from one line per rank
    (actions name their chunk; ``placement`` maps chunks to ranks, looped by default)."""
    streams = tuple(tuple(Action.parse(tok) for tok in line.split()) for line in lines)
    return Schedule(name, len(streams), num_microbatches, num_slices, streams, virtual_stages,
                    None if placement is None else tuple(placement))


# Names that lived here before schedules moved to one module each (``planner/schedules/``). Resolved on access,
# not imported at the top: those modules build on this one. SCHEDULES and WEIGHTS_PER_SLICE are read from the
# registry, so they include schedules registered later.
_MOVED = {"build_gpipe": "gpipe", "build_1f1b": "one_f_one_b", "warmup_forwards": "one_f_one_b"}
# The validator and dry run live in ``verify.py`` (it builds on this module); importable from here as before.
_VERIFY = ("ReplayResult", "collective_violations", "match_messages", "replay", "validate")


def __getattr__(name: str) -> Any:
    if name in _MOVED:
        return getattr(importlib.import_module(f"{__package__}.schedules.{_MOVED[name]}"), name)
    if name in _VERIFY:
        return getattr(importlib.import_module(f"{__package__}.verify"), name)
    if name == "SCHEDULES":
        return schedule_names()
    if name == "WEIGHTS_PER_SLICE":
        return {n: get_schedule(n).weights_per_slice for n in schedule_names()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

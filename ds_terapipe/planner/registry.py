"""Schedules by name: one :class:`ScheduleSpec` value per schedule, everything else derived from it.

Why one value: the config's allowed ``schedule`` values, the CLI's ``--schedule`` choices, the default for
deferred weight gradients, the slicing planner's memory estimate and exactness shortcut, and the README's table
of schedules all need to know about every schedule. Listing names in each of those places made adding a schedule
a hunt through five files; now a schedule is one builder module that calls :func:`register_schedule`, and the
rest reads the registry (the torchtitan ``get_schedule_class`` / torch ``_PipelineScheduleRuntime`` pattern).

This module imports only the standard library, so the CLI can build its parser and the config can validate
``schedule`` without loading numpy or the solver. The built-in schedules (``planner/schedules/``) register
themselves when the registry is first read: they build on the IR in ``planner/schedule.py``, which dispatches
``build_schedule`` through here, so loading them on first use rather than at import keeps the two modules from
importing each other half-initialised. Try it::

    python -c "from ds_terapipe.planner.registry import *; print(schedule_table())"
"""
from __future__ import annotations

import contextlib
import importlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "BubbleFormula", "ScheduleSpec", "accepts_virtual_stages", "find_schedule", "get_schedule", "one_chunk_per_rank",
    "register_schedule", "registered_schedule", "schedule_names", "schedule_table", "uniform_bubble",
    "unregister_schedule",
]

#: Modules under ``planner/schedules`` that register the built-in schedules, in the order names are listed
#: (config errors, ``--schedule`` choices, the docs table). Adding a built-in schedule = one module + one entry.
_BUILTIN_MODULES = ("gpipe", "one_f_one_b", "interleaved", "looped_bfs", "dualpipev", "zbv")

Builder = Callable[..., Any]  # returns a planner.schedule.Schedule (which imports this module)
"""(num_stages, num_microbatches, num_slices) -> a compute-only Schedule named after its spec; a schedule with
virtual stages also takes ``virtual_stages`` as a fourth argument (passed only when it is not 1). Sizes are
pipeline ranks, micro-batches and slices; the builder may place ``W`` actions itself (``dualpipev``, ``zbv``)."""

Placement = Callable[[int, int], "tuple[int, ...]"]
"""(num_ranks, virtual_stages) -> the rank of each chunk, chunk-indexed; ValueError if the schedule cannot place
``virtual_stages`` chunks per rank."""

LiveSubbatches = Callable[..., float]
"""(stage, num_stages, num_units, num_slices) -> sub-batches' worth of tokens a stage keeps alive at its peak,
in units of the stage's layers; schedules with virtual stages take ``virtual_stages`` as a fifth argument
(passed only when it is not 1) and count per rank: a chunk holds 1/v of its rank's layers, so a unit alive on
one chunk counts 1/v."""



def one_chunk_per_rank(num_ranks: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """The placement of every schedule without virtual stages: chunk r on rank r.

    Refuses ``virtual_stages > 1`` rather than silently running one chunk per rank: such a config asks for a
    schedule that places several chunks on a rank (interleaved, looped, V-shaped).
    """
    if virtual_stages != 1:
        raise ValueError(f"virtual_stages = {virtual_stages!r}: this schedule places one chunk per rank; use "
                         "virtual_stages = 1 or a schedule with virtual stages")
    return tuple(range(num_ranks))


@dataclass(frozen=True)
class BubbleFormula:
    """A closed-form bubble and how docs write it, kept in one value so the two cannot drift apart.

    ``formula(num_stages, num_units)``: the bubble fraction with equal unit costs and no communication (tests
    check it against the simulator). Calling the value calls the formula.
    """

    formula: Callable[..., float]
    text: str

    def __call__(self, num_stages: int, num_units: int, virtual_stages: int = 1) -> float:
        """The bubble on ``num_stages`` ranks; formulas of schedules with virtual stages also take
        ``virtual_stages`` (passed only when it is not 1, so v = 1 formulas keep two arguments)."""
        if virtual_stages == 1:
            return self.formula(num_stages, num_units)
        return self.formula(num_stages, num_units, virtual_stages)


#: (p - 1) / (N + p - 1): the GPipe bubble over N = micro-batches x slices equal units on p stages.
uniform_bubble = BubbleFormula(lambda k, n: (k - 1) / (n + k - 1), "(p-1)/(m·n+p-1)")


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything the planner, runtime, config, CLI and docs need to know about one schedule.

    A value: frozen and compared by its fields, so a registration can be checked for conflicts and restored.
    """

    name: str
    """The name users write (config ``terapipe.schedule``, ``--schedule``) and ``Schedule.name`` carries."""

    builder: Builder
    """Writes the compute-only schedule (F and B actions per stage); ``W`` and comm are added by passes."""

    description: str
    """One line for the docs table and ``ds-terapipe schedules``: what it does and when to use it."""

    live_subbatches: LiveSubbatches
    """The memory estimate (``slicing.MemoryModel``): sub-batches' worth of tokens alive on a stage at its peak.
    It must not grow with the slice count, so that a memory cap translates into a minimum slice count."""

    held_subbatches: LiveSubbatches | None = None
    """For schedules whose deferred W's may wait behind later work: sub-batches' worth of tokens that hold
    activations *or* W inputs (a backwarded unit keeps its Linears' inputs and output gradients until its W) at the
    stage's peak, at least ``live_subbatches``. ``MemoryModel.peak_bytes`` prices the units beyond
    ``live_subbatches`` at the W inputs' size, when the weight gradients are deferred. It must not grow with the
    slice count either. None: W inputs live no longer than a backward's temporaries (a W right behind its B, or
    gpipe's W per micro-batch, which the activation factor covers)."""

    deferred_weight_grads: bool = False
    """Default of ``terapipe.deferred_weight_grads`` for this schedule (the config's ``None``)."""

    weights_per_slice: bool = False
    """Default W placement (``schedule.defer_weights``): one W per (micro-batch, slice) rather than one per
    micro-batch after its last backward. Per slice bounds the recorded pairs as activations are bounded."""

    dp_exact: bool = False
    """Whether the slicing DP's closed form m * sum(w) + (K - 1) * max(t) is this schedule's step time over
    equal stages (without W); otherwise the planner scores candidates with the simulator."""

    bubble: BubbleFormula | None = None
    """Closed-form bubble with equal unit costs and no communication, where one exists, with its docs text."""

    memory_text: str = "-"
    """The activation memory as docs show it (units alive on stage s at its peak)."""

    placement: Placement = one_chunk_per_rank
    """Chunk -> rank map for ``num_ranks`` ranks and ``virtual_stages`` chunks per rank."""

    placement_text: str = "chunk r on rank r"
    """The placement as docs show it."""

    virtual_stages: int = 1
    """Chunks per rank when the caller gives none (``build_schedule``, the CLI, the planner)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip() or \
                any(c in self.name for c in " ,|\n"):
            raise ValueError(f"ScheduleSpec.name = {self.name!r} must be a non-empty word (no spaces, commas or "
                             "'|'), as users type it in --schedule and the config")
        if self.held_subbatches is not None and not callable(self.held_subbatches):
            raise TypeError(f"ScheduleSpec.held_subbatches of {self.name!r} must be callable or None, got "
                            f"{type(self.held_subbatches).__name__}")
        for attr in ("builder", "live_subbatches", "placement"):
            if not callable(getattr(self, attr)):
                raise TypeError(f"ScheduleSpec.{attr} of {self.name!r} must be callable, got "
                                f"{type(getattr(self, attr)).__name__}")
        if self.bubble is not None and not isinstance(self.bubble, BubbleFormula):
            raise TypeError(f"ScheduleSpec.bubble of {self.name!r} must be a BubbleFormula or None")
        if isinstance(self.virtual_stages, bool) or not isinstance(self.virtual_stages, int) or \
                self.virtual_stages < 1:
            raise ValueError(f"ScheduleSpec.virtual_stages of {self.name!r} must be an int >= 1, got "
                             f"{self.virtual_stages!r}")
        if not isinstance(self.description, str) or "\n" in self.description or "|" in self.description:
            raise ValueError(f"ScheduleSpec.description of {self.name!r} must be one line without '|' (it is a "
                             "cell of a markdown table)")


_REGISTRY: dict[str, ScheduleSpec] = {}
_builtins_loaded = False


def _load_builtins() -> None:
    """Import the built-in schedule modules once; each registers its spec."""
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True   # set first: the modules call register_schedule, which lands here again
    try:
        for module in _BUILTIN_MODULES:
            importlib.import_module(f"{__package__}.schedules.{module}")
    except BaseException:
        _builtins_loaded = False
        raise


def register_schedule(spec: ScheduleSpec, *, replace: bool = False) -> ScheduleSpec:
    """Make ``spec`` available by name everywhere (config, CLI, planner, runtime). Returns it.

    Registering a different spec under a taken name is refused unless ``replace``: two modules claiming one name
    would otherwise make the schedule depend on import order. Re-registering the same value is a no-op.
    """
    if not isinstance(spec, ScheduleSpec):
        raise TypeError(f"register_schedule needs a ScheduleSpec, got {type(spec).__name__}")
    _load_builtins()
    old = _REGISTRY.get(spec.name)
    if old is not None and old != spec and not replace:
        raise ValueError(f"schedule {spec.name!r} is already registered (by {_origin(old)}); pick another name or "
                         "pass replace=True")
    _REGISTRY[spec.name] = spec
    _canonical_order()
    logger.debug("registered schedule %r (%s)", spec.name, _origin(spec))
    return spec


def _canonical_order() -> None:
    """Built-ins first, in :data:`_BUILTIN_MODULES` order, then the others as registered.

    Why: the names users see (error messages, ``ds-terapipe schedules``) must not depend on which schedule module
    happened to be imported first. Importing ``schedules.gpipe`` directly starts loading the built-ins from inside
    its own registration, so gpipe used to land last ("valid: 1f1b, ..., gpipe") in some test orders only.
    """
    rank = {f"{__package__}.schedules.{m}": i for i, m in enumerate(_BUILTIN_MODULES)}
    ordered = sorted(_REGISTRY.items(), key=lambda item: rank.get(_origin(item[1]), len(rank)))   # stable
    _REGISTRY.clear()
    _REGISTRY.update(ordered)


def unregister_schedule(name: str) -> ScheduleSpec:
    """Remove a schedule and return its spec (tests and plugins undo their registrations with it)."""
    _load_builtins()
    try:
        return _REGISTRY.pop(name)
    except KeyError:
        raise ValueError(f"schedule {name!r} is not registered; registered: {', '.join(_REGISTRY)}") from None


@contextlib.contextmanager
def registered_schedule(spec: ScheduleSpec) -> Iterator[ScheduleSpec]:
    """Register ``spec`` for the duration of a ``with`` block, then restore what was there (nothing leaks)."""
    _load_builtins()
    previous = _REGISTRY.get(spec.name)
    register_schedule(spec, replace=True)
    try:
        yield spec
    finally:
        if previous is None:
            _REGISTRY.pop(spec.name, None)
        else:
            _REGISTRY[spec.name] = previous
            _canonical_order()


def get_schedule(name: str) -> ScheduleSpec:
    """The spec registered as ``name``; ValueError listing the valid names otherwise."""
    spec = find_schedule(name)
    if spec is None:
        raise ValueError(f"schedule = {name!r} is unknown; valid: {', '.join(_REGISTRY)}")
    return spec


def find_schedule(name: str) -> ScheduleSpec | None:
    """The spec registered as ``name``, or None (for schedules derived from a registered one, e.g. edited)."""
    _load_builtins()
    return _REGISTRY.get(name) if isinstance(name, str) else None


def accepts_virtual_stages(spec: ScheduleSpec, num_ranks: int, virtual_stages: int) -> bool:
    """Whether ``spec``'s placement can put ``virtual_stages`` chunks on each of ``num_ranks`` ranks."""
    try:
        spec.placement(num_ranks, virtual_stages)
    except ValueError:
        return False
    return True


def schedule_names() -> tuple[str, ...]:
    """Registered names in registration order (built-ins first)."""
    _load_builtins()
    return tuple(_REGISTRY)


def _origin(spec: ScheduleSpec) -> str:
    return getattr(spec.builder, "__module__", None) or "?"


def schedule_table() -> str:
    """The README's table of schedules, rendered from the registry (a test keeps the README equal to it)."""
    rows = ["| schedule | placement | bubble (equal units) | activation memory on stage s | deferred W | what and "
            "when |", "| --- | --- | --- | --- | --- | --- |"]
    for spec in map(get_schedule, schedule_names()):
        where = "per slice" if spec.weights_per_slice else "per micro-batch"
        w = f"{'on' if spec.deferred_weight_grads else 'off'}, {where}"
        bubble = spec.bubble.text if spec.bubble else "-"
        rows.append(f"| `{spec.name}` | {spec.placement_text} | {bubble} | {spec.memory_text} | {w} | "
                    f"{spec.description} |")
    return "\n".join(rows)

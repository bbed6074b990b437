"""Progressive freezing's pure rules (``terapipe.freeze``; the engine's side is runtime/features/freeze.py).

Why in the planner: the schedule without the frozen chunks' backward (:func:`freeze_lowered`), the cost model
with their backward removed (:func:`frozen_cost`), how many chunks a frozen prefix covers
(:func:`frozen_chunk_count`) and the gradient-norm rule of the ``auto`` policy (:func:`auto_freeze_count`) are
functions of plans, costs and numbers: the tests check them without a process group, and the runtime lowers a
frozen schedule through the same call as any other.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from ..config import AutoFreezeConfig
from .cost import per_stage_cost, scaled_cost
from .schedule import ActionKind, Schedule, add_communication

__all__ = ["auto_freeze_count", "freeze_lowered", "frozen_chunk_count", "frozen_cost"]

_B, _W = ActionKind.BACKWARD, ActionKind.WEIGHT


def frozen_chunk_count(parts: Sequence[int], num_frozen_layers: int) -> int:
    """How many leading chunks hold frozen layers only (chunk c covers layers ``[parts[c], parts[c+1])``)."""
    return sum(1 for c in range(len(parts) - 1) if parts[c + 1] <= num_frozen_layers)


def freeze_lowered(schedule: Schedule, num_frozen_chunks: int) -> Schedule:
    """``schedule`` (compute-only) lowered to p2p (:func:`add_communication`) without what frozen chunks need not
    do: their B and W actions, and every gradient message into them (the send on the chunk behind, the receive
    on theirs; a receive the lowering posted early for FIFO order included). Both ends of a channel lose the same
    messages, so the k-th remaining receive still pairs with the k-th remaining send."""
    if num_frozen_chunks <= 0:
        return add_communication(schedule)
    streams = [[a for a in stream if not (a.kind in (_B, _W) and a.chunk < num_frozen_chunks)]
               for stream in schedule.stages]
    lowered = add_communication(schedule.with_streams(schedule.name, streams))

    def into_frozen(a: Any) -> bool:
        if a.kind is ActionKind.SEND_B:
            return a.chunk - 1 < num_frozen_chunks
        return a.kind is ActionKind.RECV_B and a.chunk < num_frozen_chunks

    return lowered.with_streams(lowered.name, [[a for a in st if not into_frozen(a)] for st in lowered.stages])


def frozen_cost(cost: Mapping[str, Any], parts: Sequence[int], num_frozen_layers: int) -> dict[str, Any]:
    """The cost-file dict ``cost`` (one stage per chunk) with each chunk's backward and weight-gradient times
    scaled by the share of its layers that still train: 0 for a chunk of frozen layers, ``(stop - k) / (stop -
    start)`` for the chunk the frozen prefix ends in (layers weighted equally: the profile times chunks, not
    layers). Forwards are unchanged: frozen layers still run them."""
    shares = {}
    for c in range(len(per_stage_cost(cost)["stages"])):
        start, stop = parts[c], parts[c + 1]
        share = 1.0 if stop <= start else min(1.0, max(0.0, (stop - max(start, num_frozen_layers)) / (stop - start)))
        shares[c] = {"B": share, "W": share}
    return scaled_cost(cost, shares)


def auto_freeze_count(frozen: int, previous: Mapping[int, float], current: Mapping[int, float],
                      param_layers: Sequence[int], cfg: AutoFreezeConfig) -> int:
    """The automatic rule: the new number of frozen layers (never fewer than ``frozen``).

    ``previous`` / ``current``: the gradient norm of every layer with parameters that still trains, at the last
    check and now. A layer is stable when ``|current - previous| / previous <= cfg.tolerance`` (a layer whose
    gradient vanished, previous 0, counts as stable). Walking ``param_layers`` (ascending) from the first one
    that trains, the stable ones in a row freeze, at most ``max(1, floor(aggressiveness x layers still
    training))``, and never the last layer with parameters (or beyond ``max_frozen_layers``). The frozen prefix
    then ends right before the next layer with parameters, so layers without parameters ride along."""
    training = [layer for layer in param_layers if layer >= frozen]
    budget = max(1, math.floor(cfg.aggressiveness * len(training)))
    limit = len(training) - 1  # the last layer with parameters always trains
    chosen = 0
    for layer in training[:limit]:
        if chosen >= budget or layer not in previous or layer not in current:
            break
        before, now = previous[layer], current[layer]
        change = abs(now - before) / before if before > 0 else 0.0
        if change > cfg.tolerance:
            break
        chosen += 1
    if chosen == 0:
        return frozen
    new = training[chosen]  # up to the next layer with parameters
    if cfg.max_frozen_layers is not None:
        new = min(new, max(frozen, cfg.max_frozen_layers))
    return max(frozen, new)

"""Collective verdicts: what every rank decides together, so no rank is left waiting for a peer that gave up.

Why one module: a rank that raises alone leaves its peers blocked in the next collective or p2p receive until a
deadline. Every decision that can fail (a plan, a refusal, a config check) is therefore taken in one of three
shapes, each a collective all ranks call at the same point: :func:`decided_on_rank0` (rank 0 decides, every rank
gets the decision or the same error), :func:`agree_or_raise` (every rank checks, all raise if any found a problem)
and :func:`mark_collective` (an error all ranks raise together is marked so the engine does not treat it as a
fault that stops the job).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["agree_or_raise", "decided_on_rank0", "mark_collective"]


def mark_collective(err: BaseException) -> BaseException:
    """Mark an error that every rank raises together (a verdict all ranks reached): no peer is left waiting,
    so it does not set the abort flag (the engine may go on, e.g. after the data ran out)."""
    err.terapipe_collective = True  # type: ignore[attr-defined]
    return err


def agree_or_raise(problem: Optional[str], error: type[Exception], waiter: Optional[Any] = None,
                   what: str = "the ranks' verdict") -> None:
    """Collective: every rank raises ``error`` if any rank found a problem (the first rank's message), so no
    rank is left waiting for a peer that gave up.

    With ``waiter`` (the engine's ``SliceP2P``) the ranks first agree on a flag through an async all-reduce that
    ``waiter`` waits for
    (deadline, abort flag), so a rank that raised before reaching this point stops the others within seconds;
    only then are the messages gathered.
    """
    if waiter is not None:
        flag = torch.tensor([1 if problem else 0], dtype=torch.int32, device=waiter.device)
        waiter.wait(dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), what)
        if not int(flag.item()):
            return
    messages: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(messages, problem)
    failures = [m for m in messages if m]
    if failures:
        raise mark_collective(error(failures[0]))


def decided_on_rank0(decide: Callable[[], Any]) -> Any:
    """``decide()`` on global rank 0, broadcast to every rank (collective). If it raises (the planner finds no
    slicing, the cache cannot be written), every rank raises with its message, together: the others would
    otherwise wait in the broadcast for a decision that never comes."""
    payload: list[Any] = [None]
    error: Optional[Exception] = None
    if dist.get_rank() == 0:
        try:
            payload = [("ok", decide())]
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            error, payload = err, [("error", f"{type(err).__name__}: {err}")]
    dist.broadcast_object_list(payload, src=0)
    status, value = payload[0]
    if status == "ok":
        return value
    if error is not None:
        raise mark_collective(error)
    raise mark_collective(ValueError(f"terapipe: planning on global rank 0 failed: {value}"))

"""Watching the abort flag while a rank is inside collectives that cannot watch it.

Why: the engine's own waits (transfers, barriers, agreements: ``p2p.py``) look at the job's abort flag while
they are blocked, so a peer that raised stops them within a second. DeepSpeed's collectives after the schedule
(the tied and data-parallel gradient reductions, the optimizer step's norms and ZeRO's gathers, the loss
broadcast), its barriers inside a checkpoint save and load, the reductions init times and the decisions it
broadcasts from rank 0, the broadcasts of the engine a repack builds, and wherever the layers run (init's slice
check and profile, each step) the sharded chunks' gathers and reduce-scatters (FSDP2) and the sequence ranks'
all-to-alls block in the backend and look at nothing: a rank failing there (an out-of-memory in its first optimizer
step is the common case) leaves its peers inside them until the process group's timeout, tens of minutes; under
NCCL even when the failing process exits.

How: the engine enters such a stretch after an abort-aware barrier or agreement that every rank passed (or, for
init's planning, at the start of the engine's life), and for as long as it is inside, a thread
(:class:`CollectiveWatch`) reads the flag every ``poll_s``. When another rank raised it,
the thread closes this rank's connections (:func:`close_connections`), so the collective the main thread is
blocked in fails at once (and its peers' collectives with this rank), and the engine raises ``PeerFailedError``
naming the origin from that failure. The process groups are unusable afterwards, which is what a failed step
leaves anyway: the job restarts from its last checkpoint. Outside these stretches the thread does not run: a
healthy step pays one thread start and a store read per ``poll_s`` of the stretch.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from typing import Any, Iterator, Optional

import torch.distributed as dist

from .p2p import AbortFlag, PeerFailedError, _break_connections, peer_failed

__all__ = ["CollectiveWatch", "close_connections"]

logger = logging.getLogger(__name__)


def close_connections() -> None:
    """Fail every collective this process is blocked in, in every process group it belongs to. NCCL: its
    communicators are aborted (torch's ``_abort_process_group``). gloo: its connections are closed (a receive that
    times out, :func:`~ds_terapipe.runtime.execution.p2p._break_connections`; gloo's own abort leaves a blocked
    collective of a group that is still referenced blocked). Other backends: nothing (their collectives end at the
    process group's timeout)."""
    if not dist.is_initialized():
        return
    from torch.distributed import distributed_c10d as c10d

    groups = _process_groups()
    backends = set()
    for group in groups:
        try:
            backends.add(str(dist.get_backend(group)))
        except Exception:  # noqa: BLE001 - a group already destroyed
            continue
    if any("nccl" in backend for backend in backends) and hasattr(c10d, "_abort_process_group"):
        c10d._abort_process_group()   # every group, the default one included
    if any("gloo" in backend for backend in backends):
        _break_connections(groups[1:])   # the default group's, and these


def _process_groups() -> list[Any]:
    """Every process group of this process, the default one first (torch's registry of them)."""
    from torch.distributed import distributed_c10d as c10d

    default = dist.GroupMember.WORLD
    registered = getattr(getattr(c10d, "_world", None), "pg_names", None) or {}
    return [default] + [group for group in registered if group is not default]


class CollectiveWatch:
    """The abort flag watched on a thread while the main thread is inside collectives that cannot watch it (the
    module docstring says why). The engine runs ``train_batch``, ``eval_batch``, DeepSpeed's checkpoint save and
    load, and a repack inside :meth:`around` (:meth:`stretch` where the block starts watched), and calls :meth:`enter`
    where the stretch starts (after the barrier
    that ends each schedule; before the save, the load, the repack's engine build; at the start of init's
    planning; and from the start of every step where this rank's own collectives cannot watch the flag: sharded
    chunks' gathers and reduce-scatters, sequence ranks' all-to-alls); the stretch ends with the block, the
    outermost one where blocks nest. ``tripped`` is the failure the thread acted on."""

    def __init__(self, abort: Optional[AbortFlag], rank: int, poll_s: float) -> None:
        self.abort, self.rank, self.poll_s = abort, rank, poll_s
        self.tripped: Optional[dict[str, Any]] = None
        self.what = ""
        self._stop: Optional[threading.Event] = None
        self._thread: Optional[threading.Thread] = None
        self._depth = 0   # blocks of around() this one is inside

    def enter(self, what: str, rename: bool = False) -> None:
        """Start watching (a no-op without a flag, or when already watching; ``rename``: then the stretch is
        ``what`` from here on, as a peer's failure will name it)."""
        if self.abort is None:
            return
        if self._thread is not None:
            if rename:
                self.what = what
            return
        self.what, self._stop = what, threading.Event()
        self._thread = threading.Thread(target=self._watch, args=(self._stop, ), name="terapipe-collective-watch",
                                        daemon=True)
        self._thread.start()

    @contextmanager
    def stretch(self, what: str) -> Iterator[None]:
        """A block watched from its start as ``what``: :meth:`around` it, :meth:`enter` at once."""
        with self.around():
            self.enter(what)
            yield

    @property
    def watching(self) -> bool:
        """Whether a stretch is being watched now."""
        return self._thread is not None

    def leave(self) -> None:
        """Stop watching (returns at once: the thread wakes on the stop event)."""
        if self._thread is None:
            return
        assert self._stop is not None
        self._stop.set()
        self._thread.join()
        self._thread = self._stop = None

    @contextmanager
    def around(self) -> Iterator[None]:
        """Leave the stretch when the block ends. An error raised inside the stretch while another rank's failure
        is on the flag is raised as that rank's ``PeerFailedError``, naming the origin, when the failure explains
        it: this rank's watch closed the connections, or the error is a ``RuntimeError`` (a collective failed
        because a peer's watch closed them first). The error the origin raised, raised here too, stays this rank's
        own: a verdict every rank reached (DeepSpeed's fp16 scaler at its minimum) is no peer's fault. Inside
        another block, the outer one leaves."""
        self._depth += 1
        try:
            yield
        except Exception as err:
            inside = self._thread is not None
            if self._depth == 1:
                self.leave()
            if inside and not isinstance(err, PeerFailedError) and self.abort is not None:
                failure = self.tripped or self.abort.get()
                if failure is not None and failure.get("rank") != self.rank and \
                        failure.get("error") != f"{type(err).__name__}: {err}"[:2000] and \
                        (self.tripped is not None or isinstance(err, RuntimeError)):
                    raise peer_failed(failure, f"inside {self.what}") from err
            raise
        finally:
            self._depth -= 1
            if not self._depth:
                self.leave()

    def _watch(self, stop: threading.Event) -> None:
        assert self.abort is not None
        while not stop.wait(self.poll_s):
            failure = self.abort.get()
            if failure is not None and failure.get("rank") != self.rank:
                self.tripped = failure
                logger.error("terapipe: rank %s failed in %s while rank %s is inside %s; closing this rank's "
                             "connections so it stops too", failure.get("rank"), failure.get("what"), self.rank,
                             self.what)
                close_connections()
                return

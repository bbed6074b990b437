"""Point-to-point transfers of slice activations and gradients between neighbouring stages.

Why not DeepSpeed's own p2p: it exchanges activation shapes once per run, but slices of one plan have
different lengths (and variable sequence lengths change them again), its sends block, and it waits forever.
Here a transfer may carry a small fixed-size header (tensor count, dtypes, shapes); the engine sends one only
the first time a stage boundary sees a given (sequence length, slice length), after which the receiver posts
plain receives (a header costs a second round trip, measured 3.2 ms vs 0.4 ms on CPU gloo). Sends are
non-blocking (``isend``; the tensors stay referenced until the send completes) and every wait has a deadline,
so a dead peer becomes an error naming what this rank was waiting for, not a hang.

Ordering: torch.distributed matches sends and receives between two ranks in FIFO order, so the schedule's
per-rank order is the protocol; :func:`ds_terapipe.planner.schedule.replay` checks it pairs up.

Failing fast: a rank that raises (a loss function, a bad batch, an OOM) writes its rank and error once to a
job-wide :class:`AbortFlag` on the process group's store (host-side, so it works with NCCL as with gloo). Every
wait here checks that flag every ``poll_s`` while it is still blocked, and a set flag becomes a
:class:`PeerFailedError` naming the origin, within about a second, instead of waiting out ``p2p_timeout_s``.
A healthy wait never touches the store: only waits still blocked after ``poll_s`` look. A gloo receive cannot
be polled (its work never reports completion before ``wait``) nor waited on with a short timeout (a gloo
timeout tears the connections down), so with gloo the blocking ``wait`` runs on a helper thread while this
thread watches the flag; other backends poll ``is_completed``. A process that dies raises nothing: its peers
still fail at the deadline (or at once, where the transport reports the closed connection).

Leaving after a fault: a wait the main thread gave up on (for the abort flag, or a Ctrl-C) leaves its helper
thread blocked inside gloo with the GIL released. Were it still there when the interpreter finalises, the peer's
closed connection would wake it, Python would end it with ``pthread_exit`` when it takes the GIL back, and that
unwinding through torch's C++ frames is ``std::terminate`` ("terminate called without an active exception",
SIGABRT instead of the exception's exit code). So at exit (``atexit``, before finalisation) such a wait is ended
first, by closing this rank's gloo connections (see :func:`_break_connections`); then every helper thread is
stopped and joined.
"""

from __future__ import annotations

import atexit
import datetime
import json
import logging
import queue
import threading
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["AbortFlag", "P2PTimeoutError", "PeerFailedError", "SliceP2P", "as_tuple",
           "linger_for_peers", "peer_failed"]

logger = logging.getLogger(__name__)

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
           torch.int32, torch.int64, torch.bool]
_DTYPE_ID = {dtype: idx for idx, dtype in enumerate(_DTYPES)}
_HEADER_SIZE = 64


class P2PTimeoutError(RuntimeError):
    """Waiting for a pipeline peer failed: no answer within ``terapipe.p2p_timeout_s``, or the peer went away."""


class PeerFailedError(RuntimeError):
    """Another rank of the job raised (in ``train_batch``, ``eval_batch``, engine init or checkpointing), so
    this rank stops too; the message names the origin rank and its error."""


def peer_failed(failure: dict[str, Any], doing: str) -> PeerFailedError:
    """The error of a rank stopped by ``failure`` (an :meth:`AbortFlag.get`) while ``doing`` something."""
    stage = "" if failure.get("stage") is None else f" (stage {failure.get('stage')})"
    return PeerFailedError(f"rank {dist.get_rank()}: stopped while {doing}, because rank {failure.get('rank')}{stage} "
                           f"failed in {failure.get('what')}: {failure.get('error')}")


class AbortFlag:
    """A job-wide flag on the process group's store: the first rank to fail writes who it is and its error.

    ``key`` must be the same on every rank and new for every engine (an engine created after a failure starts
    clean); the engine numbers its instances, which every rank creates in the same order. The store lives in
    global rank 0's process (``env://``): once rank 0 has set or seen the flag, its exit waits (at most
    ``LINGER_S``, :func:`linger_for_peers`) until every rank has read it, and a store that can no longer be
    reached means rank 0's process is gone, which is itself reported as a failure.
    """

    LINGER_S = 3.0

    def __init__(self, store: Any, key: str) -> None:
        self.store, self.key = store, key
        self._seen = False

    @classmethod
    def on_default_group(cls, key: str) -> Optional["AbortFlag"]:
        """The flag on the default process group's store, or None without one (then waits only have deadlines)."""
        try:
            from torch.distributed.distributed_c10d import _get_default_store
            return cls(_get_default_store(), key)
        except (RuntimeError, ValueError, AttributeError, ImportError):  # pragma: no cover - no store
            return None

    def set(self, rank: int, stage: int, what: str, error: str) -> None:
        """Record a failure; only the first one is kept (the origin, not the peers that stopped because of it)."""
        value = json.dumps({"rank": rank, "stage": stage, "what": what, "error": error[:2000]})
        try:
            self.store.compare_set(self.key, "", value)
            self._mark_seen()
        except Exception as err:  # noqa: BLE001 - the store may be gone (rank 0 died); the deadline remains
            logger.warning("terapipe: could not raise the abort flag (%s); peers will fail at their deadline", err)

    def get(self) -> Optional[dict[str, Any]]:
        """The recorded failure, or None."""
        try:
            if not self.store.check([self.key]):
                return None
            failure = json.loads(self.store.get(self.key))
            self._mark_seen()
            return failure
        except Exception as err:  # noqa: BLE001 - the store's process is gone
            return {"rank": 0, "stage": None, "what": "its process (it holds the job's store)",
                    "error": f"the job's store is unreachable: rank 0 exited ({err})"}

    def _mark_seen(self) -> None:
        if not self._seen:
            self._seen = True
            self.store.add(f"{self.key}/seen", 1)
            if dist.get_rank() == 0 and not _LINGERING:
                _LINGERING.append(self)
                atexit.register(linger_for_peers)

    def seen_by(self) -> int:
        """How many ranks have set or read the flag."""
        return int(self.store.add(f"{self.key}/seen", 0))


_LINGERING: list[AbortFlag] = []


def linger_for_peers(timeout_s: Optional[float] = None) -> None:
    """On global rank 0 after a failure: wait until every rank has read the abort flag (at most
    ``AbortFlag.LINGER_S``) so that they can name the origin; the store dies with this process. Registered
    with ``atexit``; a process that leaves through ``os._exit`` calls it first."""
    if not _LINGERING:
        return
    flag = _LINGERING[0]
    deadline = time.monotonic() + (AbortFlag.LINGER_S if timeout_s is None else timeout_s)
    try:
        while flag.seen_by() < dist.get_world_size() and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - nothing left to wait for
        pass


_Job = tuple[Sequence[dist.Work], datetime.timedelta, threading.Event, list]


class _Waiter(threading.Thread):
    """Blocks in ``Work.wait`` on behalf of the main thread (gloo), so the main thread can watch the abort flag."""

    def __init__(self) -> None:
        super().__init__(name="terapipe-p2p-wait", daemon=True)
        # a job: (works, per-work timeout, set when done, errors for the main thread); None stops the thread
        self.jobs: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self.busy_until: Optional[float] = None  # while in a job: when its last wait's deadline runs out

    def run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:  # stopped at exit
                return
            works, timeout, done, errors = job
            try:
                for work in works:
                    work.wait(timeout=timeout)
            except Exception as err:  # noqa: BLE001 - handed to the main thread
                errors.append(err)
            self.busy_until = None
            done.set()

    def submit(self, works: Sequence[dist.Work], timeout: datetime.timedelta) -> tuple[threading.Event, list]:
        """Hand ``works`` to this thread; returns the event set when they are done and the list of their errors."""
        done, errors = threading.Event(), []
        self.busy_until = time.monotonic() + len(works) * timeout.total_seconds()  # before the job is picked up
        self.jobs.put((works, timeout, done, errors))
        return done, errors

    @classmethod
    def start_new(cls) -> "_Waiter":
        _register_exit()
        waiter = cls()
        _WAITERS.append(waiter)
        waiter.start()
        return waiter


_WAITERS: list[_Waiter] = []
#: "registered": the exit hook is; "gave_up": a wait of this process ran out of time, so its collective may still
#: be running inside gloo's own worker thread, which the process group's destructor joins while finalising
_EXIT: dict[str, Any] = {"registered": False, "gave_up": False, "groups": []}


def _register_exit() -> None:
    if not _EXIT["registered"]:
        _EXIT["registered"] = True
        atexit.register(_stop_waiters)


def _gave_up_a_wait(group: Any = None) -> None:
    """A wait ran out of its deadline, or was left for a peer's abort flag with its work in flight: at exit this
    rank's connections (of the default group and ``group``) are closed first (see :func:`_stop_waiters`).
    Why: a collective given up on (the batch agreement, the loss broadcast) stays inside gloo's worker thread while
    its peer hangs (stopped, not dead: its connection stays open), and the process group's destructor joins that
    thread at finalisation, so the rank would never exit."""
    _EXIT["gave_up"] = True
    if group is not None and all(group is not known for known in _EXIT["groups"]):
        _EXIT["groups"].append(group)
    _register_exit()

# The tag of the receive that :func:`_break_connections` lets time out: no sender uses it, so it matches no
# message. gloo picks a context (a set of connections) by tag modulo its device count, and the engine's transfers
# use tag 0: this tag is 0 modulo every count up to 16, so it reaches their context (the only one with one device).
_BREAK_TAG = 720720


def _break_connections(groups: Sequence[Any] = ()) -> None:
    """Close this rank's gloo connections of the default process group, and of ``groups`` (groups a wait was given
    up on), failing every wait on them at once.

    Why a receive that times out: gloo answers a receive's timeout by closing every connection of its context
    (torch binds no ``Work.abort`` and gloo's process-group ``abort`` does nothing), and the engine's transfers,
    barriers and agreements all run on that context. Only for a process that is leaving: the groups are unusable
    afterwards. Waits on other groups (vocabulary parallelism's) end when their peers exit, or at their deadline.
    """
    if not dist.is_initialized() or dist.get_world_size() < 2 or dist.get_backend() != "gloo":
        return
    me = dist.get_rank()
    for group in (None, *groups):
        try:
            ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            peers = [r for r in ranks if r != me]
            if dist.get_backend(group) != "gloo":
                continue
        except Exception:  # noqa: BLE001 - a group already destroyed
            continue
        # Peer by peer until one receive times out: a peer that closed its own connection to this rank first (its
        # watch acted a moment earlier) fails the receive at once, without the timeout that closes the others.
        for peer in peers:
            try:
                work = dist.irecv(torch.zeros(1), peer, group=group, tag=_BREAK_TAG)
                work.wait(timeout=datetime.timedelta(milliseconds=1))
            except Exception as err:  # noqa: BLE001 - the expected outcome: a timeout, or a connection closed
                if "timed out" in str(err).lower():
                    break


def _stop_waiters() -> None:
    """At exit, before the interpreter finalises: end any wait a helper thread is still blocked in, then stop
    and join every helper thread (why: the module docstring, "Leaving after a fault")."""
    if _EXIT["gave_up"] or any(waiter.busy_until is not None for waiter in _WAITERS):
        _break_connections(_EXIT["groups"])
    for waiter in _WAITERS:
        waiter.jobs.put(None)
    for waiter in _WAITERS:
        waiter.join(timeout=1.0)
        if waiter.is_alive() and waiter.busy_until is not None:
            left = max(0.0, waiter.busy_until - time.monotonic())
            logger.warning("terapipe: exit waits up to %.0fs (the deadline of terapipe.p2p_timeout_s) for a "
                           "transfer or collective this rank gave up on and a peer still holds open: leaving while "
                           "its thread is inside gloo would abort the process (SIGABRT)", left)
            waiter.join(timeout=left + 1.0)


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (value, ) if torch.is_tensor(value) else tuple(value)


class SliceP2P:
    """Non-blocking sends and deadline-bounded receives to the neighbouring pipeline stages."""

    def __init__(self, stage_to_rank: Sequence[int], device: torch.device, timeout_s: float,
                 abort: Optional[AbortFlag] = None, poll_s: float = 0.25) -> None:
        self.stage_to_rank = list(stage_to_rank)
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._pending: list[tuple[dist.Work, tuple[torch.Tensor, ...], str]] = []
        self.abort = abort
        self.poll_s = poll_s
        self.failure: Optional[dict[str, Any]] = None  # the peer failure this rank stopped for
        self._waiter: Optional[_Waiter] = None
        self._threaded = dist.get_backend() == "gloo"

    def close(self) -> None:
        """Stop the thread this instance waits on (``engine.destroy()``), so that a process building engine after
        engine keeps no idle thread per engine. One still inside a wait this rank gave up on stays with the exit hook,
        which closes the connections it is blocked on first (:func:`_stop_waiters`)."""
        waiter, self._waiter = self._waiter, None
        if waiter is None or waiter.busy_until is not None:
            return
        waiter.jobs.put(None)
        waiter.join(timeout=1.0)
        if not waiter.is_alive():
            _WAITERS.remove(waiter)

    # -- sending ---------------------------------------------------------------------------------------------
    def send(self, tensors: Sequence[torch.Tensor], stage: int, what: str, *, header: bool) -> None:
        """Start sending ``tensors`` to ``stage``; with ``header`` the receiver learns their shapes first."""
        rank = self.stage_to_rank[stage]
        wire = tuple(t.to(torch.uint8) if t.dtype == torch.bool else t.contiguous() for t in tensors)
        if header:
            head = self._header(tensors)
            self._pending.append((dist.isend(head, rank), (head, ), what))
        for tensor in wire:
            self._pending.append((dist.isend(tensor, rank), (tensor, ), what))
        self._reap()

    def _header(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        fields = [len(tensors)]
        for t in tensors:
            if t.dtype not in _DTYPE_ID:
                raise TypeError(f"token pipeline cannot send tensors of dtype {t.dtype} between stages; "
                                f"use one of {[str(d) for d in _DTYPES]}")
            fields += [_DTYPE_ID[t.dtype], t.dim(), *t.shape]
        if len(fields) > _HEADER_SIZE:
            raise ValueError(f"activations between stages have too many tensors/dimensions ({len(fields)} header "
                             f"fields > {_HEADER_SIZE}); send fewer tensors per stage boundary")
        head = torch.zeros(_HEADER_SIZE, dtype=torch.int64)
        head[:len(fields)] = torch.tensor(fields, dtype=torch.int64)
        return head.to(self.device)

    def _reap(self) -> None:
        """Forget sends that completed, so their tensors can be freed."""
        self._pending = [p for p in self._pending if not p[0].is_completed()]

    def drain(self) -> None:
        """Wait for every outstanding send (end of a batch: nothing may still be in flight)."""
        pending, self._pending = self._pending, []
        if pending:
            self.wait_all([work for work, _, _ in pending], f"{len(pending)} send(s), the last of {pending[-1][2]}")

    # -- receiving -------------------------------------------------------------------------------------------
    def recv(self, stage: int, what: str) -> tuple[torch.Tensor, ...]:
        """Receive a header-described group of tensors from ``stage``."""
        rank = self.stage_to_rank[stage]
        head = torch.zeros(_HEADER_SIZE, dtype=torch.int64, device=self.device)
        self.wait(dist.irecv(head, rank), f"header of {what} from stage {stage} (rank {rank})")
        fields = head.tolist()
        pos, specs = 1, []
        for _ in range(fields[0]):
            ndim = fields[pos + 1]
            specs.append((tuple(fields[pos + 2:pos + 2 + ndim]), _DTYPES[fields[pos]]))
            pos += 2 + ndim
        return self.recv_specs(specs, stage, what)

    def recv_like(self, likes: Sequence[torch.Tensor], stage: int, what: str) -> tuple[torch.Tensor, ...]:
        """Receive tensors shaped like ``likes`` (gradients of our own outputs: no header needed)."""
        return self.recv_specs([(tuple(t.shape), t.dtype) for t in likes], stage, what)

    def recv_specs(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], stage: int,
                   what: str) -> tuple[torch.Tensor, ...]:
        """Receive tensors of known shapes and dtypes: all receives are posted at once, no header round trip."""
        rank = self.stage_to_rank[stage]
        wire = [torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
                for shape, dtype in specs]
        self.wait_all([dist.irecv(buf, rank) for buf in wire], f"{what} from stage {stage} (rank {rank})")
        return tuple(buf.bool() if dtype == torch.bool else buf for buf, (_, dtype) in zip(wire, specs))

    def wait(self, work: dist.Work, what: str, group: Any = None) -> None:
        """Wait for ``work`` (any async collective too) at most ``p2p_timeout_s``; fail naming ``what``, or at
        once (within ``poll_s``) when another rank raised the abort flag. ``group``: the process group of a
        collective outside the default one (closed at exit if the wait runs out: see :func:`_gave_up_a_wait`)."""
        self.wait_all([work], what, group)

    def wait_all(self, works: Sequence[dist.Work], what: str, group: Any = None) -> None:
        """Wait for every one of ``works``, each at most ``p2p_timeout_s`` (see :meth:`wait`)."""
        if self.failure is not None:  # this engine already stopped for a peer: nothing it waits for will come
            self._raise_peer_failed(what)
        if self.abort is None:
            errors: list[Exception] = []
            try:
                for work in works:
                    work.wait(timeout=self.timeout)
            except RuntimeError as err:
                errors.append(err)
        elif self._threaded:
            try:
                errors = self._wait_on_thread(works, what)
            except PeerFailedError:
                _gave_up_a_wait(group)   # its works stay in flight: closed at exit with the default group's
                raise
        else:
            errors = self._wait_polling(works, what)
        if errors:
            err = errors[0]
            # A peer that raised usually exits next, so the transport may report its closed connection before
            # this rank looked at the flag: name the origin if there is one.
            failure = self.abort.get() if self.abort is not None else None
            if failure is not None:
                self.failure = failure
                try:
                    self._raise_peer_failed(what)
                except PeerFailedError as peer:
                    raise peer from err
            _gave_up_a_wait(group)
            raise P2PTimeoutError(f"rank {dist.get_rank()}: waiting for {what} failed (limit "
                                  f"{self.timeout.total_seconds():.0f}s, terapipe.p2p_timeout_s): a peer died, hung "
                                  f"or runs a different schedule ({err})") from err

    def _wait_on_thread(self, works: Sequence[dist.Work], what: str) -> list[Exception]:
        if self._waiter is None:
            self._waiter = _Waiter.start_new()
        done, errors = self._waiter.submit(works, self.timeout)
        while not done.wait(self.poll_s):
            self._check_abort(what)
        return errors

    def _wait_polling(self, works: Sequence[dist.Work], what: str) -> list[Exception]:
        deadline = time.monotonic() + self.timeout.total_seconds()
        next_check = time.monotonic() + self.poll_s
        for work in works:
            while not work.is_completed():
                now = time.monotonic()
                if now >= next_check:
                    self._check_abort(what)
                    next_check = now + self.poll_s
                if now > deadline:
                    return [RuntimeError(f"no completion within {self.timeout.total_seconds():.0f}s")]
                time.sleep(20e-6)
            try:
                work.wait(timeout=self.timeout)  # completed: orders the device stream after it
            except RuntimeError as err:
                return [err]
        return []

    def _check_abort(self, what: str) -> None:
        assert self.abort is not None
        failure = self.abort.get()
        if failure is not None:
            self.failure = failure
            self._raise_peer_failed(what)

    def _raise_peer_failed(self, what: str) -> None:
        raise peer_failed(self.failure or {}, f"waiting for {what}")

"""Tier a: the thread that watches the abort flag while a rank is inside DeepSpeed's own collectives
(runtime/execution/collective_watch.py), without a process group: a peer's failure closes this rank's connections
and turns the failed collective into that peer's PeerFailedError; this rank's own failure, or none, does nothing;
under NCCL the communicators are aborted, under gloo the connections closed. The multi-process case (a middle
stage raising in its optimizer step while its peers wait in the gradient norm's all-reduce) is in
tests/test_engine_faults.py."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import pytest

from ds_terapipe.runtime.execution import collective_watch
from ds_terapipe.runtime.execution.collective_watch import CollectiveWatch
from ds_terapipe.runtime.execution.p2p import PeerFailedError

ORIGIN = {"rank": 1, "stage": 1, "what": "train_batch", "error": "RuntimeError: out of memory"}


class FakeFlag:
    """An AbortFlag stand-in: ``failure`` is what ``get`` returns."""

    def __init__(self) -> None:
        self.failure: Optional[dict[str, Any]] = None

    def get(self) -> Optional[dict[str, Any]]:
        return self.failure


@pytest.fixture
def closed(monkeypatch) -> threading.Event:
    """Set when the watch closes this rank's connections (instead of closing them)."""
    event = threading.Event()
    monkeypatch.setattr(collective_watch, "close_connections", event.set)
    return event


def test_a_peer_failure_closes_the_connections_and_names_the_peer(closed, monkeypatch) -> None:
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 0)   # the message names this rank
    flag = FakeFlag()
    watch = CollectiveWatch(flag, rank=0, poll_s=0.01)
    with pytest.raises(PeerFailedError) as raised:
        with watch.around():
            watch.enter("DeepSpeed's optimizer step")
            flag.failure = ORIGIN
            assert closed.wait(5.0), "the watch did not close the connections"
            raise RuntimeError("Connection closed by peer")   # what the blocked collective raises then
    assert "stopped while inside DeepSpeed's optimizer step, because rank 1 (stage 1) failed in train_batch: " \
           "RuntimeError: out of memory" in str(raised.value), raised.value
    assert isinstance(raised.value.__cause__, RuntimeError)
    assert watch.tripped == ORIGIN


def test_an_error_before_the_watch_polled_is_the_peer_s_too(closed, monkeypatch) -> None:
    # a peer's watch closed its connections first: this rank's collective fails before its own watch looked
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 2)
    flag = FakeFlag()
    watch = CollectiveWatch(flag, rank=2, poll_s=60.0)
    with pytest.raises(PeerFailedError, match="because rank 1"):
        with watch.around():
            watch.enter("DeepSpeed's loss broadcast")
            flag.failure = ORIGIN
            raise RuntimeError("Connection closed by peer")
    assert not closed.is_set()


@pytest.mark.parametrize("where", ["own failure", "outside the stretch"])
def test_this_rank_s_own_error_and_errors_outside_the_stretch_pass_unchanged(closed, where: str) -> None:
    flag = FakeFlag()
    watch = CollectiveWatch(flag, rank=1, poll_s=0.01)
    with pytest.raises(MemoryError):
        with watch.around():
            if where == "own failure":
                watch.enter("DeepSpeed's optimizer step")
                flag.failure = ORIGIN   # rank 1 is this rank: its own flag
                time.sleep(0.1)
            else:
                flag.failure = dict(ORIGIN, rank=0)   # a peer failed, but this rank is not inside the stretch
            raise MemoryError("this rank's own")
    assert not closed.is_set() and watch.tripped is None


@pytest.mark.parametrize("poll_s", [0.01, 60.0], ids=["after the watch closed", "before the watch looked"])
def test_the_origin_s_own_error_raised_here_too_stays_this_rank_s(closed, poll_s: float) -> None:
    # every rank's fp16 scaler reaches its minimum in the same step: each raises its own error, no PeerFailedError
    flag = FakeFlag()
    watch = CollectiveWatch(flag, rank=3, poll_s=poll_s)
    verdict = Exception("Current loss scale already at minimum - cannot decrease scale anymore. Exiting run.")
    with pytest.raises(Exception) as raised:
        with watch.around():
            watch.enter("DeepSpeed's optimizer step")
            flag.failure = dict(ORIGIN, error=f"Exception: {verdict}")
            if poll_s < 1:
                assert closed.wait(5.0)
            raise verdict
    assert raised.value is verdict


def test_another_error_of_this_rank_before_the_watch_looked_stays_its_own(closed) -> None:
    # not a collective's failure (a RuntimeError), and no watch of this rank acted: its own
    flag = FakeFlag()
    watch = CollectiveWatch(flag, rank=2, poll_s=60.0)
    with pytest.raises(KeyError):
        with watch.around():
            watch.enter("DeepSpeed's optimizer step")
            flag.failure = ORIGIN
            raise KeyError("this rank's own")


def test_leaving_stops_the_thread_at_once_and_a_healthy_stretch_does_nothing(closed) -> None:
    watch = CollectiveWatch(FakeFlag(), rank=0, poll_s=60.0)
    with watch.around():
        watch.enter("DeepSpeed's optimizer step")
        thread = watch._thread
        assert thread is not None and thread.is_alive()
    assert not thread.is_alive() and watch._thread is None and not closed.is_set()
    CollectiveWatch(None, rank=0, poll_s=0.01).enter("no flag: no thread")   # a run without a store


def _a_peer_fails(flag: FakeFlag, closed: threading.Event) -> None:
    """Another rank's failure reaches the flag; once the watch closed the connections, the blocked collective
    fails as it then would."""
    flag.failure = ORIGIN
    assert closed.wait(5.0), "the watch did not close the connections"
    raise RuntimeError("Connection closed by peer")


@pytest.fixture
def watched(monkeypatch) -> tuple[CollectiveWatch, FakeFlag]:
    """A watch of rank 0 polling every 10 ms, and its flag."""
    monkeypatch.setattr("torch.distributed.get_rank", lambda: 0)   # the message names this rank
    flag = FakeFlag()
    return CollectiveWatch(flag, rank=0, poll_s=0.01), flag


def test_a_stretch_entered_at_the_schedule_s_start_is_renamed_where_deepspeed_s_collectives_start(
        closed, watched) -> None:
    # a sharded or sequence-parallel schedule is watched from its start; the barrier that ends it renames the
    # stretch (one thread), and an enter without renaming (a nested block) keeps the name
    watch, flag = watched
    with pytest.raises(PeerFailedError) as raised:
        with watch.around():
            watch.enter("the schedule's all-to-alls")
            thread = watch._thread
            assert watch.watching
            watch.enter("DeepSpeed's gradient reduction", rename=True)
            watch.enter("a nested block")
            assert watch._thread is thread
            _a_peer_fails(flag, closed)
    assert "stopped while inside DeepSpeed's gradient reduction, because rank 1" in str(raised.value), raised.value
    assert not watch.watching


def test_a_nested_block_leaves_the_watch_to_the_outer_one(closed, watched) -> None:
    # a step watched from its start (a sequence-parallel run) holds the schedule's own block: the inner block's
    # end must not stop the thread the outer stretch still needs; a peer's failure inside the inner block is named
    watch, flag = watched
    with pytest.raises(PeerFailedError) as raised:
        with watch.around():
            watch.enter("the all-to-alls of train_batch")
            with watch.around():
                pass
            assert watch.watching, "the inner block stopped the outer stretch's watch"
            with watch.around():
                _a_peer_fails(flag, closed)
    assert "inside the all-to-alls of train_batch, because rank 1" in str(raised.value), raised.value
    assert not watch.watching


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_nccl_communicators_are_aborted_and_gloo_connections_closed(monkeypatch, backend: str) -> None:
    from torch.distributed import distributed_c10d as c10d

    calls: list[str] = []
    monkeypatch.setattr("torch.distributed.is_initialized", lambda: True)
    monkeypatch.setattr("torch.distributed.get_backend", lambda group=None: backend)
    monkeypatch.setattr(collective_watch, "_process_groups", lambda: ["default", "pipe group"])
    monkeypatch.setattr(c10d, "_abort_process_group", lambda group=None: calls.append(f"abort {group}"))
    monkeypatch.setattr(collective_watch, "_break_connections",
                        lambda groups=(): calls.append(f"break {len(groups)} subgroup(s)"))
    collective_watch.close_connections()
    assert calls == (["abort None"] if backend == "nccl" else ["break 1 subgroup(s)"]), calls

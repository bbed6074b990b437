"""Tier b, four 2-rank launches and one 3-rank launch of tests/suites/fault_exit.py: after a fault every rank
leaves cleanly, and closing a rank's connections ends its waits even after a peer closed its own first.

A rank that stopped for a fault leaves the way a user's script does (the exception escapes, the interpreter
finalises): it must print the exception and exit 1, never abort ("terminate called without an active
exception", SIGABRT: -6 here, 134 from a shell, 250 from DeepSpeed's launcher), and no helper thread of
runtime/execution/p2p.py may be left running.

* A wait given up for the abort flag whose peer closes the connection while this process finalises (the
  race behind the abort, made to happen on every launch): without the exit path of runtime/execution/p2p.py ("Leaving
  after a fault") rank 1 aborted in 3 of 3 launches.
* A refused batch in a real 2-stage engine (micro-batch 1 of a step with too few sequences): aborted 2 of 4
  launches without it.
* A killed peer (its transfer fails, nothing is given up): exits 1 either way; its helper thread used to be
  left running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_harness import run_ranks, suite_command

pytestmark = pytest.mark.multiproc

ABORTED = (-6, 134, 250)


def _launch(case: str, tmp_path: Path, kill: tuple[int, str] | None = None) -> tuple[list[int | None], list[str]]:
    return run_ranks(suite_command("fault_exit", tmp_path, {"case": case}), 2, tmp_path, timeout_s=90, kill=kill,
                     fail_fast=False)   # a rank killed by fail-fast would hide how it would have exited


def _left_cleanly(codes: list[int | None], texts: list[str], errors: dict[int, str]) -> None:
    """Each rank in ``errors`` printed that error, exited 1 (not an abort) and left no Python thread behind."""
    for rank, error in errors.items():
        text = texts[rank][-4000:]
        assert codes[rank] not in ABORTED and "terminate called" not in text, f"rank {rank} aborted:\n{text}"
        assert codes[rank] == 1, f"rank {rank} exited {codes[rank]}:\n{text}"
        assert error in text, f"rank {rank} did not print {error!r}:\n{text}"
        assert f"rank {rank}: threads at exit: []" in text, f"rank {rank} left a thread running:\n{text}"


# "abandoned": a wait given up for the abort flag must not abort the exit; "engine": a loss function raising mid-step
# in a real 2-stage engine ends every rank with its error
STOPPED = {
    "abandoned": {
        0: "ValueError: simulated refused batch",
        1: "PeerFailedError: rank 1: stopped while waiting for header of activations of micro-batch 0 from stage 0 "
           "(rank 0), because rank 0 (stage 0) failed in train_batch: ValueError: simulated refused batch"},
    "engine": {
        0: "because rank 1 (stage 1) failed in train_batch: RuntimeError: simulated loss failure",
        1: "RuntimeError: simulated loss failure"},
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(STOPPED), ids=["wait given up for the abort flag", "raising loss in an engine"])
def test_a_rank_stopped_by_a_fault_leaves_with_its_error(tmp_path, mode: str) -> None:
    codes, texts = _launch(mode, tmp_path)
    _left_cleanly(codes, texts, STOPPED[mode])


@pytest.mark.timeout(120)
def test_a_hung_peer_ends_the_survivor_with_its_error_and_it_exits(tmp_path) -> None:
    """The peer stays stopped until the launcher kills it (5 s after rank 0 exited 1): rank 0 must fail at its
    deadline where DeepSpeed broadcasts the loss (that broadcast has no deadline of its own) and then exit, though
    the broadcast is still inside gloo's worker thread, which the process group's destructor joins."""
    codes, texts = run_ranks(suite_command("fault_exit", tmp_path, {"case": "hung"}), 2, tmp_path, timeout_s=60)
    assert codes[1] in (None, -9), f"rank 1 should have been killed once rank 0 exited, got {codes[1]}"
    _left_cleanly(codes, texts, {0: "P2PTimeoutError: rank 0: waiting for the step's loss (its data-parallel mean "
                                    "and broadcast): broadcast failed"})


@pytest.mark.timeout(120)
def test_a_killed_peer_ends_the_survivor_with_its_error(tmp_path) -> None:
    codes, texts = _launch("killed", tmp_path, kill=(1, "waiting"))
    assert codes[1] is None, "rank 1 should have been killed"
    _left_cleanly(codes, texts, {0: "P2PTimeoutError: rank 0: waiting for header of gradients of micro-batch 0 "
                                    "from stage 1 (rank 1) failed"})


@pytest.mark.timeout(120)
def test_closing_the_connections_after_a_peer_closed_its_own_ends_every_wait(tmp_path) -> None:
    """Two collective watches act milliseconds apart (rank 0 first): rank 2's connection to rank 0 is already
    closed when its own watch closes its connections, and its wait on rank 1 (alive, silent) must still end then,
    not when rank 1 exits (seen under load in the optimizer-fault launch of tests/test_engine_faults.py)."""
    codes, texts = run_ranks(suite_command("fault_exit", tmp_path, {"case": "closed_first"}), 3, tmp_path,
                             timeout_s=90, fail_fast=False)
    assert codes == [0, 0, 0], (codes, texts)
    waited = float(texts[2].split("rank 2: the wait for rank 1 ended after ")[1].split(" s")[0])
    assert waited < 10, f"rank 2's wait ended after {waited} s, when rank 1 left, not when rank 2 closed:\n{texts[2]}"

"""Suite ``fault_exit`` (standalone, 2 ranks), asserted on by tests/test_fault_exit.py:
``python tests/dist_worker.py fault_exit DIR '{"case": CASE}'`` (env: RANK, WORLD_SIZE, ...), or by hand:
``PYTHONPATH=. deepspeed --num_gpus 2 tests/dist_worker.py fault_exit /tmp/out '{"case": "engine"}'``.

Unlike a suite of cases, which leaves through ``os._exit``, a rank here leaves the way a user's training script does
after a fault: the exception escapes, Python prints it, runs the ``atexit`` hooks, finalises the interpreter and
exits 1. Two ranks, gloo. Cases:

* ``abandoned``: rank 1 waits for a transfer from rank 0, which raises the abort flag, so rank 1 raises
  ``PeerFailedError`` with its receive still posted. Rank 0 keeps the connection open until rank 1 is finalising
  (an object's ``__del__`` there writes ``DIR/finalising`` and holds finalisation for 2 s), and only then raises
  and exits, closing the connection under rank 1's finalisation: exactly the moment that, unless the wait was
  ended at exit (runtime/execution/p2p.py, "Leaving after a fault"), wakes rank 1's helper thread and aborts the
  process.
* ``killed``: rank 0 waits for a transfer from rank 1, which the test kills once rank 0 prints ``waiting``.
* ``engine``: a 2-stage engine whose first stage reads micro-batches of two lengths in one step (a refused
  batch): rank 0 raises ``ValueError``, rank 1 stops with ``PeerFailedError``.
* ``hung``: a 2-stage engine whose last stage stops itself (SIGSTOP: hung, not dead, its connections stay open)
  after the schedule, where DeepSpeed aggregates the step's loss: rank 0 raises ``P2PTimeoutError`` at
  ``p2p_timeout_s`` and exits, though the broadcast it gave up on is still inside gloo.
* ``closed_first`` (3 ranks): a rank closes its connections after a peer closed its own to it; its wait on a
  third rank, alive and silent, must still end.

Last of the ``atexit`` hooks (registered first), each rank prints the Python threads still alive besides the
main thread: ``threads at exit: [...]``.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tests.suites import suite

RANK = int(os.environ["RANK"])


def report_threads() -> None:
    alive = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    print(f"rank {RANK}: threads at exit: {alive}", flush=True)


class HoldFinalisation:
    """Kept in this module's globals, so that its ``__del__`` runs while the interpreter finalises."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __del__(self) -> None:
        self.marker.write_text("finalising")
        time.sleep(2.0)  # the peer exits now: its closed connection arrives while this process finalises


def wait_for(path: Path, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def abandoned(out: Path) -> None:
    from ds_terapipe.runtime.execution.p2p import AbortFlag, SliceP2P

    dist.init_process_group("gloo")
    p2p = SliceP2P([0, 1], torch.device("cpu"), 60, abort=AbortFlag.on_default_group("fault_exit/abort"))
    dist.barrier()
    if RANK == 0:
        p2p.abort.set(RANK, 0, "train_batch", "ValueError: simulated refused batch")
        wait_for(out / "finalising")
        raise ValueError("simulated refused batch")
    globals()["_HOLD"] = HoldFinalisation(out / "finalising")
    p2p.recv(0, "activations of micro-batch 0")


def killed(out: Path) -> None:
    from ds_terapipe.runtime.execution.p2p import AbortFlag, SliceP2P

    dist.init_process_group("gloo")
    p2p = SliceP2P([0, 1], torch.device("cpu"), 60, abort=AbortFlag.on_default_group("fault_exit/abort"))
    dist.barrier()
    if RANK == 1:
        time.sleep(60)  # killed by the test
    print("waiting", flush=True)
    p2p.recv(1, "gradients of micro-batch 0")


def engine(out: Path) -> None:
    import ds_terapipe

    from ds_terapipe.models.gpt import GPTConfig, gpt_layer_specs
    from tests.suites.common import make_batches, pipeline_engine

    ds_terapipe.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=13)
    def raising_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("simulated loss failure")

    # the last stage's loss function raises mid-step, while stage 0 waits for the gradients it should send back
    engine = pipeline_engine(cfg, gpt_layer_specs(cfg), {"seq_len": 48, "slices": 3, "schedule": "gpipe",
                                                         "granularity": 4, "p2p_timeout_s": 60}, loss_fn=raising_loss)
    engine.train_batch(iter(make_batches(cfg, 2, 2, 48, seed=21)))


def hung(out: Path) -> None:
    import signal

    import ds_terapipe

    from ds_terapipe.models.gpt import GPTConfig, gpt_layer_specs
    from tests.suites.common import make_batches, pipeline_engine

    ds_terapipe.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=13)
    engine = pipeline_engine(cfg, gpt_layer_specs(cfg), {"seq_len": 48, "slices": 3, "schedule": "gpipe",
                                                         "granularity": 4, "p2p_timeout_s": 3})
    if engine.is_last_stage():
        # hangs (stopped, its connections open) where DeepSpeed aggregates the step's loss, after the schedule
        engine._aggregate_total_loss = lambda: os.kill(os.getpid(), signal.SIGSTOP)
    engine.train_batch(iter(make_batches(cfg, 2, 2, 48, seed=21)))


def closed_first(out: Path) -> None:
    """Three ranks. Rank 2 waits for a transfer from rank 1, which never sends and stays alive (as a rank that
    failed and caught its error does) until rank 2 has stopped, at most ``CLOSED_FIRST_HOLD_S``. Rank 0 closes its
    connections first (its collective watch acted first); then rank 2's watch thread closes rank 2's, whose
    connection to rank 0 is already closed. Rank 2 prints how long its wait lasted."""
    from ds_terapipe.runtime.execution.p2p import _break_connections

    dist.init_process_group("gloo")
    dist.barrier()
    if RANK == 0:
        _break_connections()
        (out / "rank0_closed").write_text("closed")
        wait_for(out / "rank2_stopped", CLOSED_FIRST_HOLD_S)
    elif RANK == 1:
        wait_for(out / "rank2_stopped", CLOSED_FIRST_HOLD_S)
    else:
        def close_after_rank_0() -> None:
            wait_for(out / "rank0_closed")
            time.sleep(0.2)   # rank 0's closed connection has arrived here
            _break_connections()

        closer = threading.Thread(target=close_after_rank_0, daemon=True)
        closer.start()
        started = time.monotonic()
        try:
            dist.recv(torch.zeros(1), 1)
        except RuntimeError:
            pass
        closer.join(10)   # as the engine's watch is joined: a thread still inside gloo at exit aborts the process
        print(f"rank 2: the wait for rank 1 ended after {time.monotonic() - started:.1f} s", flush=True)
        (out / "rank2_stopped").write_text("stopped")


#: how long ranks 0 and 1 of ``closed_first`` stay alive at most (their exit would end rank 2's wait anyway)
CLOSED_FIRST_HOLD_S = 30.0

CASES = {"abandoned": abandoned, "killed": killed, "engine": engine, "hung": hung, "closed_first": closed_first}


@suite("fault_exit", standalone=True)
def suite_fault_exit(out: Path, extra: dict) -> None:
    atexit.register(report_threads)
    torch.set_num_threads(1)
    CASES[extra["case"]](out)

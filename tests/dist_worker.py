"""One rank of a multi-process test: ``python tests/dist_worker.py SUITE OUT_DIR EXTRA_JSON`` (env: RANK, ...).

Runs suite SUITE, defined in tests/suites/SUITE.py (tests/suites/__init__.py: how a suite registers). A suite of
cases runs in one gloo process group, every case of it, after this rank armed its watchdog; the rank writes
``OUT_DIR/rank{R}.json`` (``{"rank": R, "results": [...]}``, or ``"error"`` with the traceback in place of
``"results"``) and leaves together with its peers. A standalone suite is called with OUT_DIR and the extra
arguments and nothing else: it owns the process. DeepSpeed's launcher's ``--local_rank`` argument is ignored.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from tests.fork_server import FORK_SERVER_ENV, FORKED_ENV, request_fork
from tests.suites import is_standalone, load


def main() -> None:
    # a fatal signal (SIGSEGV, SIGBUS, SIGABRT, ...) in native code prints every thread's Python stack to this
    # rank's log before the process dies, so a crash inside torch, gloo or DeepSpeed shows where each thread was
    # (run_local sets PYTHONFAULTHANDLER too; this covers a rank started by hand or by DeepSpeed's launcher)
    faulthandler.enable(all_threads=True)
    args = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]  # DeepSpeed's launcher adds it
    name, out_dir, extra = args[0], Path(args[1]), json.loads(args[2])
    if os.environ.get(FORK_SERVER_ENV) and not is_standalone(name):
        request_fork(os.environ[FORK_SERVER_ENV])   # tests/fork_server.py runs this rank (returns where it does not)
    suite = load(name)
    if suite.standalone and os.environ.get(FORKED_ENV):
        raise SystemExit(f"suite {name!r} is standalone (it decides what is imported before it starts): start it "
                         "with tests/dist_harness.py's run_ranks, not through the fork server")
    if suite.standalone:
        suite.run(out_dir, extra)
    else:
        run_cases(suite.run, out_dir, extra)


def run_cases(run: Callable[[dict], list[dict]], out_dir: Path, extra: dict) -> None:
    # imported here, not above: a standalone suite decides what is imported before it starts
    import torch

    import ds_terapipe
    from ds_terapipe.runtime.execution.p2p import linger_for_peers
    from tests.suites.common import RANK, keep_collections_cheap

    extra.setdefault("out", str(out_dir))
    watchdog(float(os.environ.get("DS_TERAPIPE_WATCHDOG_S", "600")))
    torch.manual_seed(0)
    ds_terapipe.init_distributed(dist_backend="gloo")
    keep_collections_cheap()   # suites that build engines outside tests/suites/common.py's run_cases too
    payload: dict[str, Any] = {"rank": RANK}
    try:
        payload["results"] = run(extra)
    except Exception as err:  # the test prints this; other ranks see the p2p timeout or the launcher kill
        payload["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        print(payload["error"], flush=True)
    (out_dir / f"rank{RANK}.json").write_text(json.dumps(payload, indent=1))
    sys.stdout.flush()
    linger_for_peers()  # what atexit would do after a failure: rank 0 holds the store its peers read
    leave_together(wait="error" not in payload)
    os._exit(0 if "error" not in payload else 1)


def watchdog(seconds: float) -> threading.Timer:
    """On a hang: print where this rank is (case, last pipeline instructions, stacks), then exit non-zero. The
    timer is returned started (a suite may arm one per case and cancel it when the case ends)."""
    from tests.suites.common import ENGINE_REF, RANK, STATUS

    def fire() -> None:
        engine = ENGINE_REF.get("engine")
        trail = list(getattr(engine, "_trail", []))
        print(f"WATCHDOG rank {RANK}: no finish after {seconds:.0f}s in case {STATUS['case']}; "
              f"last instructions: {trail}", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def leave_together(wait: bool, timeout_s: float = 120.0) -> None:
    """Every rank says it is done; global rank 0, which hosts the store every process-group call reads, leaves
    only when all have (at most ``timeout_s``: a rank that died never says it). Why: rank 0 leaving first resets
    a peer still inside a store-based call, such as the barrier of the ``new_group`` a ``PipelineModule`` makes
    (seen once: the last case's refusal came back as ``DistNetworkError: Connection reset by peer`` on one rank)."""
    from tests.suites.common import RANK, WORLD

    try:
        from torch.distributed.distributed_c10d import _get_default_store

        store = _get_default_store()
        store.add("dist_worker/done", 1)
        deadline = time.monotonic() + timeout_s
        while RANK == 0 and wait and store.add("dist_worker/done", 0) < WORLD and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - leaving anyway; the results are written
        pass


if __name__ == "__main__":
    main()

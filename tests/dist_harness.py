"""Launch N local gloo processes running a suite of tests/suites/ (through tests/dist_worker.py) and collect their
results.

Each launch runs many cases in one process group (DeepSpeed engine construction is the expensive part, a new
launch is far more). Ranks are started by :func:`ds_terapipe.runtime.execution.local_launch.run_local` (free port, one
log per rank, deadline, fail-fast, shm cleanup). Every rank of a suite of cases also arms tests/dist_worker.py's
watchdog (``DS_TERAPIPE_WATCHDOG_S``, 15 s before the launch's deadline): past it the rank dumps its stack and the
last instructions it ran to its log and exits, so a hang becomes a failure whose message shows where each rank was.
The ranks of a suite of cases are forks of one server per test session that imported torch, DeepSpeed and
transformers once (tests/fork_server.py; ``DS_TERAPIPE_TEST_FORK_SERVER=0`` turns it off): each is still a process
of its own to the launcher, with its log, exit code and signals.

A launch of a suite of cases whose first failure was a rank dying of SIGSEGV or SIGBUS (a crash inside native code:
gloo, DeepSpeed, torch) is run once more, with a warning that carries the crashed rank's stacks; its logs stay in
OUT_DIR, the second launch runs in OUT_DIR/rerun. Why: such a crash is rare, comes with load on the machine, and no
fault of the project's is known behind it, while a failing CI run lets nothing land. Never run once more: a launch
whose first failure was a Python exception (exit 1), a watchdog (exit 3), an abort (SIGABRT, what the fault-exit
tests guard against) or the deadline, nor a second time. ``run_ranks`` never runs a launch again: its callers judge
the exit codes themselves.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from ds_terapipe.runtime.execution.local_launch import LaunchResult, process_env, run_local
from tests.fork_server import FORK_SERVER_ENV, REFUSED

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "dist_worker.py"
SERVER = Path(__file__).resolve().parent / "fork_server.py"
FORK_RUN = Path(__file__).resolve().parent / "fork_run.py"
#: the signals of a crash in native code that a launch is run once more for (see the module docstring)
CRASH_SIGNALS = (signal.SIGSEGV, signal.SIGBUS)


def _run(argv: list[str], world_size: int, out_dir: Path, timeout_s: float, *, forked: bool = False,
         **options: Any) -> LaunchResult:
    env = {"DS_TERAPIPE_WATCHDOG_S": str(timeout_s - 15)}
    server = fork_server() if forked else None
    if server is not None:
        env[FORK_SERVER_ENV] = server
        if argv[1:2] != [str(RUNNER)]:   # dist_worker.py asks the server itself; another script through the client
            argv = [argv[0], str(FORK_RUN), *argv[1:]]
    return run_local(argv, world_size, out_dir, timeout_s=timeout_s, pythonpath=[ROOT], cwd=ROOT, env=env, **options)


_SERVER: dict[str, Any] = {}


def fork_server() -> str | None:
    """The socket of this session's fork server (tests/fork_server.py: why and how), started on first use; None
    where ``DS_TERAPIPE_TEST_FORK_SERVER=0`` turns it off or it did not start (then every rank is its own process,
    as it would be anyway)."""
    if os.environ.get(FORK_SERVER_ENV) == "0":
        return None
    if "path" not in _SERVER:
        _SERVER["path"] = None
        where = Path(tempfile.mkdtemp(prefix="ds_terapipe_fork_"))
        path, log = where / "socket", where / "server.log"
        # the environment every rank of _run gets, apart from what differs per rank (fork_server.PER_RANK)
        env = process_env(0, 1, 0, pythonpath=[ROOT])
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, str(SERVER), str(path)], env=env, cwd=ROOT, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline and "fork server ready" not in log.read_text():
            time.sleep(0.1)
        atexit.register(_stop_server, proc, where)
        if proc.poll() is None and "fork server ready" in log.read_text():
            _SERVER["path"] = str(path)
        else:
            warnings.warn(f"the fork server did not start (every rank starts its own process): {log.read_text()}",
                          RuntimeWarning, stacklevel=3)
    return _SERVER["path"]


def _stop_server(proc: subprocess.Popen, where: Path) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
    shutil.rmtree(where, ignore_errors=True)


def run_ranks(argv: list[str], world_size: int, out_dir: Path, *, timeout_s: float = 600,
              kill: tuple[int, str] | None = None, fail_fast: bool = True,
              forked: bool = False) -> tuple[list[int | None], list[str]]:
    """Start ``argv`` on ``world_size`` local ranks; return exit codes (None: killed) and each rank's output.

    ``kill=(rank, text)``: SIGKILL that rank once ``text`` appears in rank 0's output (a crash mid-run).
    Past ``timeout_s`` every rank still running is killed; with ``fail_fast``, so is every rank still running
    5 s after one failed (it would only wait for its peer until its own p2p timeout). ``forked``: the ranks are forks of
    the session's fork server (``launch`` always does that): tests/dist_worker.py's suites of cases (a standalone
    suite is never forked), and any other script through tests/fork_run.py.
    """
    result = _run(argv, world_size, out_dir, timeout_s, kill=kill, fail_fast=fail_fast, forked=forked)
    return result.codes, result.texts()


def suite_command(suite: str, out_dir: Path, extra: dict | None = None) -> list[str]:
    """The command line of one rank of ``suite`` (tests/suites/<suite>.py)."""
    return [sys.executable, str(RUNNER), suite, str(out_dir), json.dumps(extra or {})]


def launch(suite: str, world_size: int, out_dir: Path, *, timeout_s: float = 600,
           extra: dict | None = None) -> list[dict[str, Any]]:
    """Run the suite of cases ``suite`` on ``world_size`` ranks; return each rank's result dict. A launch that
    failed first by a rank's crash in native code runs once more (the module docstring says when and why)."""
    result, rerun = _run(suite_command(suite, out_dir, extra), world_size, out_dir, timeout_s, forked=True), ""
    if crashed_first(result):
        warnings.warn(f"suite {suite!r} on {world_size} rank(s): rank {result.first_failed} crashed in native code "
                      "before any other failure; running the launch once more in "
                      f"{out_dir / 'rerun'} (logs of the crashed launch: {out_dir})\n" + result.failure_report(10),
                      RuntimeWarning, stacklevel=2)
        out_dir, rerun = out_dir / "rerun", f" (run once more after a crash: logs of the first launch in {out_dir})"
        result = _run(suite_command(suite, out_dir, extra), world_size, out_dir, timeout_s, forked=True)
    if not result.ok:
        raise AssertionError(f"suite {suite!r} on {world_size} rank(s) failed or timed out after {timeout_s}s"
                             f"{rerun}\n" + result.failure_report(40))
    refused = [line for text in result.texts() for line in text.splitlines() if line.startswith(REFUSED)]
    if refused:   # correct, only slow (each such rank imported torch, DeepSpeed and transformers itself)
        warnings.warn(f"suite {suite!r}: {len(refused)} of {world_size} rank(s) started as their own process: "
                      f"{refused[0]}", RuntimeWarning, stacklevel=2)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]


def crashed_first(result: LaunchResult) -> bool:
    """Whether a launch failed first by a crash in native code: the rank that failed first died of one of
    ``CRASH_SIGNALS``."""
    return result.first_failed is not None and result.codes[result.first_failed] in [-sig for sig in CRASH_SIGNALS]

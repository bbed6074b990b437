"""Launch N local gloo processes running a suite of tests/suites/ (through tests/dist_worker.py) and collect their
results.

Each launch runs many cases in one process group (DeepSpeed engine construction is the expensive part, a new
launch is far more). Ranks are started by :func:`ds_terapipe.runtime.execution.local_launch.run_local` (free port, one
log per rank, deadline, fail-fast, shm cleanup). Every rank of a suite of cases also arms tests/dist_worker.py's
watchdog (``DS_TERAPIPE_WATCHDOG_S``, 15 s before the launch's deadline): past it the rank dumps its stack and the
last instructions it ran to its log and exits, so a hang becomes a failure whose message shows where each rank was.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from ds_terapipe.runtime.execution.local_launch import LaunchResult, run_local

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "dist_worker.py"


def _run(argv: list[str], world_size: int, out_dir: Path, timeout_s: float, **options: Any) -> LaunchResult:
    return run_local(argv, world_size, out_dir, timeout_s=timeout_s, pythonpath=[ROOT], cwd=ROOT,
                     env={"DS_TERAPIPE_WATCHDOG_S": str(timeout_s - 15)}, **options)


def run_ranks(argv: list[str], world_size: int, out_dir: Path, *, timeout_s: float = 600,
              kill: tuple[int, str] | None = None, fail_fast: bool = True) -> tuple[list[int | None], list[str]]:
    """Start ``argv`` on ``world_size`` local ranks; return exit codes (None: killed) and each rank's output.

    ``kill=(rank, text)``: SIGKILL that rank once ``text`` appears in rank 0's output (a crash mid-run).
    Past ``timeout_s`` every rank still running is killed; with ``fail_fast``, so is every rank still running
    5 s after one failed (it would only wait for its peer until its own p2p timeout).
    """
    result = _run(argv, world_size, out_dir, timeout_s, kill=kill, fail_fast=fail_fast)
    return result.codes, result.texts()


def suite_command(suite: str, out_dir: Path, extra: dict | None = None) -> list[str]:
    """The command line of one rank of ``suite`` (tests/suites/<suite>.py)."""
    return [sys.executable, str(RUNNER), suite, str(out_dir), json.dumps(extra or {})]


def launch(suite: str, world_size: int, out_dir: Path, *, timeout_s: float = 600,
           extra: dict | None = None) -> list[dict[str, Any]]:
    """Run the suite of cases ``suite`` on ``world_size`` ranks; return each rank's result dict."""
    result = _run(suite_command(suite, out_dir, extra), world_size, out_dir, timeout_s)
    if not result.ok:
        raise AssertionError(f"suite {suite!r} on {world_size} rank(s) failed or timed out after {timeout_s}s\n"
                             + result.failure_report(40))
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]

"""Start a benchmark's workers on local ranks and collect their results.

The convention: the benchmark script is also its worker. The parent runs ``script --worker OUT_DIR OPTS_JSON``
on every rank (:func:`launch_workers`); each worker does its part, writes ``OUT_DIR/rank{R}.json`` and prints
progress lines starting ``[rank 0]`` on rank 0, which the parent echoes as they come. Processes are started by
:func:`ds_terapipe.runtime.execution.local_launch.run_local` (free port, one log per rank, deadline, fail-fast,
DeepSpeed shm
cleanup), the launcher the tests use too.

Worker side: :func:`run_as_worker` (through :func:`worker_args`) recognises the worker invocation and runs it;
:func:`pin_and_single_thread` pins the process to one core per rank and leaves torch one thread, before anything
else imports torch.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ds_terapipe.log import configure_logging
from ds_terapipe.runtime.execution.local_launch import run_local

from .tables import ROOT

__all__ = ["launch_workers", "pin_and_single_thread", "run_as_worker", "worker_args"]

WORKER_FLAG = "--worker"


def launch_workers(script: Path, world_size: int, out_dir: Path, opts: dict, *, timeout_s: float,
                   echo_prefix: str = "[rank 0]") -> list[dict[str, Any]]:
    """Run ``script --worker out_dir opts`` on ``world_size`` local ranks; return each rank's ``rank{R}.json``.

    Lines of rank 0's log starting with ``echo_prefix`` are printed as they appear. A worker that fails or a
    launch past ``timeout_s`` ends the benchmark (SystemExit) with every rank's last log lines.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = 0

    def echo_rank0() -> None:
        nonlocal shown
        log = out_dir / "rank0.log"
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        for line in lines[shown:]:
            if line.startswith(echo_prefix):
                print(line, flush=True)
        shown = len(lines)

    argv = [sys.executable, str(Path(script).resolve()), WORKER_FLAG, str(out_dir), json.dumps(opts)]
    result = run_local(argv, world_size, out_dir, timeout_s=timeout_s, pythonpath=[ROOT], cwd=ROOT,
                       fail_fast_grace_s=3.0, on_poll=echo_rank0, poll_s=1.0)
    if not result.ok:
        raise SystemExit(f"benchmark workers failed or timed out after {timeout_s:.0f}s (logs in {out_dir})\n"
                         + result.failure_report(30))
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def run_as_worker(worker_main: Callable[[Path, dict], Any]) -> bool:
    """A benchmark script's first step: show ds_terapipe's logs, and when this process was started by
    :func:`launch_workers`, run ``worker_main(out_dir, opts)`` and return True (the script then returns)."""
    configure_logging()
    worker = worker_args()
    if worker is None:
        return False
    worker_main(*worker)
    return True


def worker_args(argv: list[str] | None = None) -> tuple[Path, dict] | None:
    """``(out_dir, opts)`` when this process was started as a worker by :func:`launch_workers`, else None."""
    argv = sys.argv if argv is None else argv
    if len(argv) > 1 and argv[1] == WORKER_FLAG:
        return Path(argv[2]), json.loads(argv[3])
    return None


def pin_one_core(core: int | None = None) -> None:
    """This process on one thread of torch compute and one CPU core (``core``, default the last usable one), as
    the single-process CPU benchmarks run: a shared host's load then moves fewer samples."""
    import torch

    torch.set_num_threads(1)
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core if core is not None else max(os.sched_getaffinity(0))})


def pin_and_single_thread(rank: int, bind_cores: bool) -> None:
    """One thread of torch compute per process and, with ``bind_cores``, the process on core ``rank`` (mod the
    usable cores), like the deepspeed launcher's ``--bind_cores_to_rank``. Call before importing torch elsewhere:
    threads started before the pin would not inherit it."""
    if bind_cores:
        cores = sorted(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    import torch

    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:   # already set, or the pool already started: keep what is there
        pass

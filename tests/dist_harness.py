"""Launch N local gloo processes running tests/dist_worker.py and collect their results.

Each launch runs many cases in one process group (DeepSpeed engine construction is the expensive part, a new
launch is far more). Ports are free ports, never fixed. Every rank has a watchdog: past its deadline it dumps
its stack and the last instructions it ran to its log and exits, and the launcher kills the rest, so a hang
becomes a failure whose message shows where each rank was.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from ds_terapipe.runtime.shm import remove_shm_segments

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_ranks(argv: list[str], world_size: int, out_dir: Path, *, timeout_s: float = 600,
              kill: tuple[int, str] | None = None, fail_fast: bool = True) -> tuple[list[int | None], list[str]]:
    """Start ``argv`` on ``world_size`` local ranks; return exit codes (None: killed) and each rank's output.

    ``kill=(rank, text)``: SIGKILL that rank once ``text`` appears in rank 0's output (a crash mid-run).
    Past ``timeout_s`` every rank still running is killed; with ``fail_fast``, so is every rank still running
    5 s after one failed (it would only wait for its peer until its own p2p timeout).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), LOCAL_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   DS_TERAPIPE_WATCHDOG_S=str(timeout_s - 15))
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + timeout_s
    killed: set[int] = set()
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if fail_fast and any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + 5)
        if kill is not None and kill[0] not in killed and \
                kill[1] in (out_dir / "rank0.log").read_text(errors="replace"):
            procs[kill[0]].kill()
            killed.add(kill[0])
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()
    for log in logs:
        log.close()
    remove_shm_segments(port)  # DeepSpeed's CPU allreduce never unlinks its 66 MB segments
    codes = [None if i in killed else p.returncode for i, p in enumerate(procs)]
    texts = [(out_dir / f"rank{rank}.log").read_text(errors="replace") for rank in range(world_size)]
    return codes, texts


def launch(suite: str, world_size: int, out_dir: Path, *, timeout_s: float = 600,
           extra: dict | None = None) -> list[dict[str, Any]]:
    """Run ``suite`` of tests/dist_worker.py on ``world_size`` ranks; return each rank's result dict."""
    argv = [sys.executable, str(WORKER), suite, str(out_dir), json.dumps(extra or {})]
    codes, texts = run_ranks(argv, world_size, out_dir, timeout_s=timeout_s)
    if any(code != 0 for code in codes):
        tails = [f"--- rank {rank} (exit {codes[rank]}) last lines:\n" + "\n".join(text.splitlines()[-40:])
                 for rank, text in enumerate(texts)]
        raise AssertionError(f"suite {suite!r} on {world_size} rank(s) failed or timed out after {timeout_s}s\n"
                             + "\n".join(tails))
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(world_size)]

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

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "dist_worker.py"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(suite: str, world_size: int, out_dir: Path, *, timeout_s: float = 600, extra: dict | None = None,
           expect_fail: bool = False) -> list[dict[str, Any]]:
    """Run ``suite`` on ``world_size`` ranks; return each rank's result dict (rank order)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs, logs = [], []
    for rank in range(world_size):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                   LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                   DS_TERAPIPE_WATCHDOG_S=str(timeout_s - 15))
        log = open(out_dir / f"rank{rank}.log", "w")
        logs.append(log)
        args = [sys.executable, str(WORKER), suite, str(out_dir), json.dumps(extra or {})]
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
    deadline = time.monotonic() + timeout_s
    failed = False
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or (not expect_fail and any(p.poll() not in (None, 0) for p in procs)):
            failed = True
            time.sleep(3 if time.monotonic() <= deadline else 0)  # let the others report their own error
            for p in procs:
                if p.poll() is None:
                    p.kill()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    for log in logs:
        log.close()
    codes = [p.returncode for p in procs]
    if (failed or any(codes)) and not expect_fail:
        tails = []
        for rank in range(world_size):
            text = (out_dir / f"rank{rank}.log").read_text(errors="replace").splitlines()
            tails.append(f"--- rank {rank} (exit {codes[rank]}) last lines:\n" + "\n".join(text[-40:]))
        raise AssertionError(f"suite {suite!r} on {world_size} rank(s) failed or timed out after {timeout_s}s\n"
                             + "\n".join(tails))
    results = []
    for rank in range(world_size):
        path = out_dir / f"rank{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "exit": codes[rank]})
    return results

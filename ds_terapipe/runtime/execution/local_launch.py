"""Start N local ranks of a command the way a distributed launcher would, and collect what they left behind.

A test or a benchmark on one machine needs what ``torchrun``/``deepspeed`` give each process (``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...), plus what those launchers do not: a *free* port (never a
fixed one: parallel runs on one machine would collide), every rank's output in its own log file, a deadline
after which hung ranks are killed, fail-fast (when one rank fails, its peers would only wait for it until their
own p2p timeout), an optional kill of one rank mid-run (a crash test), every thread's Python stack in the log of a
rank that dies of a fatal signal (``PYTHONFAULTHANDLER``), and removal of the shared-memory segments DeepSpeed's CPU
allreduce leaves behind (:mod:`ds_terapipe.runtime.execution.shm`).

    result = run_local([sys.executable, "worker.py"], 2, Path("logs"), timeout_s=300)
    if not result.ok:
        raise RuntimeError(result.failure_report())

Standard library only (no torch, no DeepSpeed): the parent process of a launch stays cheap.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ds_terapipe.runtime.execution.shm import remove_shm_segments

__all__ = ["LaunchResult", "free_port", "process_env", "rank_env", "run_local"]

#: the first line of faulthandler's dump (``PYTHONFAULTHANDLER``), then one block per Python thread, newest first,
#: the crashing one headed "Current thread" (none of them when a native thread crashed)
FATAL_ERROR = "Fatal Python error"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it), for ``MASTER_PORT``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def rank_env(rank: int, world_size: int, port: int, *, host: str = "127.0.0.1",
             threads: int | None = 1) -> dict[str, str]:
    """The environment variables torch.distributed and DeepSpeed read, for ``rank`` of ``world_size`` local ranks.

    ``threads``: ``OMP_NUM_THREADS``/``MKL_NUM_THREADS`` per rank (None: inherit). Ranks that share a CPU's
    cores and each start one thread per core spin against each other (10x slower on 2 cores).
    """
    env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
           "LOCAL_WORLD_SIZE": str(world_size), "LOCAL_SIZE": str(world_size),
           "MASTER_ADDR": host, "MASTER_PORT": str(port)}
    if threads is not None:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


def process_env(rank: int, world_size: int, port: int, *, env: Mapping[str, str] | None = None,
                pythonpath: Sequence[Path | str] = (), threads: int | None = 1) -> dict[str, str]:
    """The whole environment :func:`run_local` gives ``rank``: this process's (``PYTHONFAULTHANDLER=1`` where it
    does not say otherwise: a rank that dies of a fatal signal prints every thread's Python stack to its log),
    :func:`rank_env` on top, ``env`` on top of that, and ``pythonpath`` prepended to ``PYTHONPATH``."""
    out = {"PYTHONFAULTHANDLER": "1", **os.environ, **rank_env(rank, world_size, port, threads=threads), **(env or {})}
    extra_path = os.pathsep.join(str(p) for p in pythonpath)
    if extra_path:
        out["PYTHONPATH"] = os.pathsep.join(filter(None, [extra_path, out.get("PYTHONPATH")]))
    return out


@dataclass(frozen=True)
class LaunchResult:
    """What a launch left: exit codes (None: killed on purpose by ``kill=``), log files, the port it used, and
    ``first_failed``: the rank whose process ended first of those that failed by themselves (exited non-zero or died
    of a signal, not killed by the launcher), None when none did. Its peers usually fail within milliseconds of it
    (a closed connection), so it is told apart by when each process ended, not by the launcher's polls."""

    codes: list[int | None]
    logs: list[Path]
    port: int
    timeout_s: float
    first_failed: int | None = None

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.codes)

    def texts(self) -> list[str]:
        """Each rank's whole output (stdout and stderr interleaved)."""
        return [log.read_text(errors="replace") for log in self.logs]

    def failure_report(self, lines: int = 40, fatal_lines: int = 1000) -> str:
        """The last ``lines`` lines of every rank's log, headed by its exit code (and the signal that ended it):
        enough to see where each stood. A rank that died of a fatal signal shows the ``lines`` lines before
        faulthandler's dump, then the dump (at most ``fatal_lines`` of it) with the crashing thread's stack first:
        the dump lists the threads newest first, so a tail alone shows the oldest (the main thread), and the helper
        thread that crashed may be dozens of threads above it."""
        parts = []
        for rank, text in enumerate(self.texts()):
            code, log = self.codes[rank], text.splitlines()
            fatal = next((i for i in range(len(log) - 1, -1, -1) if log[i].startswith(FATAL_ERROR)), None)
            if fatal is None:
                shown = log[-lines:]
            else:
                shown = log[max(0, fatal - lines):fatal] + _dump(log[fatal:], fatal_lines)
            how = f"{code}, {_signal_name(-code)}" if code is not None and code < 0 else f"{code}"
            parts.append(f"--- rank {rank} (exit {how}) last lines:\n" + "\n".join(shown))
        return "\n".join(parts)


def _dump(dump: list[str], limit: int) -> list[str]:
    """faulthandler's dump (its first line, then one block per thread after a blank line) with the crashing
    thread's block ("Current thread ...") moved right after the first line, cut to ``limit`` lines."""
    blocks: list[list[str]] = [[]]
    for line in dump[1:]:
        if not line.strip():
            blocks.append([])
        else:
            blocks[-1].append(line)
    blocks = [b for b in blocks if b]
    blocks.sort(key=lambda block: not block[0].startswith("Current thread"))   # stable: the others keep their order
    out = [dump[0]] + [line for block in blocks for line in ["", *block]]
    return out if len(out) <= limit else out[:limit] + [f"[... {len(out) - limit} more line(s) of the dump]"]


def _signal_name(number: int) -> str:
    """``SIGSEGV`` for 11, and so on; ``signal <n>`` for a number the platform does not name."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def run_local(argv: Sequence[str], world_size: int, log_dir: Path, *, timeout_s: float = 600,
              env: Mapping[str, str] | None = None, pythonpath: Sequence[Path | str] = (),
              cwd: Path | str | None = None, threads: int | None = 1, fail_fast: bool = True,
              fail_fast_grace_s: float = 5.0, kill: tuple[int, str] | None = None,
              on_poll: Callable[[], None] | None = None, poll_s: float = 0.2) -> LaunchResult:
    """Run ``argv`` as ``world_size`` local ranks; wait for them; return their exit codes and logs.

    Each rank gets :func:`process_env` (this process's environment, :func:`rank_env`, ``env``, ``pythonpath``).
    Rank r writes stdout and stderr to ``log_dir/rank{r}.log``.
    Past ``timeout_s`` every rank still running is killed. With ``fail_fast``, so is every rank still running
    ``fail_fast_grace_s`` after one exited non-zero (time to write its traceback). ``kill=(rank, text)``:
    SIGKILL that rank once ``text`` appears in rank 0's log (its code is then None). ``on_poll`` is called
    every ``poll_s`` seconds while ranks run (e.g. to echo progress from the logs). DeepSpeed's shm segments
    of the run are removed at the end, whatever happened.
    """
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    paths = [log_dir / f"rank{rank}.log" for rank in range(world_size)]
    procs: list[subprocess.Popen] = []
    killed: set[int] = set()     # by kill=
    stopped: set[int] = set()    # by the deadline or fail-fast
    ended: dict[int, float] = {}  # rank -> time.monotonic() when its process ended
    watchers: list[threading.Thread] = []
    try:
        for rank in range(world_size):
            rank_vars = process_env(rank, world_size, port, env=env, pythonpath=pythonpath, threads=threads)
            with open(paths[rank], "w") as log:   # the child keeps its own copy of the descriptor
                procs.append(subprocess.Popen(list(argv), env=rank_vars, stdout=log, stderr=subprocess.STDOUT,
                                              cwd=cwd))
            watchers.append(threading.Thread(target=_note_end, args=(procs[-1].pid, rank, ended), daemon=True))
            watchers[-1].start()
        deadline = time.monotonic() + timeout_s
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if fail_fast and any(p.poll() not in (None, 0) for p in procs):
                deadline = min(deadline, time.monotonic() + fail_fast_grace_s)
            if kill is not None and kill[0] not in killed and kill[1] in paths[0].read_text(errors="replace"):
                procs[kill[0]].kill()
                killed.add(kill[0])
            if on_poll is not None:
                on_poll()
            time.sleep(poll_s)
        if on_poll is not None:
            on_poll()
    finally:
        for rank, p in enumerate(procs):
            if p.poll() is None:
                p.kill()
                stopped.add(rank)
        for p in procs:
            p.wait()
        for watcher in watchers:
            watcher.join(timeout=5.0)
        remove_shm_segments(port)  # DeepSpeed's CPU allreduce never unlinks its 66 MB segments
    codes = [None if rank in killed else p.returncode for rank, p in enumerate(procs)]
    failed = [rank for rank, code in enumerate(codes) if code not in (None, 0) and rank not in stopped]
    first_failed = min(failed, key=lambda rank: ended.get(rank, float("inf")), default=None)
    return LaunchResult(codes=codes, logs=paths, port=port, timeout_s=timeout_s, first_failed=first_failed)


def _note_end(pid: int, rank: int, ended: dict[int, float]) -> None:
    """Record when process ``pid`` ends, without reaping it (``Popen`` does that): the order in which ranks ended,
    to milliseconds, which polling every ``poll_s`` cannot give."""
    try:
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    except ChildProcessError:   # already reaped: it ended before now
        pass
    ended[rank] = time.monotonic()

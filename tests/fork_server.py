"""A fork server for the ranks of the multi-process suites: ``python tests/fork_server.py SOCKET``.

Why: a rank of a suite spends 5-9 s of CPU importing torch, DeepSpeed, dynamo (which DeepSpeed's optimizers import)
and transformers before its first case, and a launch of 4 ranks on 2 cores waits for four of them; over the suite's
~190 ranks that is about a fifth of its time. This process imports them once; each rank is then a fork of it.

How: tests/dist_worker.py (or tests/fork_run.py, for any other script), started by the launcher as usual (its own
process, its own log, its exit code, killed as any process is), connects to ``SOCKET`` when ``FORK_SERVER_ENV``
names it, and sends its argv, environment, working directory and its stdin/stdout/stderr (file descriptors over the
Unix socket). The server forks; the child takes those descriptors, that environment and directory and runs the
script as ``__main__``, as ``python script.py`` would (exit codes, uncaught exceptions, atexit, fatal signals
alike). The server reports the child's pid, then its wait status; the client ends the same way (the same exit code,
or the same signal). A client that dies (the launcher's deadline, fail-fast or ``kill=``) gets its child SIGKILLed
at once: the server watches the connection.

What could differ from a fresh process, and how it is kept the same or refused:
* the environment the imports saw: a request whose environment differs from the server's in anything but the
  variables a rank gets (``RANK`` and the rest of ``local_launch.rank_env``, threads, faulthandler, the project's
  ``DS_TERAPIPE_*``, pytest's current test, or a value the server's own imports set) is refused, and the client
  runs the script itself;
* threads: the server runs no torch op (OpenMP never starts) and is single-threaded (select and a SIGCHLD wakeup
  fd); the child sets torch's thread count from its ``OMP_NUM_THREADS``;
* the garbage collector: what the server imported is frozen (``gc.freeze``); a fresh process's collector walks
  those objects in every full collection, and never frees them either;
* nothing of the project is imported here (its modules read ``RANK`` and the like at import): each child imports
  them itself, in well under a second.
The server leaves when its parent (the pytest process) does, or on SIGTERM.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

#: the environment variable that names the server's socket to tests/dist_worker.py
FORK_SERVER_ENV = "DS_TERAPIPE_TEST_FORK_SERVER"
#: set in a forked rank's environment (tests/dist_worker.py refuses to run a standalone suite there)
FORKED_ENV = "DS_TERAPIPE_TEST_FORKED"
#: how a rank's log begins the line saying it was not forked (refused, or no server), and why
REFUSED = "fork server not used"
#: variables a request may set to other values than the server's: what differs from rank to rank or test to test
#: and is read after the imports
PER_RANK = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "OMP_NUM_THREADS", "MKL_NUM_THREADS", "PYTHONFAULTHANDLER", "PYTEST_CURRENT_TEST", FORK_SERVER_ENV}
PER_RANK_PREFIXES = ("DS_TERAPIPE_",)
#: the heavy imports every rank of a suite makes (transformers' model modules are loaded on first attribute access)
PRELOAD = ["torch", "torch.distributed", "deepspeed", "deepspeed.runtime.engine", "deepspeed.runtime.pipe.engine",
           "deepspeed.runtime.bf16_optimizer", "deepspeed.runtime.zero.stage_1_and_2",
           "deepspeed.runtime.zero.muon.muon_optimizer", "transformers"]
HF_CLASSES = ["LlamaForCausalLM", "MistralForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM",
              "Llama4ForCausalLM", "Qwen2ForCausalLM"]
MAX_REQUEST = 1 << 20


class _Start(BaseException):
    """Raised in a forked child to leave the server's loop and run the request at the top of the stack."""

    def __init__(self, request: dict[str, Any], fds: list[int]) -> None:
        super().__init__()
        self.request, self.fds = request, fds


def env_difference(theirs: dict[str, str], ours: dict[str, str], set_by_imports: dict[str, str] | None = None
                   ) -> list[str]:
    """The variables (sorted) by which a request's environment differs from the server's where that matters.

    ``ours`` is the server's environment before its imports; ``set_by_imports`` what those imports set. A request
    that already holds a value the imports set (the test process imported torch's inductor too, which sets
    ``TORCHINDUCTOR_CACHE_DIR``) differs in nothing the child would not have: it starts from those values anyway."""
    names, made = set(theirs) | set(ours), set_by_imports or {}
    return sorted(n for n in names if theirs.get(n) != ours.get(n) and n not in PER_RANK
                  and not n.startswith(PER_RANK_PREFIXES) and not (n in made and theirs.get(n) == made[n]))


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:   # transformers is optional ("hf" extra); the ranks that need it import it themselves
            pass
    transformers = sys.modules.get("transformers")
    for cls in HF_CLASSES if transformers is not None else []:
        try:
            getattr(transformers, cls)
        except (AttributeError, ImportError):
            pass
    # DeepSpeed's table of the ops this machine can build, probed once here (compiler subprocesses, ~0.15 s a
    # process) with the shared-memory all-reduce marked as each rank's ds_terapipe.init_distributed marks it
    from ds_terapipe.runtime.execution.shm import skip_shm_allreduce_op

    skip_shm_allreduce_op()
    # What the imports made lives as long as the server: frozen (out of the collector's sight), a full collection in
    # a child no longer walks those ~400k objects. Each rank's first one (keep_collections_cheap in
    # tests/suites/common.py) took 0.5-1.2 s of CPU, and its walk copied ~110 MB of the server's pages into the rank.
    gc.collect()
    gc.freeze()


def serve(path: str) -> None:
    """Accept requests on ``path`` until the parent leaves or SIGTERM; raises ``_Start`` in each forked child."""
    server, parent = os.getpid(), os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)   # a handler, so that the wakeup fd hears of every child's end
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    clients: dict[int, socket.socket | None] = {}   # pid -> its client's connection (None: the client is gone)
    try:
        print(f"fork server ready: pid {server}, {path}", flush=True)
        while os.getppid() == parent:
            watched = [c for c in clients.values() if c is not None]
            ready, _, _ = select.select([listener, wake_r, *watched], [], [], 1.0)
            if wake_r in ready:
                os.read(wake_r, 4096)
            for pid, status in _reaped():
                conn = clients.pop(pid, None)
                if conn is not None:
                    _send(conn, {"status": status})
                    conn.close()
            for pid, conn in list(clients.items()):
                if conn is not None and conn in ready and not conn.recv(16):   # the client was killed: so is its rank
                    os.kill(pid, signal.SIGKILL)
                    conn.close()
                    clients[pid] = None
            if listener in ready:
                _fork(listener, clients, (wake_r, wake_w))
    finally:
        if os.getpid() == server:
            for pid in clients:
                os.kill(pid, signal.SIGKILL)
            Path(path).unlink(missing_ok=True)


def _fork(listener: socket.socket, clients: dict[int, socket.socket | None], wake: tuple[int, int]) -> None:
    """Take one request: refuse it, or fork its process (raising ``_Start`` in the child)."""
    conn, _ = listener.accept()
    try:
        data, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 3)
        request = json.loads(data)
    except (OSError, ValueError) as err:
        print(f"fork server: unreadable request ({err})", flush=True)
        conn.close()
        return
    refused = env_difference(request["env"], _BEFORE_IMPORTS, _SET_BY_IMPORTS)
    if refused or len(fds) != 3:
        _send(conn, {"refused": f"the environment differs in {refused}" if refused else "3 descriptors needed"})
        conn.close()
        for fd in fds:
            os.close(fd)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in clients.values():
            if other is not None:
                other.close()
        conn.close()
        for fd in wake:
            os.close(fd)
        raise _Start(request, fds)
    for fd in fds:
        os.close(fd)
    clients[pid] = conn
    _send(conn, {"pid": pid})


def _reaped() -> list[tuple[int, int]]:
    out = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return out
        if pid == 0:
            return out
        out.append((pid, status))


def _send(conn: socket.socket, message: dict) -> None:
    try:
        conn.send(json.dumps(message).encode())
    except OSError:   # the client is gone
        pass


def run_child(start: _Start) -> None:
    """In the forked child: become the requested process, then run its script as ``__main__``."""
    import runpy

    signal.set_wakeup_fd(-1)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    for target, fd in enumerate(start.fds):
        os.dup2(fd, target)
        os.close(fd)
    request = start.request
    os.environ.clear()
    # what the imports set (torch, dynamo: PYTORCH_NVML_BASED_CUDA_CHECK, TORCHINDUCTOR_CACHE_DIR), then the request's
    os.environ.update(_SET_BY_IMPORTS)
    os.environ.update({k: v for k, v in request["env"].items() if k != FORK_SERVER_ENV})
    os.environ[FORKED_ENV] = "1"
    os.chdir(request["cwd"])
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    if os.environ.get("PYTHONFAULTHANDLER"):
        import faulthandler

        faulthandler.enable(all_threads=True)
    sys.argv = list(request["argv"])
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))   # as `python SCRIPT` sets it (the server's: tests/)
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exit:   # what the interpreter makes of sys.exit(...)
        code = exit.code if isinstance(exit.code, int) else 0 if exit.code is None else 1
        if not isinstance(exit.code, (int, type(None))):
            print(exit.code, file=sys.stderr)
    except BaseException:   # noqa: BLE001 - an uncaught exception: its traceback, exit code 1
        sys.excepthook(*sys.exc_info())
        code = 1
    _exit(code)


def _exit(code: int) -> None:
    """Leave as the interpreter would (non-daemon threads joined, atexit handlers, stdio flushed), without the
    teardown of every module the server imported: 2 s of CPU per rank at its end, for nothing."""
    import atexit
    import threading

    getattr(threading, "_shutdown", lambda: None)()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def request_fork(path: str) -> None:
    """Client side (tests/dist_worker.py): have the server at ``path`` run this process's argv; mirror how the
    child ended (this function does not return then). Returns None, having printed why, where the server refused
    or cannot be reached: the caller runs the script itself."""
    request = {"argv": sys.argv, "env": dict(os.environ), "cwd": os.getcwd()}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(MAX_REQUEST) or b"{}")
    except (OSError, ValueError) as err:
        print(f"{REFUSED} (the server at {path}: {err}): starting this rank in its own process", flush=True)
        return None
    if "pid" not in reply:
        print(f"{REFUSED} ({reply.get('refused', 'no reply')}): starting this rank in its own process",
              flush=True)
        return None
    pid = reply["pid"]
    try:
        reply = json.loads(conn.recv(MAX_REQUEST) or b"{}")
    except (OSError, ValueError):
        reply = {}
    if "status" not in reply:   # the server is gone: so must the rank be
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        print(f"fork server lost before rank process {pid} ended", flush=True)
        os._exit(1)
    status = reply["status"]
    if os.WIFSIGNALED(status):
        import faulthandler

        faulthandler.disable()   # the child printed its stacks; this process dies of the same signal silently
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        time.sleep(1.0)
        os._exit(128 + sig)
    os._exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    _BEFORE_IMPORTS = dict(os.environ)
    _preload()
    _SET_BY_IMPORTS = {k: v for k, v in os.environ.items() if _BEFORE_IMPORTS.get(k) != v}
    child = None
    try:
        serve(sys.argv[1])
    except _Start as start:   # in a forked child: the server's stack is left behind
        child = start
        child.__traceback__ = None
    if child is not None:
        run_child(child)   # outside the except block: the script's own tracebacks are not chained to it

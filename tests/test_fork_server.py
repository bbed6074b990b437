"""tests/fork_server.py: a rank run as a fork of the server ends, to the launcher, as the same script run as a
process of its own would (exit code, uncaught exception, fatal signal, its log), dies when the launcher kills it,
and is refused (started as its own process) where its environment differs from the one the server imported in.
Plain Python ranks on the session's server, a few seconds in all."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from ds_terapipe.runtime.execution.local_launch import run_local
from tests.dist_harness import ROOT, fork_server
from tests.fork_server import FORK_SERVER_ENV, FORKED_ENV, REFUSED, env_difference

RANK_SCRIPT = f"""
import gc, os, signal, sys, time
sys.path.insert(0, {str(ROOT)!r})
from tests.fork_server import request_fork
print("client", os.getpid(), flush=True)
if os.environ.get({FORK_SERVER_ENV!r}):
    request_fork(os.environ[{FORK_SERVER_ENV!r}])
print("rank", os.environ["RANK"], "pid", os.getpid(), "forked", os.environ.get({FORKED_ENV!r}), "torch loaded",
      "torch" in sys.modules, "threads", os.environ["OMP_NUM_THREADS"], "imports frozen", gc.get_freeze_count() > 0,
      flush=True)
how = sys.argv[1]
if how == "exit 3":
    sys.exit(3)
if how == "raise":
    raise ValueError("raised in the rank")
if how == "segv" and os.environ["RANK"] == "0":
    os.kill(os.getpid(), signal.SIGSEGV)
if how == "hang":   # each rank notes its pid; rank 0 says when both have
    pids = os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "pids")
    os.makedirs(pids, exist_ok=True)
    open(os.path.join(pids, os.environ["RANK"]), "w").write(str(os.getpid()))
    while os.environ["RANK"] == "0" and len(os.listdir(pids)) < 2:
        time.sleep(0.05)
    print("both started", flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def server() -> str:
    path = fork_server()
    if path is None:
        pytest.skip("the fork server is off (DS_TERAPIPE_TEST_FORK_SERVER=0) or did not start")
    return path


def _launch(tmp_path: Path, server: str, how: str, **options) -> tuple[list, list[str]]:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {FORK_SERVER_ENV: server, **options.pop("env", {})}
    result = run_local([sys.executable, str(script), how], 2, tmp_path / "logs", env=env, pythonpath=[ROOT],
                       cwd=ROOT, fail_fast=False, **options)
    return result.codes, result.texts()


def _pids(texts: list[str]) -> list[tuple[int, int]]:
    """(client pid, rank pid) of each rank."""
    return [(int(t.split("client ")[1].split()[0]), int(t.split(" pid ")[1].split()[0])) for t in texts]


@pytest.mark.parametrize("how, codes, shown", [
    ("exit 0", [0, 0], None), ("exit 3", [3, 3], None),
    ("raise", [1, 1], "ValueError: raised in the rank"),
    ("segv", [-signal.SIGSEGV, 0], "Fatal Python error: Segmentation fault")])
def test_a_forked_rank_ends_as_its_own_process_would(tmp_path, server, how, codes, shown) -> None:
    got, texts = _launch(tmp_path, server, how)
    assert got == codes, (got, texts)
    for rank, text in enumerate(texts):
        assert f"rank {rank} pid" in text and "forked 1 torch loaded True threads 1 imports frozen True" in text, text
        client, pid = _pids([text])[0]
        assert client != pid, text   # a fork of the server, not the launched process
    if shown:
        # the rank's own report, once (the client mirrors the signal without a second dump), nothing of the server
        assert texts[0].count(shown) == 1 and "_Start" not in texts[0], texts[0]


@pytest.mark.parametrize("stop", ["kill", "deadline"])
def test_a_forked_rank_dies_with_the_process_the_launcher_killed(tmp_path, server, stop) -> None:
    """``kill=``: rank 1 as soon as both run (rank 0 at the deadline); the deadline: both."""
    options = {"kill": (1, "both started"), "timeout_s": 6} if stop == "kill" else {"timeout_s": 5}
    codes, texts = _launch(tmp_path, server, "hang", **options)
    assert codes == ([-signal.SIGKILL, None] if stop == "kill" else [-signal.SIGKILL] * 2), (codes, texts)
    deadline = time.monotonic() + 5
    for rank in range(2):
        pid = int((tmp_path / "pids" / str(rank)).read_text())
        assert pid not in [client for client, _ in _pids(texts)]
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        assert not _alive(pid), f"rank {rank}'s process {pid} outlived its killed client"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_rank_whose_environment_differs_is_its_own_process(tmp_path, server) -> None:
    codes, texts = _launch(tmp_path, server, "exit 0", env={"DS_ACCELERATOR": "cpu-but-another-value"})
    assert codes == [0, 0], texts
    for text in texts:
        assert "fork server not used (the environment differs in ['DS_ACCELERATOR'])" in text, text
        client, pid = _pids([text])[0]
        assert client == pid and "forked None torch loaded False" in text, text


@pytest.mark.parametrize("refused", [False, True])
def test_a_suite_whose_rank_was_refused_warns(tmp_path, monkeypatch, refused) -> None:
    """launch() (a suite of cases) warns when a rank's log says the server did not fork it: correct, only slow, and
    otherwise silent. The launch itself is faked: two ranks' logs and results as run_local leaves them."""
    import warnings

    from ds_terapipe.runtime.execution.local_launch import LaunchResult
    from tests import dist_harness

    logs = []
    for rank in range(2):
        (tmp_path / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "results": []}))
        logs.append(tmp_path / f"rank{rank}.log")
        said = f"{REFUSED} (the environment differs in ['X']): starting" if refused and rank == 1 else "forked"
        logs[-1].write_text(f"some output\n{said}\nmore output\n")
    monkeypatch.setattr(dist_harness, "_run", lambda *args, **kwargs: LaunchResult([0, 0], logs, 0, 60.0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = dist_harness.launch("any", 2, tmp_path)
    assert [r["rank"] for r in results] == [0, 1]
    shown = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert shown == ([f"suite 'any': 1 of 2 rank(s) started as their own process: {REFUSED} (the environment "
                      "differs in ['X']): starting"] if refused else []), shown


def test_only_what_differs_per_rank_may_differ() -> None:
    base = {"PATH": "/bin", "RANK": "0", "OMP_NUM_THREADS": "1"}
    assert env_difference({**base, "RANK": "3", "MASTER_PORT": "1", "DS_TERAPIPE_WATCHDOG_S": "5"}, base) == []
    assert env_difference({**base, "TORCH_LOGS": "dynamo"}, base) == ["TORCH_LOGS"]
    assert env_difference({k: v for k, v in base.items() if k != "PATH"}, base) == ["PATH"]
    # a value the server's imports set is no difference (the test process imported the same); another value is
    made = {"TORCHINDUCTOR_CACHE_DIR": "/tmp/inductor"}
    assert env_difference({**base, **made}, base, made) == []
    assert env_difference({**base, "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}, base, made) == ["TORCHINDUCTOR_CACHE_DIR"]


SCRIPT = """
import os, sys
print("script argv", sys.argv[1:], "path0", sys.path[0], "forked", os.environ.get({forked!r}), "as", __name__,
      flush=True)
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("refused", [False, True])
def test_a_script_through_the_client_runs_as_python_would_run_it(tmp_path, server, refused) -> None:
    """tests/fork_run.py SCRIPT ARGS (how run_ranks(forked=True) starts a script other than tests/dist_worker.py):
    the script's argv, its directory first on sys.path and its exit code, forked or, refused, in the client."""
    script = tmp_path / "scripts" / "rank.py"
    script.parent.mkdir()
    script.write_text(SCRIPT.format(forked=FORKED_ENV))
    env = {FORK_SERVER_ENV: server, **({"DS_ACCELERATOR": "another"} if refused else {})}
    result = run_local([sys.executable, str(ROOT / "tests" / "fork_run.py"), str(script), "4", "x"], 2,
                       tmp_path / "logs", env=env, pythonpath=[ROOT], cwd=ROOT, fail_fast=False)
    assert result.codes == [4, 4], result.texts()
    shown = f"script argv ['4', 'x'] path0 {script.parent} forked {None if refused else '1'} as __main__"
    for text in result.texts():
        assert shown in text, text

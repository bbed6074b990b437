"""The launch machinery on ranks that fail: what ``ds_terapipe.runtime.execution.local_launch`` reports about a rank
that dies of a fatal signal, and when tests/dist_harness.py's ``launch`` runs a launch once more.

The ranks are plain Python processes (no torch; the harness's through tests/suites/launch_faults.py), so each
launch takes about a second. A rank that crashes in native code (a SIGSEGV inside gloo or DeepSpeed) leaves no
Python traceback; faulthandler's dump of every thread's stack is then all its log says about where it was.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from ds_terapipe.runtime.execution.local_launch import run_local
from tests.dist_harness import launch

# rank 0: many threads (a test rank has one p2p helper thread per engine, dozens per launch); one in the middle of
# them dies of a segfault; rank 1 exits cleanly. faulthandler lists threads newest first: 15 idle ones, the
# crashing one, 15 more idle ones, the main thread.
CRASH = textwrap.dedent("""
    import os, signal, threading

    def idle_helper(ready, event):
        ready.wait()
        event.wait(60)

    def crash_in_native_code(ready):
        ready.wait()
        signal.pthread_kill(threading.get_ident(), signal.SIGSEGV)

    if os.environ["RANK"] == "0":
        ready, event = threading.Barrier(32), threading.Event()
        threads = [threading.Thread(target=idle_helper, args=(ready, event), daemon=True) for _ in range(30)]
        threads.insert(15, threading.Thread(target=crash_in_native_code, args=(ready, )))
        for thread in threads:
            thread.start()
        print("rank 0 about to crash", flush=True)
        ready.wait()
        threads[15].join()
""")


def test_a_rank_that_dies_of_a_signal_is_reported_with_the_crashing_threads_stack(tmp_path: Path) -> None:
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    result = run_local([sys.executable, str(script)], 2, tmp_path / "logs", timeout_s=60, fail_fast=False)
    assert result.codes == [-11, 0], result.codes
    report = result.failure_report(40)
    assert "--- rank 0 (exit -11, SIGSEGV) last lines:\nrank 0 about to crash\n" in report, report
    assert "--- rank 1 (exit 0) last lines:" in report, report
    # faulthandler's dump is on in every launched rank; the crashing thread's stack, in the middle of the 32
    # threads' (more than 200 lines), is shown right after the dump's first line, the others after it
    fatal, current = report.index("Fatal Python error: Segmentation fault"), report.index("Current thread")
    assert fatal < current < report.index("in crash_in_native_code") < report.index("in idle_helper"), report
    assert report.count("in idle_helper") == 30 and "in <module>" in report, report


def test_a_rank_that_fails_without_a_signal_is_reported_by_its_last_lines(tmp_path: Path) -> None:
    script = tmp_path / "fail.py"
    script.write_text("import os\nprint('\\n'.join(f'line {i}' for i in range(100)))\n"
                      "raise SystemExit(int(os.environ['RANK']))\n")
    result = run_local([sys.executable, str(script)], 2, tmp_path / "logs", timeout_s=60, fail_fast=False)
    assert result.codes == [0, 1], result.codes
    report = result.failure_report(5)
    assert "--- rank 1 (exit 1) last lines:\nline 95\n" in report and "line 94" not in report, report


def _launches(tmp_path: Path) -> list[str]:
    return sorted((tmp_path / "launches").read_text().splitlines())


@pytest.mark.parametrize("first", [["segv", "ok"], ["bus", "ok"], ["segv", "after raise"], ["after raise", "segv"]],
                         ids=["segv", "bus", "segv then at once a peer's python exception", "the same on rank 1"])
def test_a_launch_whose_first_failure_is_a_crash_in_native_code_runs_once_more_and_says_so(
        tmp_path: Path, first: list[str]) -> None:
    crashed = 0 if first[0] in ("segv", "bus") else 1
    with pytest.warns(RuntimeWarning) as warned:
        results = launch("launch_faults", 2, tmp_path / "run", timeout_s=60, extra={"first": first,
                                                                                    "rerun": ["ok", "ok"]})
    assert [r["launch"] for r in results] == ["rerun", "rerun"], results
    assert _launches(tmp_path) == ["first 0", "first 1", "rerun 0", "rerun 1"]
    message = str(warned[0].message)
    assert f"rank {crashed} crashed in native code" in message and f"{tmp_path / 'run' / 'rerun'}" in message, message
    signal_name = first[crashed].upper()
    assert f"(exit -{7 if signal_name == 'BUS' else 11}, SIG{signal_name})" in message, message
    assert "Fatal Python error" in message and "in suite_launch_faults" in message, message
    assert (tmp_path / "run" / f"rank{crashed}.log").exists(), "the crashed launch's logs are kept"


@pytest.mark.parametrize("first", [["raise", "ok"], ["abort", "ok"], ["after segv", "raise"]],
                         ids=["python exception", "abort", "crash at once after a python exception"])
def test_a_launch_that_failed_first_otherwise_is_not_run_again(tmp_path: Path, first: list[str]) -> None:
    with pytest.raises(AssertionError, match="failed or timed out") as failed:
        launch("launch_faults", 2, tmp_path / "run", timeout_s=60, extra={"first": first, "rerun": ["ok", "ok"]})
    assert _launches(tmp_path) == ["first 0", "first 1"], str(failed.value)


def test_a_launch_that_crashes_again_fails_naming_both_runs(tmp_path: Path) -> None:
    with pytest.warns(RuntimeWarning), pytest.raises(AssertionError, match="run once more after a crash") as failed:
        launch("launch_faults", 2, tmp_path / "run", timeout_s=60,
               extra={"first": ["segv", "ok"], "rerun": ["ok", "segv"]})
    assert _launches(tmp_path) == ["first 0", "first 1", "rerun 0", "rerun 1"]
    assert "--- rank 1 (exit -11, SIGSEGV)" in str(failed.value), str(failed.value)


def test_under_xdist_every_launch_runs_on_one_worker_and_torch_on_one_thread(request) -> None:
    """The README's ``-n 2 --dist loadgroup``: tests/conftest.py puts every multi-process test in one xdist group
    (xdist marks its node id), so no two launches share the cores, and runs torch on one thread per worker."""
    from tests.conftest import xdist_workers
    if xdist_workers(request.config) < 2:
        pytest.skip("not run by two or more pytest-xdist workers")
    import torch
    launches = [item for item in request.session.items if item.get_closest_marker("multiproc")]
    if not launches:
        pytest.skip("no multi-process test selected")
    assert all(item.nodeid.endswith("@multiproc") for item in launches), \
        [item.nodeid for item in launches if not item.nodeid.endswith("@multiproc")][:3]
    assert torch.get_num_threads() == 1

"""Suite ``launch_faults`` (standalone, any number of ranks, no torch), asserted on by tests/test_launch.py: how
tests/dist_harness.py's ``launch`` treats a launch whose rank fails in a given way, and whether it runs it once more.

``extra``: ``{"first": [ACTION per rank], "rerun": [ACTION per rank]}``, the first list for the first launch, the
second for a launch in ``OUT_DIR/rerun`` (the harness's second run), on 2 ranks. Each rank appends its launch's name
to ``OUT_DIR/../launches`` (the first launch's directory's parent, the same file for both) and writes its process id
to ``OUT_DIR/pid{R}``, then does ACTION:

* ``ok``: write ``OUT_DIR/rank{R}.json`` and exit 0;
* ``segv`` / ``bus`` / ``abort``: die of SIGSEGV / SIGBUS / SIGABRT in the main thread (faulthandler's dump
  first: the launcher turns it on);
* ``raise``: raise a Python exception (exit 1);
* ``after segv`` / ``after raise``: as ``segv`` / ``raise`` as soon as the other rank's process has ended (within
  milliseconds of it, as a peer's failure follows a crash: the launcher's polls see both together).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from tests.suites import suite

_SIGNALS = {"segv": signal.SIGSEGV, "bus": signal.SIGBUS, "abort": signal.SIGABRT}


@suite("launch_faults", standalone=True)
def suite_launch_faults(out_dir: Path, extra: dict) -> None:
    rank = int(os.environ["RANK"])
    launch = "rerun" if out_dir.name == "rerun" else "first"
    record = (out_dir.parent.parent if launch == "rerun" else out_dir.parent) / "launches"
    with open(record, "a") as log:
        log.write(f"{launch} {rank}\n")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f".pid{rank}").write_text(str(os.getpid()))
    (out_dir / f".pid{rank}").rename(out_dir / f"pid{rank}")   # whole when a peer sees it
    action = extra[launch][rank]
    if action.startswith("after "):
        _wait_for_the_end_of(out_dir / f"pid{1 - rank}")
        # and a tenth of a second more: the launcher's thread that notes the peer's end wakes as it ends, but a
        # loaded host can hold it back for tens of ms, and then both ends would be noted at once, in either order;
        # still half the launcher's poll interval, so polling alone could not order the two
        time.sleep(0.1)
        action = action[len("after "):]
    if action in _SIGNALS:
        signal.pthread_kill(threading.get_ident(), _SIGNALS[action])
    if action == "raise":
        raise RuntimeError(f"rank {rank} raised in the {launch} launch")
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"rank": rank, "launch": launch}))


def _wait_for_the_end_of(pid_file: Path, timeout_s: float = 60.0) -> None:
    """Until the process whose id ``pid_file`` holds has ended (gone, or a zombie its parent has not reaped)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pid_file.exists():
            stat = Path(f"/proc/{pid_file.read_text()}/stat")
            try:
                if stat.read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return
            except (FileNotFoundError, ProcessLookupError):
                return
        time.sleep(0.01)
    raise TimeoutError(f"{pid_file}: its process did not end within {timeout_s}s")

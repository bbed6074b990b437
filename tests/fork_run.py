"""``python tests/fork_run.py SCRIPT ARG...``: run SCRIPT as ``python SCRIPT ARG...`` would, as a fork of the test
session's fork server (tests/fork_server.py) where ``FORK_SERVER_ENV`` names one.

Why: tests/dist_worker.py asks the server itself; any other script a test launches on several ranks (the example
trainers) starts through this client instead, so that its ranks skip the imports of torch, DeepSpeed and dynamo
too. Where the server refuses or cannot be reached, this process runs the script itself, as Python would. Only
the standard library is imported here: the client stays a small process of its own to the launcher.
"""

from __future__ import annotations

import os
import runpy
import sys

from tests.fork_server import FORK_SERVER_ENV, request_fork


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python tests/fork_run.py SCRIPT [ARG...]")
    sys.argv = sys.argv[1:]
    if os.environ.get(FORK_SERVER_ENV):
        request_fork(os.environ[FORK_SERVER_ENV])   # does not return where the server ran the script
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))   # as `python SCRIPT` sets it
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()

"""pytest's process (and each pytest-xdist worker).

What is alive once the tests are collected (torch, DeepSpeed, transformers and the test modules, ~400k objects) is
moved out of the garbage collector's sight (``gc.freeze``), so the full collections the in-process tests trigger
walk only what the tests made. They took ~7% of test_hf, test_blocks, test_chunks and test_slicing; frozen, those
four run ~6% faster. Nothing collectable is frozen: a collection runs first.

Under pytest-xdist with ``--dist loadgroup`` (the README's command: ``-n 2 --dist loadgroup``) every multi-process
test (marker ``multiproc``) goes to one worker, one after another as without xdist, while the in-process tests run
on the other worker(s). A pipeline launch keeps its cores only partly busy (a stage waits on its peer: ~40% of 2
cores idle during the equivalence grid), and the in-process tests are single-threaded Python, so alone each left
a core idle for much of its run; side by side the suite took 850-955 s where it took 1046-1077 s one test at a
time (2 cores). Two launches never run at once (their ranks would share the cores with another suite's and stretch
its deadlines), and each worker runs torch on one thread: with 2 intra-op threads each, two workers on 2 cores
would contend for them."""

from __future__ import annotations

import gc

import pytest


def xdist_workers(config) -> int:
    """How many pytest-xdist workers run the session (1 without xdist, and in xdist's controller)."""
    return getattr(config, "workerinput", {}).get("workercount", 1)


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads the group marks to schedule by them
def pytest_collection_modifyitems(config, items) -> None:
    if xdist_workers(config) < 2:
        return
    import torch
    torch.set_num_threads(1)
    if config.getvalue("loadgroup"):
        for item in items:
            if item.get_closest_marker("multiproc"):
                item.add_marker(pytest.mark.xdist_group("multiproc"))


def pytest_collection_finish(session) -> None:
    gc.collect()
    gc.freeze()

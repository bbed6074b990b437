"""The multi-process test suites: suite ``NAME`` is ``tests/suites/NAME.py``, run on every rank by
``python tests/dist_worker.py NAME OUT_DIR EXTRA_JSON`` (tests/dist_harness.py starts the ranks).

A suite module registers its suite with ``@suite("NAME")``; the runner imports the module by the suite's name and
finds the suite here, so no list of suites is kept anywhere. A suite is one of two kinds:

* a suite of cases (the default), ``fn(extra) -> list[dict]``: tests/dist_worker.py arms the watchdog, starts the
  gloo process group, runs it, writes ``OUT_DIR/rank{R}.json`` and leaves together with the other ranks;
* a standalone suite (``standalone=True``), ``fn(out_dir, extra)``: it owns the whole process (what is imported
  before it starts, its result files, how the process leaves); the runner only calls it.

Helpers shared between suites: tests/suites/common.py, and tests/suites/common_vocab.py for vocabulary
parallelism. This module imports nothing heavy: a standalone suite decides what is imported before it starts.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

__all__ = ["Suite", "load", "suite"]


@dataclass(frozen=True)
class Suite:
    name: str
    run: Callable
    standalone: bool


_REGISTERED: dict[str, Suite] = {}


def suite(name: str, *, standalone: bool = False) -> Callable[[Callable], Callable]:
    """Register the decorated function as suite ``name`` (its module must be ``tests/suites/<name>.py``)."""

    def register(fn: Callable) -> Callable:
        if name in _REGISTERED:
            raise ValueError(f"suite {name!r} is registered twice")
        _REGISTERED[name] = Suite(name, fn, standalone)
        return fn

    return register


def load(name: str) -> Suite:
    """Suite ``name``, its module imported first."""
    importlib.import_module(f"{__name__}.{name}")
    if name not in _REGISTERED:
        raise KeyError(f"tests/suites/{name}.py registers no suite {name!r} (@suite({name!r}))")
    return _REGISTERED[name]

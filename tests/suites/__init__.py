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

import ast
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

__all__ = ["Suite", "is_standalone", "load", "suite"]


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


def is_standalone(name: str) -> bool:
    """Whether suite ``name`` is standalone, read from its module's source without importing it (a standalone
    suite decides what is imported before it starts: tests/dist_worker.py starts it in a process of its own, never
    through tests/fork_server.py)."""
    tree = ast.parse((Path(__file__).parent / f"{name}.py").read_text())
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "suite" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value == name):
            return any(k.arg == "standalone" and isinstance(k.value, ast.Constant) and k.value.value is True
                       for k in node.keywords)
    raise KeyError(f"tests/suites/{name}.py registers no suite {name!r} (@suite({name!r}))")


def load(name: str) -> Suite:
    """Suite ``name``, its module imported first."""
    importlib.import_module(f"{__name__}.{name}")
    if name not in _REGISTERED:
        raise KeyError(f"tests/suites/{name}.py registers no suite {name!r} (@suite({name!r}))")
    return _REGISTERED[name]

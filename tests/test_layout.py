"""Tier a: the package keeps its shape (docs/design.md, "Layout").

* No import cycle between the project's modules, counting imports inside functions and under ``TYPE_CHECKING``
  (a cycle kept alive by a late import still ties the two modules' designs together).
* No module outside the engine's reads an engine attribute that starts with ``_``: helpers take the narrow
  interface of ``runtime/execution/stage.py``.
* The engine's mixins are plain classes that define no name in common with each other or with the engine, so the
  order of its bases decides no lookup and each mixin's ``super()`` reaches DeepSpeed's ``PipelineEngine``.
* ``runtime/`` holds sub-packages only, each with a docstring saying what it owns.
* The schedule is lowered in one place (``planner/lowering.py``): the runtime builds no schedule itself, and the
  action kinds' instructions come from one table (``runtime/execution/schedule.py`` DISPATCH) that covers every
  kind.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from ds_terapipe.planner.schedule import ActionKind
from ds_terapipe.runtime.execution.schedule import DISPATCH

PACKAGE = Path(__file__).resolve().parents[1] / "ds_terapipe"
ENGINE = PACKAGE / "runtime" / "execution" / "engine.py"


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """Project module -> the project modules it imports anywhere in its source."""
    modules = {_module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                continue
            graph[name].update(c for c in candidates if c in modules and c != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_project_modules() -> None:
    graph = import_graph()
    found = cycles(graph)
    detail = [f"{m} -> {sorted(graph[m] & set(c))}" for c in found for m in c]
    assert not found, "import cycles (break them with a leaf module or an interface):\n" + "\n".join(detail)


def test_the_cycle_check_finds_a_cycle(tmp_path) -> None:
    """The check itself: a late import that closes a loop is found."""
    pkg = tmp_path / "ds_terapipe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from . import b\n")
    (pkg / "b.py").write_text("def f():\n    from .a import g\n")
    assert cycles(import_graph(pkg)) == [["ds_terapipe.a", "ds_terapipe.b"]]


def test_the_planner_imports_nothing_from_the_runtime() -> None:
    graph = import_graph()
    found = {m: sorted(t for t in targets if t.startswith("ds_terapipe.runtime"))
             for m, targets in graph.items() if m.startswith("ds_terapipe.planner")}
    assert not any(found.values()), {m: t for m, t in found.items() if t}


def test_no_private_engine_attribute_outside_the_engine() -> None:
    pattern = re.compile(r"\bengine\._[a-z]\w*")
    found = [f"{p.relative_to(PACKAGE.parent)}:{i}: {m.group(0)}" for p in sorted(PACKAGE.rglob("*.py")) if p != ENGINE
             for i, line in enumerate(p.read_text().splitlines(), 1) for m in pattern.finditer(line)]
    assert not found, "use the engine's public interface (runtime/execution/stage.py):\n" + "\n".join(found)


def test_the_engine_mixins_define_each_name_once() -> None:
    """What the engine's docstring promises of its bases: the mixins come before ``PipelineEngine``, derive from
    nothing, and no name (method, property, class attribute) is defined twice among them and the engine's body."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from ds_terapipe.runtime.execution.engine import TokenPipelineEngine

    *mixins, base = TokenPipelineEngine.__bases__
    assert base is PipelineEngine and mixins, TokenPipelineEngine.__bases__
    owners: dict[str, list[str]] = {}
    for cls in (TokenPipelineEngine, *mixins):
        assert cls is TokenPipelineEngine or cls.__bases__ == (object, ), f"{cls.__name__} derives from {cls.__bases__}"
        for name in vars(cls):
            if not (name.startswith("__") and name.endswith("__")):
                owners.setdefault(name, []).append(cls.__name__)
    shared = {name: classes for name, classes in owners.items() if len(classes) > 1}
    assert not shared, f"defined in more than one of the engine's classes (keep one): {shared}"


def test_runtime_holds_documented_sub_packages_only() -> None:
    runtime = PACKAGE / "runtime"
    loose = sorted(p.name for p in runtime.glob("*.py") if p.name != "__init__.py")
    assert not loose, f"runtime/ holds sub-packages only; move {loose} into one"
    packages = sorted(p for p in runtime.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert len(packages) >= 3, packages
    for package in packages:
        init = package / "__init__.py"
        assert init.exists(), f"{package} is not a package"
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 80, f"{init} needs a docstring saying what the sub-package owns"


def test_one_lowering_and_one_dispatch_table() -> None:
    runtime = PACKAGE / "runtime"
    builds = [f"{p.relative_to(PACKAGE.parent)}:{i}" for p in sorted(runtime.rglob("*.py"))
              for i, line in enumerate(p.read_text().splitlines(), 1)
              if re.search(r"\b(build_schedule|add_communication|freeze_lowered|add_vocab_passes)\(", line)]
    assert not builds, f"the runtime lowers schedules through planner.lowering.lower only: {builds}"
    assert set(DISPATCH) == set(ActionKind), set(ActionKind) - set(DISPATCH)


def test_every_public_name_is_what_its_module_defines_whichever_is_read_first(monkeypatch) -> None:
    """``ds_terapipe.X`` loads its module on first use; importing ``ds_terapipe/initialize.py`` for another name
    (``init_distributed``) binds the module on the package as ``initialize``, where the function must stay."""
    import importlib

    import ds_terapipe

    # as in a fresh process: ds_terapipe/initialize.py not imported yet, none of its names read (the package's
    # namespace edited as a dict: hasattr would load the names)
    for name, module in ds_terapipe._LAZY.items():
        if module == ".initialize":
            monkeypatch.delitem(vars(ds_terapipe), name, raising=False)
    monkeypatch.delitem(sys.modules, "ds_terapipe.initialize", raising=False)
    assert callable(ds_terapipe.init_distributed)
    wrong = [n for n, m in ds_terapipe._LAZY.items()
             if getattr(ds_terapipe, n) is not getattr(importlib.import_module(m, "ds_terapipe"), n)]
    assert not wrong, wrong

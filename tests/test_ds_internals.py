"""Tier a, one process: the DeepSpeed internals ds_terapipe relies on (runtime/execution/ds_internals.py) are all there,
a missing one is named with where it is used and the tested range, and the table misses nothing the runtime
touches."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import pytest
from deepspeed.runtime.pipe.engine import PipelineEngine
from deepspeed.runtime.pipe.module import PipelineModule
from packaging.specifiers import SpecifierSet

from ds_terapipe.runtime.execution.ds_internals import (INTERNALS, TESTED_DEEPSPEED, DeepSpeedInternalsError,
                                              check_deepspeed_internals, missing_internals)

ROOT = Path(__file__).resolve().parent.parent


def test_installed_deepspeed_has_every_internal_and_is_in_the_tested_range() -> None:
    assert missing_internals(deep=True) == []
    assert deepspeed.__version__ in SpecifierSet(TESTED_DEEPSPEED)
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11; the package itself supports 3.10
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"deepspeed{TESTED_DEEPSPEED}" in deps, deps  # one range, declared where pip reads it


def test_a_removed_method_is_named_with_its_use_and_the_fix(monkeypatch) -> None:
    monkeypatch.delattr(PipelineEngine, "_reserve_pipe_buffers")
    with pytest.raises(DeepSpeedInternalsError) as err:
        check_deepspeed_internals()
    message = str(err.value)
    assert "PipelineEngine._reserve_pipe_buffers (attr; used in runtime/execution/engine.py _exec_schedule" in message
    assert f"DeepSpeed {deepspeed.__version__} does not have" in message
    assert f"pip install 'deepspeed{TESTED_DEEPSPEED}'" in message
    assert message.count("\n  - ") == 1  # only what is missing


def test_a_changed_signature_is_named(monkeypatch) -> None:
    monkeypatch.setattr(PipelineEngine, "_exec_forward_pass", lambda self, buffer_index: None)
    (line, ) = missing_internals()
    assert line.startswith("PipelineEngine._exec_forward_pass") and "lacks ['buffer_id']" in line


def test_instance_attributes_are_checked_on_the_live_engine() -> None:
    engine = SimpleNamespace(module=SimpleNamespace(forward_funcs=[], loss_fn=None), grid=None, _config=None)
    lines = missing_internals(engine)
    assert any(line.startswith("PipelineEngine.pipe_buffers (instance") and "not set on the live object" in line
               for line in lines)
    assert any(line.startswith("PipelineModule._local_start (instance") for line in lines)
    assert not any(line.startswith("PipelineModule.forward_funcs") for line in lines)
    assert not any("fwd_outputs" in line for line in lines)  # set per batch, not at init


def test_an_override_deepspeed_stopped_calling_is_named(monkeypatch) -> None:

    def train_batch(self, data_iter=None):  # a DeepSpeed that runs its schedule some other way
        return self._run_everything(data_iter)

    monkeypatch.setattr(PipelineEngine, "train_batch", train_batch)
    assert missing_internals() == []  # engine init only looks names up
    lines = missing_internals(deep=True)
    assert [line.split(" (")[0] for line in lines] == ["train_batch._exec_schedule", "train_batch._train_schedule"]
    assert "no longer calls it" in lines[0]


def _ds_names() -> set[str]:
    """Names DeepSpeed's PipelineEngine (and bases) or PipelineModule define or assign."""
    sources = "\n".join(Path(sys.modules[c.__module__].__file__).read_text()
                        for c in (*PipelineEngine.__mro__, *PipelineModule.__mro__) if c.__module__.startswith("deepspeed"))
    assigned = set(re.findall(r"self\.(\w+)\s*=[^=]", sources))
    return assigned | {n for c in (PipelineEngine, PipelineModule) for n in dir(c)}


def test_the_table_lists_every_deepspeed_internal_the_plugin_touches() -> None:
    """Private DeepSpeed names read through ``self``/``engine``/``module`` and every ``super()`` call into a
    DeepSpeed class: each must be in INTERNALS, so a new use cannot slip past the check."""
    ds_names, listed = _ds_names(), {item.name for item in INTERNALS}
    used: dict[str, str] = {}
    for path in sorted((ROOT / "ds_terapipe").rglob("*.py")):
        if "planner" in path.parts:
            continue
        text = path.read_text()
        for name in re.findall(r"\b(?:self|engine|module)\.(_[a-z]\w*)", text) + re.findall(r"super\(\)\.(\w+)",
                                                                                           text):
            if name in ds_names and not name.startswith("__"):
                used.setdefault(name, str(path.relative_to(ROOT)))
    unlisted = {name: where for name, where in used.items() if name not in listed}
    assert not unlisted, f"DeepSpeed internals used but missing from runtime/execution/ds_internals.py INTERNALS: {unlisted}"
    assert {"_exec_forward_pass", "_reserve_pipe_buffers", "_next_batch", "_local_start"} <= set(used)


def test_engine_init_runs_the_check(monkeypatch) -> None:
    """The engine's own ``__init__`` calls the check on itself, right after DeepSpeed's engine is built (a source
    grep would pass a commented-out call). DeepSpeed's ``__init__`` is stubbed and the check replaced by a spy that
    stops the constructor there, so no process group is needed."""
    from ds_terapipe.runtime.execution import engine as engine_module

    class Checked(Exception):
        pass

    seen: list = []

    def spy(engine=None):
        seen.append(engine)
        raise Checked

    monkeypatch.setattr(PipelineEngine, "__init__", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(engine_module, "check_deepspeed_internals", spy)
    engine = object.__new__(engine_module.TokenPipelineEngine)
    with pytest.raises(Checked):
        engine_module.TokenPipelineEngine.__init__(engine, terapipe_config=SimpleNamespace())
    assert seen == [engine]

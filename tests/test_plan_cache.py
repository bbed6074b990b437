"""The plan cache's key (runtime/planning/plan_cache.py cache_entry): what changes a plan changes the key, what does not
leaves it alone. A fake engine carries just the attributes the key reads."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from ds_terapipe.config import parse_terapipe_config
from ds_terapipe.runtime.planning import plan_cache
from ds_terapipe.runtime.planning.plan_cache import cache_entry


def _engine(device: str = "cpu", interval: int = 0, **terapipe) -> SimpleNamespace:
    cfg = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, **terapipe}})
    return SimpleNamespace(terapipe=cfg, num_stages=2, dp_world_size=1, micro_batch_size=1, micro_batches=2,
                           module=SimpleNamespace(activation_checkpoint_interval=interval), device=torch.device(device))


def test_the_key_covers_device_torch_threads_and_profile_settings_but_not_the_recheck(monkeypatch) -> None:
    key = cache_entry(_engine(), ("fingerprints",), 64).key
    assert cache_entry(_engine(), ("fingerprints",), 64).key == key   # deterministic
    assert cache_entry(_engine(profile={"recheck_cached": False}), ("fingerprints",), 64).key == key
    assert cache_entry(_engine(profile={"repeats": 5}), ("fingerprints",), 64).key != key
    assert cache_entry(_engine("meta"), ("fingerprints",), 64).key != key
    assert cache_entry(_engine(), ("other model",), 64).key != key
    assert cache_entry(_engine(), ("fingerprints",), 32).key != key
    monkeypatch.setattr(plan_cache.torch, "__version__", "0.0.1")
    assert cache_entry(_engine(), ("fingerprints",), 64).key != key
    monkeypatch.undo()
    monkeypatch.setattr(plan_cache.torch, "get_num_threads", lambda: 977)
    assert cache_entry(_engine(), ("fingerprints",), 64).key != key


@pytest.mark.parametrize("change", [{"max_slices": 2}, {"memory_limit_gb": 1.0}, {"deferred_weight_grads": False},
                                    {"sequence_parallel": 2}, {"schedule": "1f1b"}, {"granularity": 16},
                                    {"interval": 1}], ids=lambda c: next(iter(c)))
def test_the_key_covers_every_setting_that_shapes_a_plan(change: dict) -> None:
    """A plan found under the key of another setting would run a slicing planned for that one (more slices than
    max_slices, a memory cap or a recompute it was not planned for). gpipe defers weight gradients by default."""
    key = cache_entry(_engine(), ("fingerprints",), 64).key
    assert cache_entry(_engine(**change), ("fingerprints",), 64).key != key


def test_a_file_without_a_plan_is_no_hit(tmp_path) -> None:
    entry = plan_cache.CacheEntry(str(tmp_path / "terapipe-plan-x.json"), "x")
    (tmp_path / "terapipe-plan-x.json").write_text(json.dumps({"key": "x", "cost": None}))
    assert plan_cache.load_cached(entry) is None
    plan_cache.store_plan(entry, SimpleNamespace(to_dict=lambda: {"slices": [8]}), None, None)
    assert plan_cache.load_cached(entry)["plan"] == {"slices": [8]}


def test_a_plan_the_cache_cannot_store_is_logged_and_skipped(caplog) -> None:
    """A read-only cache (plans made elsewhere) is used; storing a new plan there must not fail the run after
    profiling: the cache only saves a restart its profiling."""
    import logging

    entry = plan_cache.CacheEntry("/proc/ds_terapipe_test/terapipe-plan-x.json", "x")
    plan = SimpleNamespace(to_dict=lambda: {"slices": [8]})
    with caplog.at_level(logging.WARNING, logger="ds_terapipe.runtime.planning.plan_cache"):
        plan_cache.store_plan(entry, plan, None, None)
        plan_cache.store_partition(entry, {"parts": [0, 1]}, {})
    stored = [r.getMessage() for r in caplog.records if "could not store terapipe-plan-x.json" in r.getMessage()]
    assert len(stored) == 2 and "a restart will profile again" in stored[0], caplog.text


def test_a_new_cache_version_changes_the_partition_key_too(monkeypatch) -> None:
    """A partition file of another cache version (another meaning of its content) is never found."""
    key = plan_cache.partition_cache_entry(None, {"kinds": ["a", "b"]}).key
    monkeypatch.setattr(plan_cache, "PLAN_CACHE_VERSION", plan_cache.PLAN_CACHE_VERSION + 1)
    assert plan_cache.partition_cache_entry(None, {"kinds": ["a", "b"]}).key != key

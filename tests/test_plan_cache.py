"""The plan cache's key (runtime/planning/plan_cache.py cache_entry): what changes a plan changes the key, what does not
leaves it alone. A fake engine carries just the attributes the key reads."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from ds_terapipe.config import parse_terapipe_config
from ds_terapipe.runtime.planning import plan_cache
from ds_terapipe.runtime.planning.plan_cache import cache_entry


def _engine(device: str = "cpu", **terapipe) -> SimpleNamespace:
    cfg = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 64, **terapipe}})
    return SimpleNamespace(terapipe=cfg, num_stages=2, dp_world_size=1, micro_batch_size=1, micro_batches=2,
                           module=SimpleNamespace(activation_checkpoint_interval=0), device=torch.device(device))


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

"""The plan cache: a restart with the same setting skips profiling.

A plan depends on the model (every stage's parameter names, shapes, dtypes and layer types, its activation
checkpoint interval), the pipeline (stages, data-parallel size, micro-batches and their size), the terapipe
settings that shape the plan, the device type, the torch version and the thread count. All of it is hashed
into the file name (``terapipe-plan-<key>.json`` under ``terapipe.plan_cache``), so a stale plan is never
found rather than detected. A file holds the plan and the costs it was made from, so other sequence lengths
can be planned without profiling again. Only global rank 0 reads and writes it; the caller shares the outcome.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from ..._io import atomic_write_text
from ..execution.stage import PipelineStage


__all__ = ["PLAN_CACHE_VERSION", "CacheEntry", "cache_entry", "gather_fingerprints", "load_cached", "store_plan",
           "partition_cache_entry", "store_partition"]

logger = logging.getLogger(__name__)

# Bump when the file's content or the meaning of a plan changes: old files then stop matching.
PLAN_CACHE_VERSION = 5


@dataclass(frozen=True)
class CacheEntry:
    """Where the plan for one setting lives: ``path`` is None without ``terapipe.plan_cache``."""

    path: Optional[str]
    key: str


def _stage_fingerprint(engine: "PipelineStage") -> list:
    module = engine.module
    chunks = getattr(module, "chunk_funcs", [module.forward_funcs])
    return [[name, list(p.shape), str(p.dtype)] for name, p in module.named_parameters()] + \
        [[type(f).__name__ for f in funcs] for funcs in chunks]


def gather_fingerprints(engine: "PipelineStage") -> tuple:
    """Every rank's model fingerprint, in (replica, stage) order (collective over all ranks)."""
    fingerprints: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(fingerprints, (engine.stage_id, engine.grid.data_parallel_id, _stage_fingerprint(engine)))
    return tuple(sorted(fingerprints, key=lambda f: (f[1], f[0])))


def cache_entry(engine: "PipelineStage", fingerprints: tuple, seq_len: int) -> CacheEntry:
    """The cache key of the plan for ``seq_len`` in this engine's setting, and its file if caching is on."""
    cfg = engine.terapipe
    material = {
        "version": PLAN_CACHE_VERSION, "model": fingerprints, "num_stages": engine.num_stages,
        "dp": engine.dp_world_size, "micro_batch_size": engine.micro_batch_size,
        "micro_batches": engine.micro_batches, "seq_len": seq_len, "granularity": cfg.granularity,
        "schedule": cfg.schedule, "virtual_stages": cfg.virtual_stages, "sequence_parallel": cfg.sequence_parallel,
        "max_slices": cfg.max_slices, "memory_limit_gb": cfg.memory_limit_gb,
        "deferred_weight_grads": cfg.deferred_weight_grads,
        "activation_checkpoint_interval": engine.module.activation_checkpoint_interval,  # profiled with recompute
        # re-timing a hit (recheck_cached) shapes no cached plan: not part of the key
        "profile": cfg.profile.model_dump(exclude={"recheck_cached"}), "device": str(engine.device.type),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    key = hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()[:20]
    if cfg.plan_cache is None:
        return CacheEntry(None, key)
    return CacheEntry(os.path.join(cfg.plan_cache, f"terapipe-plan-{key}.json"), key)


def load_cached(entry: CacheEntry) -> Optional[dict]:
    """The cached file's content (``plan``, ``cost``, ``stage_meta``), or None if absent or unreadable."""
    if entry.path is None or not os.path.exists(entry.path):
        return None
    try:
        with open(entry.path) as f:
            cached = json.load(f)
        cached["plan"]  # a file without a plan is unreadable, not a hit
    except (OSError, ValueError, KeyError) as err:
        logger.warning("terapipe: ignoring unreadable plan cache %s (%s)", entry.path, err)
        return None
    logger.info("terapipe: plan cache hit %s", entry.path)
    return cached


def store_plan(entry: CacheEntry, plan: Any, cost: Optional[dict], stage_meta: Optional[Any], **extra: Any) -> None:
    """Write the plan and the costs it was made from (nothing without ``terapipe.plan_cache``)."""
    if entry.path is None:
        return
    _write(entry.path, json.dumps({"key": entry.key, "plan": plan.to_dict(), "cost": cost, "stage_meta": stage_meta,
                                   **extra}, indent=1))


def _write(path: str, text: str) -> None:
    """Store a cache file; one that cannot be written (a read-only cache of plans made elsewhere) is logged and
    skipped: the cache only saves a later start its profiling, the run itself does not need it."""
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_write_text(path, text)
    except OSError as err:
        logger.warning("terapipe: could not store %s in terapipe.plan_cache (%s: %s); a restart will profile again",
                       os.path.basename(path), type(err).__name__, err.strerror or err)


def partition_cache_entry(cache_dir: Optional[str], material: dict) -> CacheEntry:
    """Where the cost-based layer partition (``runtime/features/partition.py``) for ``material`` (layer kinds, ranks,
    settings, device) lives: ``terapipe-partition-<key>.json`` next to the slicing plans."""
    key = hashlib.sha256(json.dumps({"version": PLAN_CACHE_VERSION, "partition": material},
                                    sort_keys=True).encode()).hexdigest()[:20]
    if cache_dir is None:
        return CacheEntry(None, key)
    return CacheEntry(os.path.join(cache_dir, f"terapipe-partition-{key}.json"), key)


def store_partition(entry: CacheEntry, report: dict, cost: dict) -> None:
    """Write the partition report (as the file's ``plan``, what :func:`load_cached` reads back) and the per-kind
    costs it was made from (nothing without a cache directory)."""
    if entry.path is None:
        return
    _write(entry.path, json.dumps({"key": entry.key, "plan": {k: v for k, v in report.items() if k != "source"},
                                   "cost": cost}, indent=1))

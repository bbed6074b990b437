"""The benchmark's step-memory meter (benchmarks/pipeline_speedup.py) measures what it claims."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "pipeline_speedup.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("pipeline_speedup_under_test", _PATH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_heap_meter_sees_a_temporary_freed_before_the_step_ends(bench):
    meter = bench.HeapMeter()
    a = torch.randn(256, 256)
    with meter:
        big = torch.ones(4_000_000)          # 16 MB, freed before the step ends
        kept = (big * 2).sum()
        del big
        small = a @ a                        # 256 KB, still alive at the end
    mib = meter.peak_bytes / 2**20
    assert 30 <= mib <= 34, f"peak {mib:.1f} MiB: expected the two 16 MB tensors alive at once"
    assert meter.peak_at.endswith(("aten.mul.Tensor", "aten.sum.default")), meter.peak_at
    assert kept.item() == 8_000_000 and small.shape == (256, 256)


def test_heap_meter_counts_backward_temporaries(bench):
    w = torch.randn(1024, 1024, requires_grad=True)
    x = torch.randn(2048, 1024)
    meter = bench.HeapMeter()
    with meter:
        (x @ w).relu().sum().backward()
    # relu keeps its 8 MB output for backward; threshold_backward then makes the 8 MB grad of x @ w
    assert 16 * 2**20 <= meter.peak_bytes <= 24 * 2**20, meter.peak_bytes / 2**20
    assert "backward" in meter.peak_at, meter.peak_at

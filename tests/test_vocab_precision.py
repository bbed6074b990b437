"""Tier b: vocabulary parallelism in bf16 and fp16, at ZeRO 0 and 1, against the fp32 unsliced reference.

The shard gradients of the output layer (and of a tied head's split input embedding) are computed by hand, so they
must reach the buffer each DeepSpeed optimizer reads, in its scale (runtime/execution/grad_sink.py): the fp32 master
gradients of BF16_Optimizer, ``.grad`` times the loss scale for the fp16 optimizers, ``.grad`` under ZeRO 1. One
launch of 2 ranks (bf16/fp16 x ZeRO 0/1 x tied/untied with 1f1b, and the virtual-stage schedules) and one of 4
(2 stages x 2 replicas); tests/suites/vocab_precision.py.

What is compared: the change of the fp32 master weights over 3 SGD+momentum steps, each parameter (a shard
against its rows of the reference's table), and the losses. Measured: bf16 within 2.1e-2 (its rounding), fp16
within 2.7e-3, losses within 2e-5 relative. A shard gradient that misses the bf16 master gradients, or an fp16 one
without the loss scale, leaves the head's update off by 80-100% (the losses by only 3e-4: hence the tight loss
bound).
"""

from __future__ import annotations

import pytest

from tests.dist_harness import launch
from tests.precision import UPDATE_TOL, check_precision_case
from tests.results import cases_per_rank

pytestmark = pytest.mark.multiproc

UNEQUAL = [8, 24, 16]
FLAT = [[precision, zero, tied, "1f1b", UNEQUAL, 2] for precision in ("bf16", "fp16") for zero in (0, 1)
        for tied in (True, False)]
VIRTUAL = [["bf16", 0, True, "interleaved-1f1b", UNEQUAL, 2], ["fp16", 1, False, "dualpipev", 1, 2],
           ["bf16", 1, True, "looped-bfs", UNEQUAL, 2], ["bf16", 0, False, "gpipe", 1, 2]]
REPLICATED = [["bf16", 1, True, "1f1b", UNEQUAL, 2], ["fp16", 1, False, "1f1b", UNEQUAL, 2],
              ["bf16", 0, False, "gpipe", 1, 2]]


def _check(results: list[dict], expected: int) -> None:
    per_rank = cases_per_rank(results, expected)
    for index in range(expected):
        covered: set[str] = set()
        for rank, cases in enumerate(per_rank):
            case = cases[index]
            where = f"{case['case']}, rank {rank}"
            precision = check_precision_case(case, rank)
            assert case["shard_update_rel_err"] <= UPDATE_TOL[precision], where
            assert case["pad_abs"] == 0.0, f"{where}: padding rows moved"
            covered.update(case["covered"])
        # every reference parameter was compared on some rank (the input embedding's table through shards alone)
        plain = {c for c in covered if "[" not in c}
        tied = "tied=True" in per_rank[0][index]["case"]
        assert len(plain) == per_rank[0][index]["num_ref_params"] - (1 if tied else 3), sorted(plain)


@pytest.mark.timeout(600)
def test_vocab_parallel_half_precision(tmp_path) -> None:
    """bf16/fp16 x ZeRO 0/1 x tied/untied heads on 1f1b, then gpipe and the virtual-stage schedules, 2 ranks."""
    results = launch("vocab_precision", 2, tmp_path, timeout_s=540, extra={"cases": FLAT + VIRTUAL})
    _check(results, len(FLAT) + len(VIRTUAL))


@pytest.mark.timeout(600)
def test_vocab_parallel_half_precision_with_replicas(tmp_path) -> None:
    """2 stages x 2 replicas: bf16 and fp16 under ZeRO 1 (partitioned master copies), bf16 at ZeRO 0."""
    results = launch("vocab_precision", 4, tmp_path, timeout_s=540, extra={"cases": REPLICATED})
    _check(results, len(REPLICATED))

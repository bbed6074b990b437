"""Tier a: sequence parallelism inside pipeline stages, as the planner costs it (ds_terapipe/planner/sequence.py).

A stage whose N sequence-parallel ranks split each slice's tokens computes 1/N of it per rank, pays two
all-to-alls per attention layer and direction, sends 1/N of the activations to the next stage, and holds 1/N of the
activations; the layout search plans every pipeline x sequence x data split of a world under a memory cap.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds_terapipe.planner.presets import analytic_pipeline_cost, preset_memory_model
from ds_terapipe.planner.roofline import TransformerSpec
from ds_terapipe.planner.sequence import SequenceParallelCost, plan_layouts, sequence_parallel_cost
from ds_terapipe.planner.slicing import MemoryModel

SPEC = TransformerSpec(num_layers=16, hidden=1024, num_heads=16, vocab=32000, seq_len=16384, ffn_hidden=2816,
                       num_kv_heads=4, block="llama")
LENS, CTX = np.array([256.0, 1024.0, 4096.0]), np.array([0.0, 2048.0, 8192.0])


def test_a_slice_on_n_sequence_ranks_costs_its_share_plus_the_all_to_alls() -> None:
    chunk = analytic_pipeline_cost(SPEC, "h100", 2, lm_head=False).chunk(0)
    one = SequenceParallelCost(chunk, 1, layers=8, hidden=SPEC.hidden, link_gbps=3600)
    assert np.allclose(one.forward_ms(LENS, CTX), chunk.forward_ms(LENS, CTX))
    assert np.allclose(one.backward_ms(LENS, CTX), chunk.backward_ms(LENS, CTX))
    assert np.allclose(one.all_to_all_ms(LENS), 0.0)
    two = SequenceParallelCost(chunk, 2, layers=8, hidden=SPEC.hidden, link_gbps=3600, kv_fraction=0.25)
    a2a = two.all_to_all_ms(LENS)
    # per layer and direction: queries and output, keys and values at a quarter: 2.5 x B x T/2 x H values, half
    # of them leave, at 3600 Gbit/s, plus two latencies
    want = 8 * (2 * 0.005 + 2.5 * LENS / 2 * SPEC.hidden * 2 * 0.5 / (3600 / 8 * 1e9) * 1e3)
    assert np.allclose(a2a, want)
    assert np.allclose(two.forward_ms(LENS, CTX), np.asarray(chunk.forward_ms(LENS, CTX)) / 2 + a2a)
    assert np.allclose(two.backward_ms(LENS, CTX), np.asarray(chunk.backward_ms(LENS, CTX)) / 2 + a2a)
    assert np.allclose(two.comm_ms(LENS), np.asarray(chunk.comm_ms(LENS)) / 2)
    full = SequenceParallelCost(chunk, 2, layers=8, hidden=SPEC.hidden, link_gbps=3600, kv_fraction=1.0)
    assert np.all(full.all_to_all_ms(LENS) > a2a)   # grouped-query attention sends fewer keys and values
    assert two.cache_key() != full.cache_key() != chunk.cache_key()
    with pytest.raises(ValueError, match="layers has 1 entries but the cost has 2 chunks"):
        sequence_parallel_cost(analytic_pipeline_cost(SPEC, "h100", 2), 2, [8], hidden=SPEC.hidden, link_gbps=1)


def test_a_rank_holds_half_the_activations_at_degree_two() -> None:
    kw = dict(schedule="1f1b", num_stages=2, num_microbatches=2, micro_batch_size=1, num_splits=1,
              seq_len=SPEC.seq_len, num_slices=8)
    one = preset_memory_model(SPEC, 2).peak_bytes(**kw)
    two = MemoryModel((8, 8), SPEC.hidden // 2).peak_bytes(**kw)
    assert two <= 0.55 * one


def test_layouts_cover_the_world_and_the_cap_decides_which_fit() -> None:
    loose = plan_layouts(SPEC, "h100", 8, micro_batches=2, memory_cap_bytes=1e12, sequence_link_gbps=3600,
                         granularity=512, activation_factor=2.0)
    assert {(e.stages, e.sequence, e.data) for e in loose} == {(p, n, 8 // (p * n)) for p in (1, 2, 4, 8)
                                                              for n in (1, 2, 4) if 8 % (p * n) == 0}
    assert all(e.fits for e in loose)
    assert [e.tokens_per_s for e in loose] == sorted((e.tokens_per_s for e in loose), reverse=True)
    tight_cap = sorted(e.activation_bytes + e.model_state_bytes for e in loose)[len(loose) // 2]
    tight = plan_layouts(SPEC, "h100", 8, micro_batches=2, memory_cap_bytes=tight_cap, sequence_link_gbps=3600,
                         granularity=512, activation_factor=2.0)
    fitting = [e for e in tight if e.fits]
    assert 0 < len(fitting) < len(tight)
    assert all(e.activation_bytes + e.model_state_bytes <= tight_cap for e in fitting)
    assert tight[:len(fitting)] == fitting   # the layouts that fit come first


def test_a_layouts_activations_fall_with_its_sequence_degree() -> None:
    """The same plan (one slice) on 2 stages: 2 sequence ranks hold half of what 1 holds, 4 a quarter."""
    layouts = plan_layouts(SPEC, "h100", 8, micro_batches=2, memory_cap_bytes=1e12, sequence_link_gbps=3600,
                           granularity=SPEC.seq_len, max_slices=1)
    by_degree = {e.sequence: e.activation_bytes for e in layouts if e.stages == 2}
    assert by_degree[2] == pytest.approx(by_degree[1] / 2) and by_degree[4] == pytest.approx(by_degree[1] / 4)

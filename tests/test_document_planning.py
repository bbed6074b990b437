"""Tier a: planning packed rows by their documents (ds_terapipe/planner/documents.py).

A slice of a packed row attends over its own document's prefix only, so its cost is the cost model's at the
context *inside its document*. Checked here: the context a step's micro-batches give, the cost wrapper that reads
it at each slice's start (identity without documents, a document start costs as context 0), that the planner
moves its cuts for documents and never predicts worse than the row-length plan under the same documents, and the
memo of the per-batch planner.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds_terapipe.planner.documents import DocumentPlanner, document_context, within_documents
from ds_terapipe.planner.presets import analytic_pipeline_cost
from ds_terapipe.planner.roofline import TransformerSpec
from ds_terapipe.planner.schedule import build_schedule
from ds_terapipe.planner.simulate import simulate
from ds_terapipe.planner.slicing import plan_slicing

L, G = 1024, 16


def _cost(stages: int = 2):
    """Attention-heavy (narrow layers, long rows): where a slice's context decides its cost."""
    spec = TransformerSpec(num_layers=4, hidden=128, num_heads=2, vocab=256, seq_len=L)
    return analytic_pipeline_cost(spec, "cpu", stages, bytes_per_element=4)


def _positions(doc_lengths: list[int]) -> np.ndarray:
    """One row (1, L) packing documents of these lengths (cut at L)."""
    row = np.concatenate([np.arange(n) for n in doc_lengths])[:L]
    assert len(row) == L
    return row[None, :]


def test_document_context_is_the_mean_over_micro_batches_of_the_largest_position_over_rows() -> None:
    a = np.array([[0, 1, 2, 3, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 5]])
    b = np.arange(8)[None, :]
    # grid 2: starts 0, 2, 4, 6 -> a: max(0,0), max(2,0), max(0,2), max(2,4) = 0, 2, 2, 4; b: 0, 2, 4, 6
    assert document_context([a], 2).tolist() == [0, 2, 2, 4]
    assert document_context([a, b], 2).tolist() == [0, 2, 3, 5]
    with pytest.raises(ValueError, match="different lengths"):
        document_context([a, np.arange(6)[None, :]], 2)


def test_without_documents_the_wrapper_is_the_identity() -> None:
    cost = _cost()
    plain = within_documents(cost, document_context([np.arange(L)[None, :]], G), G)
    for schedule in ("gpipe", "1f1b"):
        a = plan_slicing(cost, L, num_microbatches=2, granularity=G, schedule=schedule)
        b = plan_slicing(plain, L, num_microbatches=2, granularity=G, schedule=schedule)
        assert a.slices == b.slices and a.predicted_ms == pytest.approx(b.predicted_ms, rel=1e-12)


def test_a_slice_costs_its_context_inside_its_document() -> None:
    cost = _cost()
    docs = within_documents(cost, document_context([_positions([300, 724])], G), G)
    chunk, inner = docs.chunk(1), cost.chunk(1)
    # a slice starting at 320 sits 20 tokens into the second document; one at 288 is 288 into the first
    assert chunk.forward_ms(64, 320) == pytest.approx(inner.forward_ms(64, 20))
    assert chunk.backward_ms(64, 288) == pytest.approx(inner.backward_ms(64, 288))
    assert chunk.backward_ms(64, 320) == pytest.approx(inner.backward_ms(64, 20))   # B reads the document too
    np.testing.assert_allclose(chunk.forward_ms(np.array([64, 32]), np.array([320, 288]), 2),
                               inner.forward_ms(np.array([64, 32]), np.array([20, 288]), 2))
    assert chunk.forward_ms(64, 320) < inner.forward_ms(64, 320)
    assert chunk.cache_key() != inner.cache_key()   # the planner must not mix the two up


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_plan_for_the_documents_moves_its_cuts_and_is_never_slower_on_them(schedule: str) -> None:
    cost = _cost()
    fixed = plan_slicing(cost, L, num_microbatches=1, granularity=G, schedule=schedule)
    for layout in ([512, 512], [64] * 8 + [512], [900, 124], [128] * 8):
        docs = within_documents(cost, document_context([_positions(layout)], G), G)
        mine = plan_slicing(docs, L, num_microbatches=1, granularity=G, schedule=schedule)
        on_docs = simulate(build_schedule(schedule, 2, 1, len(fixed.slices)), docs, list(fixed.slices)).makespan_ms
        assert mine.predicted_ms <= on_docs * (1 + 1e-9), (layout, mine.slices, fixed.slices)
        assert mine.slices != fixed.slices, layout
    # short documents throughout: every slice costs about the same, so the cuts are close to equal
    docs = within_documents(cost, document_context([_positions([128] * 8)], G), G)
    short = plan_slicing(docs, L, num_microbatches=1, granularity=G, schedule=schedule).slices
    assert max(short) - min(short) < max(fixed.slices) - min(fixed.slices)


def test_the_per_batch_planner_memoises_by_layout_and_stays_bounded() -> None:
    cost = _cost()
    calls: list[int] = []

    def solve(seq_len, c):
        calls.append(seq_len)
        return plan_slicing(c, seq_len, granularity=G, schedule="gpipe")

    planner = DocumentPlanner(cost, G, solve, quantum=32, capacity=2)
    a = document_context([_positions([512, 512])], G)
    b = a + 3    # within the quantum at every grid start (multiples of 16): the same key
    c = document_context([_positions([100, 924])], G)
    first = planner.plan(L, a)
    assert planner.plan(L, b) is first and len(calls) == 1 and planner.hits == 1
    assert planner.plan(L, c) is not first and len(calls) == 2
    planner.plan(L, document_context([_positions([700, 324])], G))   # a third layout evicts the oldest (a)
    planner.plan(L, a)
    assert len(calls) == 4 and len(planner.planning_ms) == 5
    # a quantum below the planning granularity is the granularity: contexts a grid step apart share a plan
    fine = DocumentPlanner(cost, G, solve, quantum=G // 4)
    assert fine.quantum == G and fine.key(L, a + G - 1) == fine.key(L, a)

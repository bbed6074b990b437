"""Tier a: balanced stages in the planner (planner/partition.py) -- layer costs with the vocabulary layers, the
min-max DP and the partition search against brute force, the joint partition + slicing plan, the vocabulary
share. Pure Python, milliseconds to a second per test."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from ds_terapipe.planner.cost import AnalyticCost, TransformerSpec
from ds_terapipe.planner.partition import (ChunkCost, VocabShareCost, best_partition, chunk_costs,
                                           enumerate_partitions, layer_work, minmax_partition, naive_partition,
                                           plan_partition)
from ds_terapipe.planner.presets import (analytic_layer_costs, analytic_pipeline_cost, get_device_preset,
                                         resolve_model)
from ds_terapipe.planner.schedule import build_schedule
from ds_terapipe.planner.simulate import simulate

SPEC = TransformerSpec(num_layers=6, hidden=512, num_heads=4, vocab=65536, seq_len=256)
DEV = get_device_preset("a100")


def _all_partitions(n: int, k: int):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield (0, *cuts, n)


def _mixed_layers(seed: int) -> list:
    """Embedding, blocks of 1-3 layers' cost (unequal), head: heterogeneous layers for the brute-force checks."""
    rng = np.random.default_rng(seed)
    blocks = [AnalyticCost(SPEC, DEV, int(k)) for k in rng.integers(1, 4, size=5)]
    return [AnalyticCost(SPEC, DEV, 0, embedding=True), *blocks, AnalyticCost(SPEC, DEV, 0, lm_head=True)]


def test_chunk_cost_is_the_sum_of_its_layers_and_matches_the_analytic_stage():
    emb, block, head = (AnalyticCost(SPEC, DEV, 0, embedding=True), AnalyticCost(SPEC, DEV, 1),
                        AnalyticCost(SPEC, DEV, 0, lm_head=True))
    whole = AnalyticCost(SPEC, DEV, 3, embedding=True, lm_head=True)
    chunk = ChunkCost([emb, block, block, block, head])
    s, c = np.array([8, 64, 200]), np.array([0, 32, 56])
    np.testing.assert_allclose(chunk.forward_ms(s, c, 2), whole.forward_ms(s, c, 2), rtol=1e-12)
    np.testing.assert_allclose(chunk.backward_ms(s, c, 2), whole.backward_ms(s, c, 2), rtol=1e-12)
    np.testing.assert_allclose(chunk.comm_ms(s, 2), head.comm_ms(s, 2))
    # equal layer kinds share one key: two chunks of the same layers are one model for the planner
    assert ChunkCost([block, block]).cache_key() == ChunkCost([block, block]).cache_key()
    assert ChunkCost([block, block]).cache_key() != ChunkCost([block, head]).cache_key()


def test_embedding_and_head_grow_with_the_vocabulary_and_sit_on_the_end_stages():
    small = analytic_layer_costs(SPEC, DEV, vocab=1000)
    big = analytic_layer_costs(SPEC, DEV, vocab=256000)
    for i in (0, -1):   # embedding (dense per-call gradient) and head (GEMM + softmax)
        assert big[i].backward_ms(64, 0) > 10 * small[i].backward_ms(64, 0)
    assert big[1].forward_ms(64, 0) == small[1].forward_ms(64, 0)          # a block does not see the vocabulary
    assert resolve_model("gpt3-13b", 256000).vocab == 256000 and resolve_model("gpt3-13b").vocab == 50257
    pc = analytic_pipeline_cost(SPEC, DEV, 3, vocab=256000)
    assert pc.stages[0].embedding and not pc.stages[0].lm_head and pc.stages[-1].lm_head
    assert not pc.stages[1].embedding and not pc.stages[1].lm_head
    assert analytic_pipeline_cost("gpt3-1b", "v100", 4, lm_head=False).is_uniform()


@pytest.mark.parametrize("seed", range(6))
def test_minmax_partition_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    w = rng.uniform(0.1, 5.0, size=n)
    for k in range(1, n + 1):
        extra = float(rng.uniform(0, 1))
        value, parts = minmax_partition(w, k, extra)
        brute = min(max(w[a:b].sum() + extra for a, b in zip(p[:-1], p[1:])) for p in _all_partitions(n, k))
        assert value == pytest.approx(brute, rel=1e-12)
        assert max(w[a:b].sum() + extra for a, b in zip(parts[:-1], parts[1:])) == pytest.approx(value, rel=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_enumerate_partitions_is_exactly_the_feasible_set(seed):
    rng = np.random.default_rng(seed)
    n, k = 7, 3
    w = rng.uniform(0.1, 3.0, size=n)
    for cap in (math.inf, *np.quantile(w.sum() * np.array([0.4, 0.5, 0.7]), [0, 0.5, 1])):
        want = {p for p in _all_partitions(n, k) if max(w[a:b].sum() for a, b in zip(p[:-1], p[1:])) <= cap}
        got = list(enumerate_partitions(w, k, cap))
        assert len(got) == len(set(got)) and set(got) == want
    assert len(list(enumerate_partitions(w, k, math.inf, limit=4))) == 4


@pytest.mark.parametrize("schedule,ranks,v", [("gpipe", 2, 1), ("1f1b", 3, 1), ("interleaved-1f1b", 2, 2),
                                              ("dualpipev", 2, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_best_partition_equals_brute_force_over_every_partition(schedule, ranks, v, seed):
    layers = _mixed_layers(seed)
    slices = [[64, 64, 128], [256], [96, 160]][seed]
    m = 4 if schedule == "dualpipev" else 2
    sched = build_schedule(schedule, ranks, m, len(slices), virtual_stages=v)
    brute = min(simulate(sched, chunk_costs(layers, p), slices).makespan_ms
                for p in _all_partitions(len(layers), ranks * v))
    parts, res, exhaustive = best_partition(layers, slices, num_ranks=ranks, num_microbatches=m, schedule=schedule,
                                            virtual_stages=v, window=math.inf, max_candidates=None)
    assert exhaustive
    assert res.makespan_ms == pytest.approx(brute, rel=1e-12)
    assert simulate(sched, chunk_costs(layers, parts), slices).makespan_ms == pytest.approx(brute, rel=1e-12)


def test_layer_work_is_additive_over_layers():
    layers = _mixed_layers(0)
    slices = [64, 64, 128]
    w = layer_work(layers, slices, units=3, batch=2)
    pc = chunk_costs(layers, (0, 3, 7))
    lens, ctx = np.array(slices), np.array([0, 64, 128])
    first = 3 * float(np.sum(pc.stages[0].forward_ms(lens, ctx, 2) + pc.stages[0].backward_ms(lens, ctx, 2)))
    assert w[:3].sum() == pytest.approx(first, rel=1e-12)
    # deferred weight gradients: a layer's W passes (one per slice) are its work too
    deferred = AnalyticCost(SPEC, DEV, 1, deferred_weight_grads=True)
    per_slice = deferred.forward_ms(lens, ctx, 2) + deferred.backward_ms(lens, ctx, 2) + deferred.weight_ms(lens, 2)
    assert float(np.sum(deferred.weight_ms(lens, 2))) > 0
    assert layer_work([deferred], slices, units=3, batch=2)[0] == pytest.approx(3 * float(np.sum(per_slice)))


class _Sends(AnalyticCost):
    """A layer whose output takes ``ms`` to send, whatever the slice."""

    def __init__(self, ms: float) -> None:
        super().__init__(SPEC, DEV, 1)
        self.ms = ms

    def comm_ms(self, slice_len, batch=1):
        return np.full(np.shape(slice_len), self.ms)

    def cache_key(self):
        return ("sends", self.ms, super().cache_key())


def test_a_chunk_sends_what_its_last_layer_outputs():
    assert ChunkCost([_Sends(1.0), _Sends(2.0)]).comm_ms(64) == 2.0
    assert ChunkCost([_Sends(2.0), _Sends(1.0), _Sends(2.0), _Sends(1.0)]).comm_ms(64) == 1.0


@pytest.mark.parametrize("parts", ["0,3,3,7", "0,4,2,7", "0,3,7", "1,3,5,7", "0,3,5,8", "0,a,5,7"])
def test_a_users_parts_are_refused_unless_every_chunk_holds_a_layer(parts: str):
    """``partition_method="parts:..."`` (runtime/features/partition.py): chunks + 1 increasing boundaries from 0 to
    the layer count; an empty or reversed chunk, a wrong count or end, or a non-number is refused with an example."""
    from types import SimpleNamespace

    from ds_terapipe.runtime.features.partition import custom_parts

    module = SimpleNamespace(_layer_specs=[None] * 7)
    assert custom_parts(module, "parts:0,2,5,7", 3) == (0, 2, 5, 7)
    with pytest.raises(ValueError, match=r"give 4 increasing boundaries from 0 to 7 .* e.g. \"parts:0,2,5,7\""):
        custom_parts(module, f"parts:{parts}", 3)


def test_naive_partition_pins_the_ends_and_splits_blocks_evenly():
    assert naive_partition(42, 4, first=1, last=1) == (0, 11, 21, 31, 42)     # 40 blocks: 10 each
    assert naive_partition(9, 2, first=1, last=2) == (0, 4, 9)
    with pytest.raises(ValueError, match="cannot be cut into 5 chunks"):
        naive_partition(5, 5, first=1, last=1)
    with pytest.raises(ValueError, match="increasing boundaries"):
        chunk_costs(_mixed_layers(0), (0, 3, 3, 7))


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
@pytest.mark.parametrize("vocab", [8192, 131072])
def test_plan_partition_is_never_worse_than_naive_and_reports_consistently(schedule, v, vocab):
    layers = analytic_layer_costs(SPEC, DEV, vocab=vocab)
    pp = plan_partition(layers, 256, num_ranks=2, num_microbatches=4, granularity=32, schedule=schedule,
                        virtual_stages=v)
    assert pp.plan.predicted_ms <= pp.naive_plan.predicted_ms * (1 + 1e-12) and pp.speedup >= 1 - 1e-12
    assert pp.parts[0] == 0 and pp.parts[-1] == len(layers) and len(pp.parts) == 2 * v + 1
    assert pp.naive_parts == naive_partition(len(layers), 2 * v, first=1, last=1)
    assert pp.imbalance == pytest.approx(max(pp.busy_ms) / np.mean(pp.busy_ms))
    sched = build_schedule(schedule, 2, 4, pp.plan.num_slices, virtual_stages=v)
    assert simulate(sched, chunk_costs(layers, pp.parts), pp.plan.slices).makespan_ms == \
        pytest.approx(pp.plan.predicted_ms, rel=1e-9)
    text = "\n".join(pp.report_lines())
    assert "speedup over the naive layout" in text and "busy ms per rank" in text
    assert pp.to_dict()["layers_per_chunk"] == list(pp.layers_per_chunk)


def test_a_heavy_head_moves_blocks_off_the_last_stage():
    layers = analytic_layer_costs(SPEC, DEV, vocab=262144)
    pp = plan_partition(layers, 256, num_ranks=2, num_microbatches=8, granularity=32, schedule="1f1b")
    assert pp.layers_per_chunk[-1] < (pp.naive_parts[-1] - pp.naive_parts[-2])
    assert pp.speedup > 1.1 and pp.imbalance < pp.naive_imbalance


def test_vocab_share_divides_the_head_and_adds_collectives():
    head = AnalyticCost(SPEC, DEV, 0, lm_head=True)
    one = VocabShareCost(head, 1, SPEC.hidden, link_latency_ms=DEV.link_latency_ms, link_gbps=DEV.link_gbps)
    assert one.forward_ms(64, 0) == pytest.approx(head.forward_ms(64, 0))
    assert one.backward_ms(64, 0) == pytest.approx(head.backward_ms(64, 0))
    four = VocabShareCost(head, 4, SPEC.hidden, link_latency_ms=DEV.link_latency_ms, link_gbps=DEV.link_gbps)
    coll = four.collective_ms(np.array([8, 64]))
    assert np.all(coll > 0) and coll[1] > coll[0]
    assert four.forward_ms(64, 0) == pytest.approx(head.forward_ms(64, 0) / 4 + four.collective_ms(64))
    assert four.backward_ms(64, 0) == pytest.approx(head.backward_ms(64, 0) / 4 + four.collective_ms(64, backward=True))
    assert four.comm_ms(64) == 0
    # measured on a rank (the runtime's cost-based partition): the head cost is that rank's shard already
    shard = VocabShareCost(head, 4, SPEC.hidden, link_latency_ms=DEV.link_latency_ms, link_gbps=DEV.link_gbps,
                           head_is_shard=True)
    assert shard.forward_ms(64, 0) == pytest.approx(head.forward_ms(64, 0) + four.collective_ms(64))
    assert shard.backward_ms(64, 0) == pytest.approx(head.backward_ms(64, 0) + four.collective_ms(64, backward=True))
    assert shard.cache_key() != four.cache_key()
    # a split input embedding adds EF (ids broadcast, partial sums reduced) and EB (its gradient broadcast)
    split = VocabShareCost(head, 4, SPEC.hidden, link_latency_ms=DEV.link_latency_ms, link_gbps=DEV.link_gbps,
                           split_embedding=True)
    hidden = four.collective_ms(64, backward=True)
    assert split.collective_ms(64, backward=True) == pytest.approx(2 * hidden)
    assert split.collective_ms(64) == pytest.approx(four.collective_ms(64) + hidden + four._collective(64 * 8.0))
    assert split.cache_key() != four.cache_key()


def test_vocab_parallel_plan_balances_a_vocabulary_heavy_model():
    spec = resolve_model(SPEC, 262144)
    layers = analytic_layer_costs(spec, DEV)
    kw = dict(num_ranks=2, num_microbatches=4, granularity=32, schedule="1f1b")
    plain = plan_partition(layers, 256, **kw)
    share = VocabShareCost(layers[-1], 2, spec.hidden, link_latency_ms=DEV.link_latency_ms, link_gbps=DEV.link_gbps)
    vp = plan_partition(layers[:-1], 256, vocab_share=share, **kw)
    assert vp.vocab_parallel and vp.parts[-1] == len(layers) - 1
    assert vp.naive_parts == naive_partition(len(layers) - 1, 2, first=1, last=0)
    assert vp.plan.predicted_ms < plain.naive_plan.predicted_ms
    assert vp.imbalance <= 1.10


@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "dualpipev"])
def test_with_virtual_stages_each_rank_pays_the_vocabulary_share_once(schedule):
    """A rank runs the vocabulary passes once per slice however many chunks it holds: its chunks' share adds up
    to one share, not v (the planner charged every chunk the whole share before)."""
    spec = resolve_model(SPEC, 262144)
    layers = analytic_layer_costs(spec, DEV)
    share = VocabShareCost(layers[-1], 2, spec.hidden, link_latency_ms=DEV.link_latency_ms, link_gbps=DEV.link_gbps)
    blocks = layers[1:-1]
    one, halves = chunk_costs(blocks, [0, len(blocks)], [share]), chunk_costs(blocks, [0, 3, len(blocks)], [share],
                                                                              0.5)
    alone = chunk_costs(blocks, [0, len(blocks)])
    for slice_len, ctx in ((64, 0), (128, 128)):
        rank_halves = sum(float(st.forward_ms(slice_len, ctx)) for st in halves.stages)
        assert rank_halves == pytest.approx(float(one.stages[0].forward_ms(slice_len, ctx)))
        assert rank_halves - float(alone.stages[0].forward_ms(slice_len, ctx)) == \
            pytest.approx(float(share.forward_ms(slice_len, ctx)))
    plan = plan_partition(layers[:-1], 256, num_ranks=2, num_microbatches=4, granularity=32, schedule=schedule,
                          vocab_share=share)
    per_chunk = [float(st.forward_ms(32, 0)) for st in plan.cost.stages]
    no_share = chunk_costs(layers[:-1], plan.parts)
    assert len(per_chunk) == 2 * 2   # 2 ranks x v = 2 chunks
    assert sum(per_chunk) - sum(float(st.forward_ms(32, 0)) for st in no_share.stages) == \
        pytest.approx(2 * float(share.forward_ms(32, 0)))   # 2 ranks x one share each


# --------------------------------------------------------------------------------------------------------------
# CLI: plan | simulate --balance / --vocab-parallel

SMALL = ["--model", "gpt3-1b", "--device", "a100", "--stages", "4", "--seq-len", "512", "--granularity", "32",
         "--microbatches", "4", "--schedule", "1f1b", "--vocab", "256000"]


def _run(capsys, *argv):
    from ds_terapipe.cli import main
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_plan_vocab_parallel_prints_the_three_layouts(capsys):
    import json
    rc, out, err = _run(capsys, "plan", *SMALL, "--vocab-parallel")
    assert rc == 0, err
    for name in ("naive", "balanced", "vocab-par", "imbalance", "busy ms per rank"):
        assert name in out
    rc, out, err = _run(capsys, "plan", *SMALL, "--vocab-parallel", "--json")
    obj = json.loads(out)
    part = obj["partition"]
    assert set(part) == {"naive", "balanced", "vocab_parallel"}
    assert obj["predicted_ms"] == pytest.approx(part["vocab_parallel"]["predicted_ms"])
    assert part["balanced"]["speedup"] == pytest.approx(part["naive"]["predicted_ms"] /
                                                        part["balanced"]["predicted_ms"])
    assert part["balanced"]["predicted_ms"] <= part["naive"]["predicted_ms"]
    assert obj["cost"]["parts"] == part["vocab_parallel"]["parts"]


def test_cli_simulate_balance_simulates_the_chosen_partition(capsys):
    import json
    rc, out, err = _run(capsys, "simulate", *SMALL, "--balance", "--json")
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["makespan_ms"] == pytest.approx(obj["partition"]["balanced"]["predicted_ms"], rel=1e-9)
    assert obj["busy_ms"] == pytest.approx(obj["partition"]["balanced"]["busy_ms"])
    # the vocabulary is the model's unless --vocab says otherwise: a bigger head, a slower naive layout
    rc, out, _ = _run(capsys, "simulate", *SMALL[:-2], "--balance", "--json")
    assert json.loads(out)["partition"]["naive"]["predicted_ms"] < obj["partition"]["naive"]["predicted_ms"]


@pytest.mark.parametrize("argv,match", [
    (["plan", "--cost", "x.json", "--stages", "2", "--seq-len", "64", "--balance"], "needs per-layer costs"),
    (["simulate", *SMALL, "--balance", "--slices", "256,256"], "drop --slices"),
    (["plan", *SMALL, "--vocab-parallel", "--memory-gb", "10"], "--memory-gb is not supported"),
    (["plan", "--cost", "x.json", "--stages", "2", "--seq-len", "64", "--vocab", "10"], "drop --vocab"),
])
def test_cli_partition_refusals(capsys, argv, match):
    rc, out, err = _run(capsys, *argv)
    assert rc == 2 and match in err and err.count("\n") == 1, err


def test_vocab_parallel_refuses_a_vocabulary_smaller_than_the_ranks():
    from ds_terapipe.planner.partition import analytic_layouts
    with pytest.raises(ValueError, match="vocabulary has 3 entries; use at most 3 ranks"):
        analytic_layouts(SPEC, DEV, 4, 256, vocab=3, vocab_parallel=True, granularity=32)

"""Tier b: vocabulary parallelism (terapipe.vocab_parallel) equals the single-process unsliced reference.

One launch per topology runs the grid (tied and untied heads x vocabularies divisible by p and not x gpipe, 1f1b x
slices {1, [8, 24, 16]}) and cases of the virtual-stage schedules (interleaved-1f1b, looped-bfs, dualpipev: two
chunks per rank) that cover the same choices between them; see tests/suites/vocab.py. Loss, every gradient (each
rank's shard against its rows of the reference head), parameters after 3 SGD+momentum steps: fp32 rel err <= 1e-5;
the padding rows of a shard stay exactly 0. With a tied head the input embedding is split too (its gradient is in
the shard's, against the reference's tied table).
"""

from __future__ import annotations

import pytest

from ds_terapipe.planner.schedule import Action
from tests.clipping import assert_clipped_by_the_global_norm
from tests.dist_harness import launch
from tests.results import cases_per_rank

pytestmark = pytest.mark.multiproc

TOL = 1e-5


def _check(results: list[dict], expected_cases: int) -> None:
    per_rank = cases_per_rank(results, expected_cases)
    for index in range(expected_cases):
        covered: set[str] = set()
        for cases in per_rank:
            case = cases[index]
            where = f"{case['case']} stage={case['stage']} dp={case['dp']}"
            for got, ref in zip(case["losses"], case["ref_losses"]):
                assert abs(got - ref) <= TOL * abs(ref), f"{where}: loss {case['losses']} != {case['ref_losses']}"
            assert case["grad_rel_err"] <= TOL, \
                f"{where}: gradient of {case['grad_worst']} off by {case['grad_rel_err']}"
            assert case["param_rel_err"] <= TOL, \
                f"{where}: after 3 steps {case['param_worst']} off by {case['param_rel_err']}"
            assert case["pad_abs"] == 0.0, f"{where}: padding rows moved ({case['pad_abs']})"
            covered.update(case["covered"])
        # every reference parameter is trained on some stage, and the shards' rows tile the vocabulary once; the
        # input embedding's table (tied: the head's; untied: its own rows) lives in shards alone: no stage holds it
        plain = {c for c in covered if "[" not in c}
        tied = "tied=True" in per_rank[0][index]["case"]
        assert len(plain) == per_rank[0][index]["num_ref_params"] - (1 if tied else 3), sorted(plain)
        assert "layers.0.wte.weight" not in plain
        assert tied or any(c.startswith("layers.0.wte.weight[") for c in covered), sorted(covered)
        # every rank joins the split embedding's passes EF/EB, one per unit each
        kinds = [{Action.parse(a).kind.value for a in cases[index]["vocab_actions"]} for cases in per_rank]
        assert all(k == {"VF", "VB", "EF", "EB"} for k in kinds), kinds
        spans = sorted({tuple(int(x) for x in c.split("[")[1].rstrip("]").split(":")) for c in covered if "[" in c})
        assert [a for a, _ in spans] == [0] + [b for _, b in spans[:-1]], spans
        vocab = int(per_rank[0][index]["case"].split("vocab=")[1].split()[0])
        assert spans[-1][1] == vocab, spans


# Virtual-stage schedules, in the same launches: [schedule, vocab, tied, slices, layers]. Between them, at p=2 each
# schedule runs tied and untied, V divisible by p and not, slices 1 and unequal (dualpipev defers W by default,
# looped-bfs+W asks for it); p=3 needs 6 chunks: 4 blocks.
UNEQUAL = [8, 24, 16]
VIRTUAL_CASES = {
    2: [["interleaved-1f1b", 64, True, 1, 2], ["interleaved-1f1b", 63, False, UNEQUAL, 2],
        ["looped-bfs", 63, True, UNEQUAL, 2], ["looped-bfs+W", 64, False, 1, 2],
        ["dualpipev", 64, True, UNEQUAL, 2], ["dualpipev", 63, False, 1, 2], ["dualpipev", 63, True, 1, 2],
        ["interleaved-1f1b", 64, True, "auto", 2], ["dualpipev", 63, False, "auto", 2], ["zbv", 64, True, UNEQUAL, 2]],
    3: [["interleaved-1f1b", 64, True, UNEQUAL, 4], ["dualpipev", 63, False, UNEQUAL, 4],
        ["looped-bfs", 64, False, 1, 4]],
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_grid(world: int, tmp_path) -> None:
    virtual = VIRTUAL_CASES[world]
    results = launch("vocab", world, tmp_path, timeout_s=840, extra={"virtual_cases": virtual})
    _check(results, expected_cases=2 * 2 * 2 * 2 + len(virtual))
    rows = {tuple(c["rows"]) for r in results for c in r["results"] if "vocab=64" in c["case"]}
    assert len(rows) == world  # one shard per pipeline rank
    assert any(r[2] < r[1] for r in rows) == (64 % world != 0)  # padding only when p does not divide V
    # the virtual cases ran with two chunks per rank, placed by their schedule; under dualpipev's V the vocabulary
    # passes are written with rank 0's last chunk (2p-1), whose output they read, and EF/EB with its chunk 0
    for index, (name, *_rest) in enumerate(virtual, start=16):
        for rank, r in enumerate(results):
            case = r["results"][index]
            assert name in case["case"] and len(case["chunks"]) == 2, case["case"]
            want = [rank, 2 * world - 1 - rank] if name in ("dualpipev", "zbv") else [rank, rank + world]
            assert case["chunks"] == want, (case["case"], case["chunks"])
            if "slices=auto" in case["case"]:
                # profiled with the vocabulary passes: rank 0's cost holds every rank's share and the links, the
                # split embedding's passes with a tied head; every rank runs the one plan
                assert case["source"] in ("profiled", "cache") and sum(case["slices"]) == 48, case
                assert case["slices"] == results[0]["results"][index]["slices"], case["case"]
                share = case["vocab_cost"]
                if rank == 0:
                    assert share is not None and share["num_ranks"] == world and share["points"], case["case"]
                    assert share["split_embedding"]  # tied or untied, the input embedding is split
                    assert all(p["forward_ms"] > 0 and p["backward_ms"] > 0 for p in share["points"])
                else:
                    assert share is None
            chunks = {Action.parse(a).kind.value: Action.parse(a).chunk for a in case["vocab_actions"]}
            assert chunks["VF"] == chunks["VB"] == max(want), (case["case"], chunks)
            assert chunks.get("EF", min(want)) == min(want), (case["case"], chunks)


@pytest.mark.timeout(900)
def test_vocab_parallel_with_data_parallel_zero1(tmp_path) -> None:
    """2 stages x 2 replicas (4 processes), ZeRO 1: equal to the reference over the global batch."""
    results = launch("vocab", 4, tmp_path, timeout_s=840,
                     extra={"dp": 2, "zero_stage": 1, "vocabs": [63], "schedules": ["1f1b"],
                            "slicings": [[8, 24, 16]], "clip": True})
    _check(results, expected_cases=2)
    # gradient clipping in ZeRO 1's optimizer: the tied head's shards copy rows of the embedding's gradient and
    # must not count a second time
    for rank, r in enumerate(results):
        (clip, ) = [c for c in r["results"] if c["case"].startswith("clip")]
        assert_clipped_by_the_global_norm(clip, rank)


@pytest.mark.timeout(900)
def test_vocab_parallel_features(tmp_path) -> None:
    """Checkpoints at the same p resume exactly, load at p=1 and export whole (a split tied embedding too, and into
    a model without vocab_parallel and back); a dualpipev checkpoint resumes exactly and loads into 1f1b; eval equals
    the reference; the refusals (no output layer, another loss, vocab < p, config without the module, a label
    outside the vocabulary) on every rank."""
    results = launch("vocab_features", 2, tmp_path, timeout_s=840)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    for r in results:
        cases = {c["case"]: c for c in r["results"]}
        for tied in (True, False):
            ck = cases[f"vocab checkpoint at p=1 tied={tied}"]
            assert ck["resumed"] == ck["uninterrupted"] and ck["resume_err"] == 0.0, ck
            assert ck["export_shape"] == [63, 32] and ck["p1_head_err"] == 0.0 and ck["shard_vs_export_err"] == 0.0
            assert ("4.wte.weight" if tied else "4.weight") in ck["export_keys"]
            # the split input embedding (tied: the head's rows; untied: its own): its table is in the shards only,
            # exported under layer 0, loaded at p = 1, and a model without vocab_parallel loads it (and back)
            assert not ck["layer0_has_table"] and ck["export_embed_err"] == 0.0 and ck["p1_embed_err"] == 0.0, ck
            assert ck["plain_table_err"] == 0.0 and ck["plain_layer_err"] == 0.0, ck
            assert ck["from_plain_err"] == 0.0, ck
        ck = cases["vocab checkpoint under dualpipev"]  # two chunks per rank, both anchors on rank 0
        assert ck["chunks"] == [r["rank"], 3 - r["rank"]], ck
        assert ck["resumed"] == ck["uninterrupted"] and ck["resume_err"] == 0.0, ck
        assert ck["eval_loss"] == pytest.approx(ck["ref_eval_loss"], rel=TOL), ck
        assert ck["layers_equal"] and ck["flat_layer_err"] == 0.0 and ck["flat_head_err"] == 0.0, ck
        assert ck["export_head_err"] == 0.0 and ck["export_embed_err"] == 0.0, ck
        ev = cases["vocab eval"]
        assert ev["loss"] == pytest.approx(ev["ref_loss"], rel=TOL)
        assert "return_logits=False" in ev["return_logits"]
        assert "compute_loss=True" in ev["compute_loss"] and "terapipe.vocab_parallel=True" in ev["compute_loss"]
        assert ev["after"] == pytest.approx(ev["ref_loss"], rel=TOL)
        for tied in (True, False):  # gradient clipping: each shard once, a tied head's shards not at all
            assert_clipped_by_the_global_norm(cases[f"clip vocab tied={tied} zero=0"], r["rank"])
        ref = cases["vocab refusals"]
        assert "GPTFinalNorm) is not a recognisable output layer" in ref["no_head"]
        assert "causal_lm_loss as loss_fn" in ref["loss"]
        assert "vocabulary 1 < 2 pipeline stages" in ref["small_vocab"]
        assert "built with vocab_parallel=False" in ref["config_without_module"]
        assert ref["out_of_vocab"] is not None, r["rank"]   # not trained against a target logit of 0
        assert ("label 63 at (0, 5) of the next batch is outside the vocabulary [0, 63)" if r["rank"] == 1 else
                "rank 1 refused the token ids or labels of the next batch") in ref["out_of_vocab"], ref

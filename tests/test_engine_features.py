"""Tier b, one 2-rank launch: planning at init (profile, one plan, cache), eval_batch, refusal of a
non-causal layer, bf16 on CPU, and a dead peer turning into an error instead of a hang."""

from __future__ import annotations

import pytest

from tests.dist_harness import launch

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def features(tmp_path_factory) -> list[dict[str, dict]]:
    results = launch("features", 2, tmp_path_factory.mktemp("features"), timeout_s=600)
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return [{case["case"]: case for case in r["results"]} for r in results]


@pytest.mark.timeout(700)
def test_auto_plan_is_profiled_once_then_cached_and_exact(features) -> None:
    for rank in features:
        first, second = rank["auto first"], rank["auto second"]
        assert first["source"] == "profiled" and second["source"] == "cache"
        assert first["slices"] == second["slices"] and sum(first["slices"]) == 64
        assert all(s % 8 == 0 for s in first["slices"])
        assert first["predicted_ms"] > 0
        assert len(first["cache_files"]) == 1
        for case in (first, second):
            assert case["loss"] == pytest.approx(case["ref_loss"], rel=1e-5)
            assert case["grad_rel_err"] <= 1e-5, case
    # one plan: every rank runs the same slices
    assert len({tuple(r["auto first"]["slices"]) for r in features}) == 1


@pytest.mark.timeout(700)
def test_eval_batch_matches_reference_without_gradients(features) -> None:
    for rank in features:
        case = rank["eval"]
        assert case["loss"] == pytest.approx(case["ref_loss"], rel=1e-5)
        assert case["logits_rel_err"] <= 1e-5
        assert case["grads_touched"] is False


@pytest.mark.timeout(700)
def test_non_causal_layer_is_refused_on_every_rank(features) -> None:
    for rank in features:
        case = rank["refusal"]
        assert case["raised"] == "SlicingMismatchError", case
        assert "layer 1 (TokenMixer)" in case["message"] and "slices=1" in case["message"]


@pytest.mark.timeout(700)
def test_bf16_on_cpu_trains(features) -> None:
    for rank in features:
        losses = rank["bf16"]["losses"]
        assert losses[0] == pytest.approx(rank["bf16"]["ref_loss"], rel=2e-2)
        assert losses[1] < losses[0]


@pytest.mark.timeout(700)
def test_auto_plan_with_deferred_weight_grads(features) -> None:
    for rank in features:
        case = rank["auto deferred"]
        assert case["loss"] == pytest.approx(case["ref_loss"], rel=1e-5)
        assert case["grad_rel_err"] <= 1e-5, f"gradient of {case['grad_worst']} off by {case['grad_rel_err']}"
        assert case["weight_actions"] == 2 * len(case["slices"])  # 1f1b: a W per unit on every stage
    rates = features[0]["auto deferred"]["weight_rates"]  # rank 0 planned: it holds the measured costs
    assert len(rates) == 2 and all(r is not None and r > 0 for r in rates), rates


@pytest.mark.timeout(700)
def test_bf16_optimizer_gets_deferred_weight_grads(features) -> None:
    moved = [rank["bf16 deferred"]["min_linear_moved"] for rank in features]
    assert any(m is not None for m in moved), moved  # some stage holds the blocks' Linears
    for rank in features:
        case = rank["bf16 deferred"]
        assert case["bf16_optimizer"] is True
        assert case["min_linear_moved"] is None or case["min_linear_moved"] > 1e-4  # every Linear trained ...
        assert case["max_param_diff"] <= 1e-2, case  # ... to the same place as without deferral (bf16 rounding)
        assert case["deferred_losses"] == pytest.approx(case["losses"], rel=1e-2)


@pytest.mark.timeout(700)
def test_dead_peer_fails_within_timeout_naming_the_instruction(features) -> None:
    dead = features[1]["timeout"]
    assert dead["raised"] == "RuntimeError" and "simulated data failure" in dead["message"]
    assert "LoadMicroBatch(buffer_id=1, microbatch=1)" in dead["message"]  # the failing rank says where it was
    case = features[0]["timeout"]
    assert case["raised"] == "P2PTimeoutError", case
    assert case["seconds"] < 30
    assert "RecvGrad(buffer_id=" in case["message"] and "p2p_timeout_s" in case["message"]


@pytest.mark.timeout(700)
def test_checkpoint_resume_is_exact_and_loads_into_another_slicing(features) -> None:
    for rank in features:
        case = rank["checkpoint"]
        assert case["same"]["losses"] == case["uninterrupted"]  # bit-identical
        assert case["other"]["losses"] == pytest.approx(case["uninterrupted"], rel=1e-5)
        assert case["same"]["step"] == 2 and case["same"]["plan"] == [16, 32, 16]


@pytest.mark.timeout(700)
def test_measured_timeline_per_rank(features) -> None:
    for rank, results in enumerate(features):
        case = results["checkpoint"]
        # 4 training batches were traced (2 before the checkpoint, 2 after), one file per batch per rank
        assert sum(f.endswith(f"rank{rank}.json") for f in case["trace_files"]) == 4
        names = [name for name, _, _ in case["timeline"]]
        assert len(names) == 2 * 2 * 3  # F and B of 2 micro-batches x 3 slices (1f1b: no deferral by default)
        assert names[0] == f"{rank}F0.0"
        assert all(end >= start for _, start, end in case["timeline"])


@pytest.mark.timeout(700)
def test_checkpoint_export_restage_and_refusals(features) -> None:
    for rank in features:
        case = rank["checkpoint robustness"]
        assert case["export_err"] == 0.0  # the exported state dict holds exactly the saved weights
        assert case["restage_err"] == 0.0  # a 2-stage checkpoint loads into 1 stage (x 2 replicas)
        assert "is corrupt: layer_01-" in case["corrupt"] and "truncated" in case["corrupt"]
        assert "different dimensions" in case["dims"]
        assert "is (64, 32) in the checkpoint but (64, 64) in this model" in case["dims"]
        assert case["corrupt_untouched"] and case["dims_untouched"]


@pytest.mark.timeout(700)
def test_zero_stage_2_is_refused_with_the_fix(features) -> None:
    for rank in features:
        case = rank["zero2"]
        assert case["raised"] == "ValueError" and "zero_optimization.stage=2" in case["message"]
        assert "use stage 0 or 1" in case["message"]

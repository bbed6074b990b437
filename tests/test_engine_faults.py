"""Tier b, eleven 3-rank launches: no silent wrong gradients, and one rank's error stops every rank in seconds.

* The init-time slice check refuses attention that a zero-initialised output projection hides from the
  outputs (bidirectional, or causal over the slice alone), naming the layer.
* Two attention layers with one constant ``cache_key``, and one block applied at three depths (a
  ``TiedLayerSpec``, twice on the middle stage), train exactly: gpipe and 1f1b, with and without deferred
  weight gradients, against a single-process unsliced reference built from the same layer specs.
* A fault ends a launch (it leaves transfers half done): a loss function raising on the last stage (launch 1),
  data that runs out in the middle of a step (launch 2: every rank stops before the step, together), a layer
  raising in the init-time slice check on the middle stage (launch 3), a rank failing in save_checkpoint
  (launch 4), a layer raising while slices "auto" are profiled, on the middle stage (launch 5) and on the last,
  whose head is tied to the first stage's embedding (launch 8), and the middle stage raising in its
  optimizer step while its peers are inside DeepSpeed's all-reduce of the gradient norm (launch 6), rank 0
  failing inside DeepSpeed's save while its peers wait in that save's barrier (launch 7), the middle stage failing
  while it builds the engine of a repack while its peers are inside that build's broadcasts (launch 10), the first
  stage failing among init's timed reductions while its tied peer is inside one (launch 11; in 6, 7, 10 and 11 the
  peers stop through the collective watch, before any rank exits), and the middle stage failing inside
  DeepSpeed's load while its peers' loads succeed (launch 9). Every rank raises naming the origin rank and its
  error, and stops
  through the abort flag (about a second after the origin raised, timed on the host's one monotonic clock; the
  bound is a quarter of ``p2p_timeout_s`` = 120 s, the wait it replaces, and leaves DeepSpeed's init and the
  profiling out of the window). A killed process, which raises nothing, is caught by the p2p deadline:
  tests/test_engine_features.py and tests/test_example_trainer.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.dist_harness import launch

pytestmark = pytest.mark.multiproc

WORLD = 3
TOL = 1e-5


def _by_case(results: list[dict]) -> list[dict[str, dict]]:
    errors = [r["error"] for r in results if "error" in r]
    assert not errors, errors[0]
    return [{case["case"]: case for case in r["results"]} for r in results]


@pytest.fixture(scope="module")
def launch_loss(tmp_path_factory) -> list[dict[str, dict]]:
    return _by_case(launch("faults", WORLD, Path(tmp_path_factory.mktemp("faults_loss")), timeout_s=400,
                           extra={"fault": "loss"}))


def _fault_only(tmp_path_factory, fault: str) -> list[dict[str, dict]]:
    """A launch that goes straight to one fault (the other cases run in the loss launch)."""
    return _by_case(launch("faults", WORLD, Path(tmp_path_factory.mktemp(f"faults_{fault}")), timeout_s=300,
                           extra={"fault": fault, "cases": False}))


@pytest.fixture(scope="module")
def launch_length(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "length")


@pytest.fixture(scope="module")
def launch_init(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "init")


@pytest.fixture(scope="module")
def launch_profile(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "profile")


@pytest.fixture(scope="module")
def launch_profile_last(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "profile last")


@pytest.fixture(scope="module")
def launch_checkpoint(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "checkpoint")


def _stopped_promptly(results: list[dict[str, dict]], case: str, origin: int) -> None:
    """Every rank raised within a quarter of its p2p deadline of the moment the origin raised: the abort flag
    stopped it, it did not wait out the deadline (nor, at init, the process group's much longer timeout)."""
    failed_at, deadline = results[origin][case]["raised_at"], results[origin][case]["p2p_timeout_s"]
    assert deadline >= 60, deadline   # a bound below 5x the flag's second would measure the machine, not the engine
    for rank, result in enumerate(results):
        after = result[case]["raised_at"] - failed_at
        assert after < deadline / 4, f"rank {rank} raised {after:.1f}s after rank {origin} (p2p_timeout_s {deadline})"


def _stopped_by(results: list[dict[str, dict]], case: str, origin: int, where: str, error: str) -> None:
    """The origin raised ``error``; every other rank raised PeerFailedError naming it, promptly."""
    first = results[origin][case]
    assert error in f"{first['raised']}: {first['message']}", first
    for rank, result in enumerate(results):
        if rank != origin:
            assert result[case]["raised"] == "PeerFailedError", result[case]
            assert f"rank {origin} (stage {origin}) failed in {where}: {error}" in result[case]["message"], \
                result[case]["message"]
    _stopped_promptly(results, case, origin)


@pytest.mark.timeout(500)
@pytest.mark.parametrize("mode, layer", [("bidirectional", 1), ("slice-blind", 1), ("bidirectional, last stage", 4)])
def test_zero_initialised_projection_is_refused_naming_the_layer(launch_loss, mode: str, layer: int) -> None:
    """On every rank: the last stage's case is found on rank 2 alone, whose verdict stops ranks 0 and 1 too."""
    for rank in launch_loss:
        case = rank[f"refusal {mode}"]
        assert case["raised"] == "SlicingMismatchError", case
        assert f"layer {layer} (ZeroProjMixer)" in case["message"] and "slices=1" in case["message"], case["message"]
        assert f"gradients of parameter {layer}.proj.weight" in case["message"], case["message"]


@pytest.mark.timeout(500)
def test_a_model_without_a_sampler_is_checked_on_its_first_batch(launch_loss) -> None:
    # built without vocab_size or input_sampler, init cannot probe: the first train_batch checks on its real
    # inputs and refuses on every rank before any weight moves
    for rank in launch_loss:
        case = rank["refusal bidirectional, no sampler"]
        assert case["raised"] == "SlicingMismatchError", case
        assert "layer 1 (ZeroProjMixer)" in case["message"] and "checked on the first batch" in case["message"], case
        assert case["trained"] is False, case


@pytest.mark.timeout(500)
@pytest.mark.parametrize("model", ["constant key", "shared block"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "gpipe+W", "1f1b+W"])
def test_shared_keys_and_weight_shared_blocks_train_exactly(launch_loss, model: str, schedule: str) -> None:
    covered: set[str] = set()
    for rank in launch_loss:
        case = rank[f"{model} {schedule}"]
        assert case["loss"] == pytest.approx(case["ref_loss"], rel=TOL), case
        assert case["grad_rel_err"] <= TOL, f"gradient of {case['grad_worst']} off by {case['grad_rel_err']}"
        covered.update(case["covered"])
    # every parameter of the model got its gradient on some stage (the reference's names: a gradient that never
    # arrived is missing from a rank's snapshot, not wrong in it); the shared block's on every stage it is on
    ref_names = set(launch_loss[0][f"{model} {schedule}"]["ref_names"])
    assert covered == ref_names, f"no stage has a gradient of {sorted(ref_names - covered)}"
    shared = {n for n in covered if n.startswith("tied_modules.shared.")}
    assert len(shared) == (12 if model == "shared block" else 0), sorted(covered)
    # some stage runs two blocks with one cache key (two blocks, or one shared block twice)
    assert max(rank[f"{model} {schedule}"]["blocks"] for rank in launch_loss) >= 2


@pytest.mark.timeout(500)
def test_a_planner_failure_on_rank_0_is_raised_by_every_rank(launch_loss) -> None:
    origin = launch_loss[0]["planner failure"]
    assert origin["raised"] == "ValueError" and "cannot be met" in origin["message"], origin
    for rank in launch_loss[1:]:
        case = rank["planner failure"]
        assert case["raised"] == "ValueError", case
        assert "planning on global rank 0 failed: ValueError: terapipe.memory_limit_gb" in case["message"], case
    _stopped_promptly(launch_loss, "planner failure", 0)   # not the process group's timeout


@pytest.mark.timeout(500)
def test_raising_loss_stops_every_rank_within_seconds(launch_loss) -> None:
    origin = launch_loss[WORLD - 1]["raising loss"]
    assert origin["raised"] == "RuntimeError" and "simulated loss failure" in origin["message"], origin
    for rank in launch_loss[:-1]:
        case = rank["raising loss"]
        assert case["raised"] == "PeerFailedError", case
        assert f"rank {WORLD - 1} (stage {WORLD - 1}) failed in train_batch" in case["message"], case["message"]
        assert "RuntimeError: simulated loss failure" in case["message"], case["message"]
    _stopped_promptly(launch_loss, "raising loss", WORLD - 1)


@pytest.mark.timeout(500)
def test_data_that_runs_out_mid_step_stops_every_rank_before_the_step(launch_length) -> None:
    # the first and last stages read the step's micro-batches ahead; the middle stage learns it in the agreement
    for rank in launch_length:
        case = rank["short iterator"]
        assert case["raised"] == "StopIteration", case
        assert "fewer than the 2 micro-batches of the step" in case["message"], case["message"]
    _stopped_promptly(launch_length, "short iterator", 0)


@pytest.mark.timeout(500)
def test_a_rank_failing_at_init_stops_every_rank_within_seconds(launch_init) -> None:
    _stopped_by(launch_init, "init", 1, "engine init", "RuntimeError: simulated layer failure under slicing")


@pytest.mark.timeout(500)
def test_a_rank_failing_in_save_checkpoint_stops_every_rank_within_seconds(launch_checkpoint) -> None:
    _stopped_by(launch_checkpoint, "checkpoint", 1, "save_checkpoint", "OSError: simulated disk failure")


@pytest.fixture(scope="module")
def launch_optimizer(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "optimizer")


@pytest.fixture(scope="module")
def launch_deepspeed_save(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "deepspeed save")


def _stopped_by_the_watch(results: list[dict[str, dict]], case: str, origin: int, inside: str,
                          watched: tuple[int, ...] = ()) -> None:
    """Every peer of the origin (``watched``: those ranks; the others may stop in a wait of the engine's own)
    stopped inside ``inside``, and every peer before any rank's process left (an exit would have closed the
    connections anyway: every rank lingers until all have stopped)."""
    first_left = min(result[case]["left_at"] for result in results)
    for rank, result in enumerate(results):
        if rank != origin:
            assert rank not in (watched or [rank]) or f"inside {inside}" in result[case]["message"], result[case]
            assert result[case]["raised_at"] < first_left, result[case]


@pytest.mark.timeout(500)
def test_a_rank_failing_in_its_optimizer_step_stops_every_rank_within_seconds(launch_optimizer) -> None:
    # its peers wait inside the all-reduce of the gradient norm, which cannot watch the flag: the collective watch does
    _stopped_by(launch_optimizer, "optimizer", 1, "train_batch",
                "RuntimeError: simulated out of memory in the optimizer step")
    _stopped_by_the_watch(launch_optimizer, "optimizer", 1, "DeepSpeed's gradient reduction")


@pytest.mark.timeout(500)
def test_a_rank_failing_inside_deepspeed_s_save_stops_every_rank_within_seconds(launch_deepspeed_save) -> None:
    # its peers wait in the barrier of DeepSpeed's save
    _stopped_by(launch_deepspeed_save, "deepspeed save", 0, "save_checkpoint",
                "OSError: simulated disk failure in DeepSpeed's save")
    _stopped_by_the_watch(launch_deepspeed_save, "deepspeed save", 0, "DeepSpeed's checkpoint save")


@pytest.fixture(scope="module")
def launch_deepspeed_load(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "deepspeed load")


@pytest.mark.timeout(500)
def test_a_rank_failing_inside_deepspeed_s_load_stops_every_rank_at_the_end_of_its_load(launch_deepspeed_load) -> None:
    # its peers' loads succeed; they stop at the barrier that ends every load, not later in a collective without a
    # deadline (or not at all: without it they returned from load_checkpoint as if the job were whole)
    _stopped_by(launch_deepspeed_load, "deepspeed load", 1, "load_checkpoint",
                "OSError: simulated unreadable layer file in DeepSpeed's load")


@pytest.mark.timeout(500)
def test_a_rank_failing_while_profiling_stops_every_rank_within_seconds(launch_profile) -> None:
    _stopped_by(launch_profile, "profile", 1, "engine init", "RuntimeError: simulated layer failure while profiling")


@pytest.mark.timeout(500)
def test_the_last_stage_failing_while_profiling_stops_its_tied_peer_within_seconds(launch_profile_last) -> None:
    # rank 0 would otherwise wait in the timed all-reduce of the tied embedding's gradient, which has no deadline
    _stopped_by(launch_profile_last, "profile last", 2, "engine init",
                "RuntimeError: simulated layer failure while profiling")


@pytest.fixture(scope="module")
def launch_repack(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "repack")


@pytest.mark.timeout(500)
def test_a_rank_failing_while_building_the_repacked_engine_stops_every_rank_within_seconds(launch_repack) -> None:
    # its peers are inside DeepSpeed's broadcasts of the new engine's build: the collective watch stops them
    _stopped_by(launch_repack, "repack", 1, "train_batch",
                "RuntimeError: simulated out of memory building the repacked engine")
    _stopped_by_the_watch(launch_repack, "repack", 1, "the repack")


@pytest.fixture(scope="module")
def launch_profile_reduce(tmp_path_factory) -> list[dict[str, dict]]:
    return _fault_only(tmp_path_factory, "profile reduce")


@pytest.mark.timeout(500)
def test_a_rank_failing_among_init_s_timed_reductions_stops_every_rank_within_seconds(launch_profile_reduce) -> None:
    # its tied peer (the last stage) is inside the timed all-reduce of the tied embedding's gradient, which has no
    # deadline; the middle stage waits in a barrier of the engine's own
    _stopped_by(launch_profile_reduce, "profile reduce", 0, "engine init",
                "RuntimeError: simulated out of memory allocating the tied reduction's buffer")
    _stopped_by_the_watch(launch_profile_reduce, "profile reduce", 0, "engine init's slice check and profile",
                          watched=(2, ))

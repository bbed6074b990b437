"""Tier a: checkpoint manifest, latest pointer and export, on synthetic files (no processes)."""

from __future__ import annotations

import os

import pytest
import torch

from ds_terapipe.runtime.execution.checkpoint import (MANIFEST, CheckpointError, export_state_dict, read_latest,
                                            verify_manifest, write_latest, write_manifest)


def make_ckpt(root, tag: str = "global_step3") -> str:
    tag_dir = root / tag
    tag_dir.mkdir(parents=True)
    torch.save({"weight": torch.arange(6.0).view(2, 3)}, tag_dir / "layer_00-model_00-model_states.pt")
    torch.save({"bias": torch.ones(3)}, tag_dir / "layer_01-model_00-model_states.pt")
    torch.save({"optimizer": {}}, tag_dir / "mp_rank_00_model_states.pt")
    write_manifest(str(tag_dir), {"num_stages": 2})
    write_latest(str(root), tag)
    return str(tag_dir)


def test_round_trip_and_export(tmp_path) -> None:
    tag_dir = make_ckpt(tmp_path)
    assert verify_manifest(tag_dir)["num_stages"] == 2
    assert read_latest(str(tmp_path)) == "global_step3"
    flat = export_state_dict(str(tmp_path))
    assert set(flat) == {"0.weight", "1.bias"} and torch.equal(flat["0.weight"], torch.arange(6.0).view(2, 3))


def test_truncated_altered_missing_and_unfinished_are_refused(tmp_path) -> None:
    tag_dir = make_ckpt(tmp_path)
    layer = os.path.join(tag_dir, "layer_01-model_00-model_states.pt")
    data = open(layer, "rb").read()
    open(layer, "wb").write(data[:-5])
    with pytest.raises(CheckpointError, match="layer_01-model_00-model_states.pt has .* bytes.*truncated"):
        verify_manifest(tag_dir)
    open(layer, "wb").write(data[:-1] + bytes([data[-1] ^ 1]))
    with pytest.raises(CheckpointError, match="does not match its SHA-256"):
        verify_manifest(tag_dir)
    os.remove(layer)
    with pytest.raises(CheckpointError, match="incomplete: layer_01-model_00-model_states.pt is missing"):
        verify_manifest(tag_dir)
    os.remove(os.path.join(tag_dir, MANIFEST))
    with pytest.raises(CheckpointError, match="no terapipe_manifest.json: it is incomplete"):
        export_state_dict(str(tmp_path))


def test_interrupted_save_keeps_latest_on_the_previous_checkpoint(tmp_path) -> None:
    make_ckpt(tmp_path, "global_step3")
    # a later save that died after writing files but before its manifest: latest was never moved
    (tmp_path / "global_step6").mkdir()
    torch.save({"weight": torch.zeros(2, 3)}, tmp_path / "global_step6" / "layer_00-model_00-model_states.pt")
    assert read_latest(str(tmp_path)) == "global_step3"
    assert set(export_state_dict(str(tmp_path))) == {"0.weight", "1.bias"}
    with pytest.raises(CheckpointError, match="incomplete"):
        export_state_dict(str(tmp_path), tag="global_step6")


def test_no_latest_names_the_fix(tmp_path) -> None:
    with pytest.raises(CheckpointError, match="no 'latest' file; pass tag="):
        export_state_dict(str(tmp_path))


def test_export_of_a_missing_directory_says_it_does_not_exist(tmp_path) -> None:
    # it used to say "has no 'latest' file; pass tag= (one of [])": no tag could have helped
    with pytest.raises(CheckpointError, match=r"checkpoint directory .*nope does not exist; pass the directory"):
        export_state_dict(str(tmp_path / "nope"))
    make_ckpt(tmp_path)
    with pytest.raises(CheckpointError, match=r"latest is a file, not a directory"):
        export_state_dict(str(tmp_path / "latest"))
    with pytest.raises(CheckpointError, match=r"has no tag 'global_step6' .* one of \['global_step3'\]"):
        export_state_dict(str(tmp_path), tag="global_step6")
    os.remove(tmp_path / "latest")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(CheckpointError, match=r"no 'latest' file; pass tag= \(one of \['global_step3'\]\)"):
        export_state_dict(str(tmp_path))


def test_export_of_a_tag_directory_exports_that_tag(tmp_path) -> None:
    """ckpt/global_step3 itself (it holds the layer files and the manifest) is that tag's checkpoint; its files
    used to be offered as tags."""
    tag_dir = make_ckpt(tmp_path)
    other = make_ckpt(tmp_path, "global_step6")   # latest now names global_step6, whose weight differs
    torch.save({"weight": torch.zeros(2, 3)}, os.path.join(other, "layer_00-model_00-model_states.pt"))
    write_manifest(other, {"num_stages": 2})
    assert torch.equal(export_state_dict(str(tmp_path))["0.weight"], torch.zeros(2, 3))
    flat = export_state_dict(tag_dir)
    assert set(flat) == {"0.weight", "1.bias"} and torch.equal(flat["0.weight"], torch.arange(6.0).view(2, 3))
    assert torch.equal(export_state_dict(tag_dir + os.sep, tag="global_step3")["0.weight"], flat["0.weight"])
    with pytest.raises(CheckpointError, match=r"is itself the checkpoint of tag 'global_step3'.*tag='global_step6'"):
        export_state_dict(tag_dir, tag="global_step6")
    # a tag directory whose manifest is missing (an interrupted save) is still a tag directory: refused as such
    os.remove(os.path.join(tag_dir, MANIFEST))
    with pytest.raises(CheckpointError, match="no terapipe_manifest.json: it is incomplete"):
        export_state_dict(tag_dir)


# -- the slicing a resumed run runs (runtime/planning/plan.py: checkpoint_slices, restore_checkpoint_plan)
# ---------------
def _summary(**over) -> dict:
    plan = {"slices": [24, 24], "seq_len": 48, "schedule": "1f1b", "num_stages": 2, "virtual_stages": 1,
            "micro_batches": 2, "micro_batch_size": 2}
    return {**plan, **over}


def _config(**over) -> dict:
    from ds_terapipe.config import parse_terapipe_config

    return parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 48, "schedule": "1f1b",
                                               **over}}).model_dump()


def test_a_checkpoint_plan_is_run_again_only_for_the_same_shape_and_planning_keys() -> None:
    from ds_terapipe.runtime.planning.plan import checkpoint_slices

    saved = {"plan": _summary(), "config": _config()}
    here = _summary(slices=[48])   # this start profiled another slicing: the checkpoint's wins
    assert checkpoint_slices(saved, here, _config()) == ({48: (24, 24)}, "")
    # the config may differ in what does not plan (a timeout, the trace directory)
    assert checkpoint_slices(saved, here, _config(p2p_timeout_s=5.0, trace_dir="t"))[0] == {48: (24, 24)}
    # variable lengths: every length the run had planned (the plan in use may be another length's)
    varlen = {"plan": _summary(slices=[16, 16], seq_len=32), "plans": {"48": [24, 24], "32": [16, 16], "64": [64]},
              "config": _config()}
    assert checkpoint_slices(varlen, here, _config()) == ({32: (16, 16), 48: (24, 24), 64: (64,)}, "")
    refused = {
        "micro_batches 2 -> 4": (saved, _summary(micro_batches=4), _config()),
        "num_stages 2 -> 4": (saved, _summary(num_stages=4), _config()),
        "terapipe.memory_limit_gb None -> 1.0": (saved, here, _config(memory_limit_gb=1.0)),
        "terapipe.granularity 8 -> 16": (saved, here, _config(granularity=16)),
        "no terapipe plan": ({"config": _config()}, here, _config()),
        "[20, 28] for seq_len 48 are not positive multiples": ({"plan": _summary(slices=[20, 28])}, here, _config()),
        "[16, 8] for seq_len 32 are not": ({"plan": _summary(), "plans": {"32": [16, 8]}}, here, _config()),
        "a sequence length 'x'": ({"plan": _summary(), "plans": {"x": [16]}}, here, _config()),
    }
    for why, args in refused.items():
        slices, message = checkpoint_slices(*args)
        assert slices == {} and why in message, (why, message)
    assert checkpoint_slices(None, here, _config())[0] == {}


def test_resume_plan_off_or_slices_from_the_config_restore_nothing_without_a_collective() -> None:
    from types import SimpleNamespace

    from ds_terapipe.config import parse_terapipe_config
    from ds_terapipe.runtime.planning.plan import restore_checkpoint_plan

    saved = {"plan": _summary(), "config": _config()}
    for over in ({"resume_plan": False}, {"slices": 2}):
        cfg = parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 48, **over}})
        # no process group here: reaching the broadcast would raise
        assert restore_checkpoint_plan(SimpleNamespace(terapipe=cfg), saved) is None
    assert parse_terapipe_config({"terapipe": {"enabled": True, "seq_len": 48}}).resume_plan


@pytest.mark.parametrize("kind", ["torch", "deepspeed"])
def test_a_loaded_lr_scheduler_sets_its_lr_for_a_fresh_optimizer(kind: str) -> None:
    """A load into another stage layout takes the lr scheduler but not the optimizer: the fresh optimizer's param
    groups must stand at the checkpoint's lr for the next step, not at the lr the scheduler set at init."""
    from deepspeed.runtime.lr_schedules import WarmupLR

    from ds_terapipe.runtime.execution.engine import _set_scheduled_lr

    def build() -> tuple[torch.optim.Optimizer, object]:
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
        if kind == "torch":
            return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        return opt, WarmupLR(opt, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10, warmup_type="linear")

    saved_opt, saved = build()
    for _ in range(3):
        saved_opt.step()
        saved.step()
    want = saved_opt.param_groups[0]["lr"]
    fresh_opt, fresh = build()
    assert fresh_opt.param_groups[0]["lr"] != pytest.approx(want)
    fresh.load_state_dict(saved.state_dict())
    _set_scheduled_lr(fresh)
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(want)


def test_latest_written_by_hand_with_a_newline_names_the_tag(tmp_path) -> None:
    make_ckpt(tmp_path)
    (tmp_path / "latest").write_text("global_step3\n")   # echo global_step3 > latest
    assert read_latest(str(tmp_path)) == "global_step3"
    assert set(export_state_dict(str(tmp_path))) == {"0.weight", "1.bias"}


def test_layer_shapes_name_a_tensor_the_checkpoint_lacks_or_holds_in_another_shape(tmp_path) -> None:
    """``check_layer_shapes`` (before anything is loaded): each of this rank's layers against its file; a tensor
    only the file holds is not refused (a layer without it loads the rest)."""
    import glob
    from types import SimpleNamespace

    from ds_terapipe.runtime.execution.checkpoint import check_layer_shapes

    tag_dir = make_ckpt(tmp_path)   # layer 0: weight (2, 3); layer 1: bias (3,)

    def stage(*layers: torch.nn.Module) -> SimpleNamespace:
        return SimpleNamespace(forward_funcs=list(layers), _local_start=0, ckpt_layer_path_list=lambda d, i: sorted(
            glob.glob(os.path.join(d, f"layer_{i:02d}-*model_states.pt"))))

    assert check_layer_shapes(stage(torch.nn.Linear(3, 2, bias=False)), tag_dir) is None
    assert check_layer_shapes(stage(torch.nn.Identity()), tag_dir) is None
    lacks = check_layer_shapes(stage(torch.nn.Linear(3, 2)), tag_dir)
    assert "layer 0 (Linear): the checkpoint lacks ['bias']" in lacks
    assert "layer 0 weight is (2, 3) in the checkpoint but (2, 4) in this model" in check_layer_shapes(
        stage(torch.nn.Linear(4, 2, bias=False)), tag_dir)


def test_a_load_meets_its_peers_in_an_abort_aware_barrier_before_its_first_broadcast(monkeypatch) -> None:
    """``load_checkpoint`` starts with rank 0's read of `latest`, broadcast without a deadline: a rank that failed
    after its last wait on the abort flag (a step's end its script caught) must stop its peers first, in a barrier
    that watches the flag."""
    from contextlib import nullcontext
    from types import SimpleNamespace

    from ds_terapipe.runtime.execution import engine_checkpoint

    calls: list[str] = []

    def decided(decide) -> None:
        calls.append("decided_on_rank0")
        raise RuntimeError("stop here")

    monkeypatch.setattr(engine_checkpoint, "decided_on_rank0", decided)
    engine = SimpleNamespace(_failing_fast=lambda what: nullcontext(),
                             barrier=lambda what: calls.append(f"barrier: {what}"))
    with pytest.raises(RuntimeError, match="stop here"):
        engine_checkpoint.Checkpointing.load_checkpoint(engine, "/nowhere")
    assert calls == ["barrier: the start of a checkpoint load", "decided_on_rank0"], calls


def test_a_manifest_one_rank_cannot_read_does_not_make_it_repack_alone(monkeypatch, tmp_path) -> None:
    """Before a load, an engine in the original layout repacks like the checkpoint (collective); a rank that cannot
    read the manifest (a permission, a stale file handle) must not raise alone there, leaving its peers in the
    repack's collectives: it skips, and the manifest check that follows refuses the load on every rank."""
    from types import SimpleNamespace

    from ds_terapipe.runtime.execution import engine_checkpoint

    def unreadable(tag_dir: str) -> dict:
        raise PermissionError(13, "Permission denied", tag_dir)

    monkeypatch.setattr(engine_checkpoint.ckpt, "read_manifest", unreadable)
    engine = SimpleNamespace(freezer=SimpleNamespace(repacked=None, cfg=SimpleNamespace(repack=True)))
    assert engine_checkpoint.Checkpointing._repack_like(engine, str(tmp_path), "global_step3") is None

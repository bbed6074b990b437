"""Tier b, end to end: examples/train_gpt.py in fresh processes, as a user runs it.

* One stage with ``slices: "auto"``: a second launch reuses the plan cache (its costs re-timed).
* benchmarks/on_gpu.sh's trainer steps (bf16 save, resume, uninterrupted run, comparison) run on the CPU.
* Resume is exact: 6 steps uninterrupted == 3 steps + checkpoint + new processes + --resume + 3 steps, to the
  last bit of every loss (with virtual stages: dualpipev, two chunks per rank, the loss on rank 0). The same
  checkpoint in bf16 (another optimizer format): --resume refused on both ranks, --resume-weights-only goes on.
  ``--compile aot_eager`` trains the uninterrupted run's losses.
* A rank killed mid-run: the survivor exits with an error (no hang), and --resume continues from the last
  checkpoint, losing at most the checkpoint interval.
* Freezing with a repack (``--freeze 2:3 --repack``: stage 0 frozen, then 1 stage x 2 replicas): a rank killed
  right after the repack fails its peer, and --resume from the checkpoint before it repacks again and trains the
  same losses as the run that was not interrupted, to the last bit.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ds_terapipe.runtime.execution.local_launch import free_port
from tests.dist_harness import ROOT, run_ranks
from tests.fork_server import REFUSED

pytestmark = pytest.mark.multiproc

CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
          "steps_per_print": 10**9, "pipeline": {"stages": 2},
          "terapipe": {"enabled": True, "seq_len": 64, "slices": 2, "granularity": 8, "schedule": "1f1b",
                       "p2p_timeout_s": 20}}


def trainer(tmp: Path, name: str, *extra: str, terapipe: dict | None = None, ds: dict | None = None) -> list[str]:
    config = tmp / "ds_config.json"
    config.write_text(json.dumps(dict(CONFIG, **(ds or {}), terapipe=dict(CONFIG["terapipe"], **(terapipe or {})))))
    return [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--deepspeed_config", str(config),
            "--layers", "2", "--hidden", "32", "--heads", "4", "--log-every", "1", "--eval-every", "0",
            "--max-corpus-mb", "0.3", "--metrics", str(tmp / f"{name}.jsonl"), *extra]


def run_forks(argv: list[str], world_size: int, out_dir: Path, **options) -> tuple[list[int | None], list[str]]:
    """``run_ranks`` with each rank a fork of the session's fork server (tests/fork_run.py): the trainer's options,
    checkpoints and faults are what these tests check, not the interpreter's start, which costs each rank 5 s of
    CPU. One launch below and benchmarks/on_gpu.sh's (through the ``deepspeed`` launcher) start as a user's do."""
    codes, texts = run_ranks(argv, world_size, out_dir, forked=True, **options)
    assert not any(REFUSED in text for text in texts), texts[0][-3000:]   # refused: slow, not wrong
    return codes, texts


def losses(tmp: Path, name: str) -> dict[int, float]:
    return {row["step"]: row["loss"] for row in map(json.loads, (tmp / f"{name}.jsonl").read_text().splitlines())}


def check(codes, texts) -> None:
    assert codes == [0, 0], "\n".join(f"--- rank {r}:\n{t[-3000:]}" for r, t in enumerate(texts))


def test_command_line_overrides_are_in_the_config_before_it_is_validated(tmp_path) -> None:
    """In process (no launch): a terapipe section with plan_per_batch and no packed is valid with --pack, which
    sets packed; the changed config is handed over as a dict. --freeze/--repack are applied the same way, and a
    trainer without those options (train_hf) applies --pack alone."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_gpt_example", ROOT / "examples" / "train_gpt.py")
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(dict(CONFIG, terapipe=dict(CONFIG["terapipe"], slices="auto", plan_per_batch=True))))

    def args(**kw) -> argparse.Namespace:
        return argparse.Namespace(**{"deepspeed_config": str(path), "pack": False, **kw})

    with pytest.raises(ValueError, match="needs packed: true"):   # the file alone, as before
        train_gpt.read_config(args(freeze=None, repack=False), "train_gpt")
    packed = args(freeze=None, repack=False, pack=True)
    ds_config, config, terapipe = train_gpt.read_config(packed, "train_gpt")
    assert terapipe.packed and terapipe.plan_per_batch and config is ds_config and packed.deepspeed_config is None
    assert ds_config["terapipe"]["packed"] is True
    hf = args(pack=True)   # train_hf's options: no --freeze / --repack
    assert train_gpt.read_config(hf, "train_hf")[2].packed and hf.deepspeed_config is None
    plain = args(freeze=None, repack=False)
    path.write_text(json.dumps(CONFIG))
    _, config, terapipe = train_gpt.read_config(plain, "train_gpt")
    assert config is None and plain.deepspeed_config == str(path) and not terapipe.packed   # the file, unchanged
    frozen = train_gpt.read_config(args(freeze="2:1", repack=True), "train_gpt")[2].freeze
    assert frozen.repack and frozen.schedule == [[2, 1]], frozen
    with pytest.raises(SystemExit, match="--repack needs --freeze or a terapipe.freeze section"):
        train_gpt.read_config(args(freeze=None, repack=True), "train_gpt")


@pytest.mark.timeout(600)
def test_resume_in_fresh_processes_is_bit_identical(tmp_path) -> None:
    v_shape = {"schedule": "dualpipev", "virtual_stages": 2}
    check(*run_forks(trainer(tmp_path, "full", "--steps", "6", terapipe=v_shape), 2, tmp_path / "full",
                     timeout_s=240))
    ckpt = str(tmp_path / "ckpt")
    check(*run_forks(trainer(tmp_path, "first", "--steps", "3", "--save-dir", ckpt, "--save-every", "3",
                             terapipe=v_shape), 2, tmp_path / "first", timeout_s=240))
    # the resumed run also pins its processes to cores (--bind-cores): same threads per process, same numbers; its
    # ranks are processes of their own, as a user's are (the trainer sets their threads before torch starts any)
    codes, texts = run_ranks(trainer(tmp_path, "second", "--steps", "6", "--save-dir", ckpt, "--resume",
                                     "--bind-cores", terapipe=v_shape), 2, tmp_path / "second", timeout_s=240)
    check(codes, texts)
    assert "at step 3" in texts[0]
    full, first, second = losses(tmp_path, "full"), losses(tmp_path, "first"), losses(tmp_path, "second")
    assert sorted(full) == [1, 2, 3, 4, 5, 6] and sorted(second) == [4, 5, 6]
    assert [first[s] for s in (1, 2, 3)] == [full[s] for s in (1, 2, 3)]
    assert [second[s] for s in (4, 5, 6)] == [full[s] for s in (4, 5, 6)]  # exact float equality
    assert full[6] < full[1]
    # --compile: engine.compile() before training (aot_eager: dynamo and AOT autograd), the same losses to rounding
    codes, texts = run_forks(trainer(tmp_path, "compiled", "--steps", "3", "--compile", "aot_eager", terapipe=v_shape),
                             2, tmp_path / "compiled", timeout_s=240)
    check(codes, texts)
    assert "engine.compile(backend='aot_eager'): compiled=True" in texts[0], texts[0][-3000:]
    compiled = losses(tmp_path, "compiled")
    assert [compiled[s] for s in (1, 2, 3)] == pytest.approx([full[s] for s in (1, 2, 3)], rel=1e-5)
    # the same checkpoint in bf16: its optimizer keeps the state another way, so --resume is refused on both ranks
    # with the fix, and --resume-weights-only continues from the last one (step 6) with a fresh optimizer
    bf16 = {"bf16": {"enabled": True}}
    codes, texts = run_forks(trainer(tmp_path, "bf16", "--steps", "8", "--save-dir", ckpt, "--resume",
                                     terapipe=v_shape, ds=bf16), 2, tmp_path / "bf16", timeout_s=240)
    assert codes[0] != 0 and codes[1] != 0, codes
    for text in texts:
        assert "holds its optimizer state as the torch optimizer's" in text and "DeepSpeed's bf16 optimizer" in text, (
            text[-3000:])
    codes, texts = run_forks(trainer(tmp_path, "bf16_weights", "--steps", "8", "--save-dir", ckpt,
                                     "--resume-weights-only", terapipe=v_shape, ds=bf16),
                             2, tmp_path / "bf16_weights", timeout_s=240)
    check(codes, texts)
    assert "at step 6" in texts[0] and sorted(losses(tmp_path, "bf16_weights")) == [7, 8], texts[0][-3000:]


@pytest.mark.timeout(300)
def test_one_stage_with_slices_auto_reuses_its_cached_plan(tmp_path) -> None:
    """One stage (one process, as on a single GPU) profiles equal stages, which the plan cache stores written once;
    the second launch hits the cache and re-times those costs before it trains. The second config keeps
    ``pipeline.stages: 2``: ``--stages 1`` is written over it (the engine refuses a section that disagrees with the
    module)."""
    auto = {"slices": "auto", "plan_cache": str(tmp_path / "cache"),
            "profile": {"slice_lengths": [16, 32, 64], "num_contexts": 2, "warmup": 0, "repeats": 1}}
    for name, ds in (("profiled", {"pipeline": {"stages": 1}}), ("cached", None)):
        codes, texts = run_forks(trainer(tmp_path, name, "--steps", "2", "--stages", "1", terapipe=auto, ds=ds), 1,
                                 tmp_path / name, timeout_s=120)
        assert codes == [0], texts[0][-3000:]
        assert sorted(losses(tmp_path, name)) == [1, 2]
    assert "cached costs re-timed" in texts[0], texts[0][-3000:]


@pytest.mark.timeout(600)
def test_killed_rank_fails_fast_and_resume_loses_at_most_one_interval(tmp_path) -> None:
    ckpt = str(tmp_path / "ckpt")
    codes, texts = run_forks(trainer(tmp_path, "crash", "--steps", "200", "--save-dir", ckpt, "--save-every", "2"),
                             2, tmp_path / "crash", timeout_s=240, kill=(1, "step     5 "), fail_fast=False)
    assert codes[1] is None, "rank 1 should have been killed"
    assert codes[0] not in (0, None), f"rank 0 should fail, not finish or hang:\n{texts[0][-3000:]}"
    assert re.search(r"P2PTimeoutError|Connection closed|Connection reset|failed in step", texts[0]), texts[0][-3000:]
    crashed_at = max(losses(tmp_path, "crash"))
    codes, texts = run_forks(trainer(tmp_path, "resume", "--steps", str(crashed_at + 2), "--save-dir", ckpt,
                                     "--resume"), 2, tmp_path / "resume", timeout_s=240)
    check(codes, texts)
    resumed_at = int(re.search(r"at step (\d+)", texts[0]).group(1))
    assert crashed_at - 2 <= resumed_at <= crashed_at
    assert "done" in texts[0]


@pytest.mark.timeout(600)
def test_a_rank_killed_right_after_a_repack_fails_fast_and_resume_repacks_identically(tmp_path) -> None:
    # 2 blocks: layers embed 0, blocks 1-2 | norm 3, head 4 (uniform: [0, 3) and [3, 5)); from step 2 stage 0
    # holds frozen layers only and the run repacks to 1 stage x 2 replicas
    freeze = ("--freeze", "2:3", "--repack")
    ckpt = str(tmp_path / "ckpt")
    codes, texts = run_forks(trainer(tmp_path, "crash", "--steps", "200", "--save-dir", ckpt, "--save-every", "2",
                                     *freeze), 2, tmp_path / "crash", timeout_s=240, kill=(1, "repacked"),
                             fail_fast=False)
    assert codes[1] is None, "rank 1 should have been killed"
    assert codes[0] not in (0, None), f"rank 0 should fail, not finish or hang:\n{texts[0][-3000:]}"
    assert re.search(r"P2PTimeoutError|PeerFailedError|Connection closed|Connection reset", texts[0]), \
        texts[0][-3000:]
    # the last checkpoint is from before the repack or after it (the kill lands a few steps late on a fast
    # model): either way the resumed run repacks (at step 2, or while loading) and goes on
    crashed_at = max(losses(tmp_path, "crash"))
    end = str(crashed_at + 2)
    codes, texts = run_forks(trainer(tmp_path, "resume", "--steps", end, "--save-dir", ckpt, "--resume", *freeze),
                             2, tmp_path / "resume", timeout_s=240)
    check(codes, texts)
    resumed_at = int(re.search(r"at step (\d+)", texts[0]).group(1))
    assert crashed_at - 2 <= resumed_at <= crashed_at and "repacked" in texts[0], texts[0][-3000:]
    codes, texts = run_forks(trainer(tmp_path, "full", "--steps", end, *freeze), 2, tmp_path / "full",
                             timeout_s=240)
    check(codes, texts)
    assert "step 2: repacked 2 stage(s) x 1 replica(s) -> 1 x 2" in texts[0], texts[0][-3000:]
    full, resumed = losses(tmp_path, "full"), losses(tmp_path, "resume")
    steps = list(range(resumed_at + 1, crashed_at + 3))
    assert sorted(resumed) == steps
    assert [resumed[s] for s in steps] == [full[s] for s in steps]  # exact float equality


@pytest.mark.timeout(400)
def test_the_gpu_script_s_trainer_steps_run_here(tmp_path) -> None:
    """benchmarks/on_gpu.sh is run where device time is short: its trainer steps (save, resume, the uninterrupted
    run, the comparison, the compiled run) are tried here on the CPU with a small bf16 config, so a change to the
    trainer's options fails here rather than on a lent GPU. The launcher gets a free port (29500 may be taken), and
    the uninterrupted and compiled runs go beside the save and resume on a second one (``ON_GPU_CONCURRENT``: on a
    CPU the timings they print mean nothing)."""
    import os
    import subprocess

    ports = [free_port()]
    while len(ports) < 2:
        ports += [port for port in [free_port()] if port not in ports]
    config = tmp_path / "bf16.json"
    config.write_text(json.dumps({**CONFIG, "pipeline": {"stages": 1}, "bf16": {"enabled": True},
                                  "terapipe": dict(CONFIG["terapipe"], seq_len=64, slices=2)}))
    env = dict(os.environ, ON_GPU_TRAINER_ONLY="1", ON_GPU_CONFIG=str(config), DS_ACCELERATOR="cpu",
               ON_GPU_COMPILE_BACKEND="aot_eager",   # inductor's C++ code generation takes minutes on a CPU
               ON_GPU_MASTER_PORT=str(ports[0]), ON_GPU_CONCURRENT="1", ON_GPU_MASTER_PORT2=str(ports[1]),
               ON_GPU_TRAINER_ARGS="--layers 2 --hidden 32 --heads 4 --max-corpus-mb 0.3")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "on_gpu.sh"), str(tmp_path / "out")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    # the resumed run went on from the checkpoint at step 20, and matched the uninterrupted run exactly
    assert "steps 21..30: largest loss difference after the resume 0 " in done.stdout, done.stdout[-3000:]
    # and the compiled run beside the uncompiled one: its step time and how far its losses moved
    assert re.search(r"ms/step \(median of the logged windows after the first\): uncompiled \d+, compiled \d+ "
                     r"\(\d+\.\d\dx\); largest loss difference over steps 1\.\.30: ", done.stdout), done.stdout[-3000:]

"""Suite ``precision_resume``, asserted on by tests/test_precision_resume.py: for bf16 and fp16 at ZeRO 0 and 1 on 2
stages (x the replicas the world size leaves), train 2 steps, save, train 3 more (the uninterrupted run); then a
fresh engine loads the checkpoint and trains the same 3 steps. Each case records both runs' losses, loss scales,
learning rates and final fp32 master weights, so the test can require them equal bit for bit; a third engine loads
weights only (``load_optimizer_states=False``) and records how far its fp32 master weights are from the loaded
weights; a fourth, at the other ZeRO stage, asks for the optimizer state and records its refusal. SGD with momentum
and a warm-up learning rate make the optimizer and scheduler state matter; a dynamic fp16 loss scale with a short
window makes the loss scaler's state matter. Case names are "<precision> zero<stage>", precision one of fp32, bf16,
fp16 (``extra["cases"]``; the default leaves fp32 out, which other suites resume). Cases "fp16 growth zero<stage>"
train a dynamic scale until it first doubles beside a run at that scale held, and record both runs' weights and
the scales the dynamic run's csv monitor logged.

DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; with ``extra["force_fp16"]`` the suite
lets DeepSpeed build its fp16 optimizers anyway (torch runs fp16 on any CPU, slowly), since what is tested here is
their checkpoint state, not fp16 speed.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

import ds_terapipe
from deepspeed.accelerator import get_accelerator
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from tests.suites import suite
from tests.suites.common import ENGINE_REF, STATUS, WORLD, make_batches, master_weights

STAGES = 2
STEPS_BEFORE, STEPS_AFTER = 2, 3
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              # dynamic scale from 2^8, doubled after every 2 clean steps: the scale moves while the test runs
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}},
              # the dynamic scale's first value, held: a run that divides every step by the scale of its backward
              "fp16 static": {"fp16": {"enabled": True, "loss_scale": 256}}}


def _engine(cfg: GPTConfig, precision: str, zero_stage: int, *, micro: int, batch: int, seq_len: int,
            extra_config: dict | None = None) -> Any:
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="uniform")
    dp = WORLD // STAGES
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro,
              "train_batch_size": batch * micro * dp, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05, "warmup_max_lr": 0.1,
                                                           "warmup_num_steps": 8, "warmup_type": "linear"}},
              "terapipe": {"enabled": True, "seq_len": seq_len, "slices": [16, 32, 16], "schedule": "1f1b"},
              **PRECISIONS[precision], **(extra_config or {})}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    return max(((float((a[n].float() - b[n].float()).abs().max()), n) for n in a), default=(0.0, ""))


def _loss_scale(engine: Any) -> float:
    """The fp16 loss scale the next step uses (1 without one); each DeepSpeed optimizer keeps it elsewhere."""
    optimizer = engine.optimizer
    for owner in (optimizer, getattr(optimizer, "loss_scale_config", None), getattr(optimizer, "loss_scaler", None)):
        if getattr(owner, "cur_scale", None) is not None:
            return float(owner.cur_scale)
    return 1.0


def _train(engine: Any, groups: Iterator[list[tuple]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"losses": [], "scales": [], "lrs": [], "norms": []}
    for group in groups:
        out["losses"].append(float(engine.train_batch(iter(group))))
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["scales"].append(_loss_scale(engine))
        out["lrs"].append(float(engine.get_lr()[0]))
    return out


def _case(cfg: GPTConfig, precision: str, zero_stage: int, ckpt: Path) -> dict[str, Any]:
    micro, batch, seq_len = 2, 2, 64
    dp = WORLD // STAGES
    steps = make_batches(cfg, (STEPS_BEFORE + STEPS_AFTER) * micro * dp, batch, seq_len, seed=23)
    first = _engine(cfg, precision, zero_stage, micro=micro, batch=batch, seq_len=seq_len)
    dp_id = first.grid.data_parallel_id
    # step s of replica r: micro-batches [(s * dp + r) * micro, ... + micro)
    groups = [steps[(s * dp + dp_id) * micro:(s * dp + dp_id + 1) * micro] for s in range(STEPS_BEFORE + STEPS_AFTER)]
    before = _train(first, iter(groups[:STEPS_BEFORE]))
    first.save_checkpoint(str(ckpt), client_state={"step": STEPS_BEFORE})
    uninterrupted = _train(first, iter(groups[STEPS_BEFORE:]))
    master = master_weights(first)
    optimizer = type(first.optimizer).__name__
    again = _engine(cfg, precision, zero_stage, micro=micro, batch=batch, seq_len=seq_len)
    _, client = again.load_checkpoint(str(ckpt))
    resumed = _train(again, iter(groups[STEPS_BEFORE:]))
    # weights only: the optimizer's fp32 copies are the loaded weights (not the new engine's initial ones)
    weights_only = _engine(cfg, precision, zero_stage, micro=micro, batch=batch, seq_len=seq_len)
    initial = {n: p.detach().clone() for n, p in weights_only.module.named_parameters()}
    weights_only.load_checkpoint(str(ckpt), load_optimizer_states=False)
    loaded = {n: p.detach().clone() for n, p in weights_only.module.named_parameters()}
    ENGINE_REF.pop("engine", None)
    # the other ZeRO stage keeps its optimizer state another way: asked for it, every rank refuses the load
    other = _engine(cfg, precision, 1 - zero_stage, micro=micro, batch=batch, seq_len=seq_len)
    try:
        other.load_checkpoint(str(ckpt))
        refusal = "not refused"
    except ds_terapipe.CheckpointError as err:
        refusal = str(err)
    ENGINE_REF.pop("engine", None)
    return {"case": STATUS["case"], "optimizer": optimizer, "format": first.optimizer_format(),
            "other_stage": [other.optimizer_format(), refusal], "before": before, "uninterrupted": uninterrupted,
            "resumed": resumed, "master_max_diff": _max_diff(master, master_weights(again)),
            "weights_only_master_vs_weights": _max_diff(master_weights(weights_only), loaded),
            "loaded_vs_initial": _max_diff(loaded, initial),
            "step": client["step"], "global_steps": [first.global_steps, again.global_steps]}


def _growth_case(cfg: GPTConfig, zero_stage: int, out: Path) -> dict[str, Any]:
    """The dynamic fp16 scale doubles after the 3rd step's backward (window 2); until it does, the run must equal
    one at that scale held. DeepSpeed's optimizers double it before dividing the step's gradients by it, which
    halved that step (runtime/execution/loss_scale.py). The dynamic run's csv monitor records the scale after each
    step (global rank 0's ``monitor_scales``), as DeepSpeed's does: the doubled one after the 3rd."""
    micro, batch, seq_len, steps = 2, 2, 64, 3
    dp = WORLD // STAGES
    data = make_batches(cfg, steps * micro * dp, batch, seq_len, seed=29)
    monitor = {"csv_monitor": {"enabled": True, "output_path": str(out), "job_name": f"growth_zero{zero_stage}"}}
    runs = {}
    for precision in ("fp16", "fp16 static"):
        engine = _engine(cfg, precision, zero_stage, micro=micro, batch=batch, seq_len=seq_len,
                         extra_config=monitor if precision == "fp16" else None)
        dp_id = engine.grid.data_parallel_id
        trained = _train(engine, iter([data[(s * dp + dp_id) * micro:(s * dp + dp_id + 1) * micro]
                                       for s in range(steps)]))
        runs[precision] = (trained, master_weights(engine))
        ENGINE_REF.pop("engine", None)
    logged = out / f"growth_zero{zero_stage}" / "Train_Samples_loss_scale.csv"
    return {"case": STATUS["case"], "scales": {name: run[0]["scales"] for name, run in runs.items()},
            "losses": {name: run[0]["losses"] for name, run in runs.items()},
            "monitor_scales": ([float(line.split(",")[1]) for line in logged.read_text().splitlines()[1:]]
                               if logged.exists() else None),
            "norms": runs["fp16"][0]["norms"],
            "master_max_diff": _max_diff(runs["fp16"][1], runs["fp16 static"][1])}


@suite("precision_resume")
def suite_precision_resume(extra: dict) -> list[dict]:
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=11)
    fp16 = bool(get_accelerator().is_fp16_supported())
    if extra.get("force_fp16") and not fp16:
        get_accelerator().is_fp16_supported = lambda: True  # this process only: see the module docstring
    results: list[dict] = [{"case": "host", "fp16_supported": fp16, "world": WORLD}]
    for name in extra.get("cases", ["bf16 zero0", "bf16 zero1", "fp16 zero0", "fp16 zero1", "fp16 growth zero0",
                                    "fp16 growth zero1"]):
        precision, zero = name.rsplit(maxsplit=1)
        zero_stage = int(zero.removeprefix("zero"))
        STATUS["case"] = name
        try:
            if precision == "fp16 growth":
                results.append(_growth_case(cfg, zero_stage, Path(extra["out"])))
                continue
            ckpt = Path(extra["out"]) / name.replace(" ", "_")
            results.append(_case(cfg, precision, zero_stage, ckpt))
        except Exception as err:  # noqa: BLE001 - every rank fails the same load the same way; the test reads it
            results.append({"case": name, "error": f"{type(err).__name__}: {err}",
                            "traceback": traceback.format_exc()})
            ENGINE_REF.pop("engine", None)
    return results

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
the scales the dynamic run's csv monitor logged. Cases "fp16 overflow" and "bf16 overflow" feed steps whose
gradients hold an inf or a nan (``OVERFLOW_STEPS``: the loss of every replica or of one, one gradient of one stage)
to the token pipeline and to stock DeepSpeed's PipelineEngine at ZeRO 0 and 1, taking fp16's dynamic scale down to
``min_loss_scale``, and record what each step did (skipped or not, scale, hysteresis, lr, weights and optimizer
state moved, the error raised at the minimum).

DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; with ``extra["force_fp16"]`` the suite
lets DeepSpeed build its fp16 optimizers anyway (torch runs fp16 on any CPU, slowly), since what is tested here is
their checkpoint state, not fp16 speed.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import deepspeed
import ds_terapipe
from deepspeed.accelerator import get_accelerator
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from tests.suites import suite
from tests.suites.common import (ENGINE_REF, POISON, POISON_FACTORS, RANK, STATUS, WORLD, loss_scale,
                                 make_batches, master_weights, poison, poisoned_loss)

STAGES = 2
STEPS_BEFORE, STEPS_AFTER = 2, 3
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              # dynamic scale from 2^8, doubled after every 2 clean steps: the scale moves while the test runs
              "fp16": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2}},
              # the dynamic scale's first value, held: a run that divides every step by the scale of its backward
              "fp16 static": {"fp16": {"enabled": True, "loss_scale": 256}},
              # DeepSpeed's default hysteresis (2) and a window no run reaches; overflows take it to its minimum
              "fp16 overflow": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000,
                                         "min_loss_scale": 64}}}
#: what each step of an overflow case feeds in: "huge", "inf", "nan" multiply the loss of micro-batch 1 by 1e30
#: (finite, its fp16 gradients are not), inf or nan, on every replica or (``@0``) on replica 0 alone;
#: "stage0 nan" puts a nan into one weight gradient of stage 0 on replica 0 alone, every other rank's being finite
OVERFLOW_STEPS = {"fp16": ["clean", "huge", "stage0 nan", "nan@0", "clean", "inf"],
                  "bf16": ["clean", "inf", "stage0 nan", "nan@0", "clean"]}


def _engine(cfg: GPTConfig, precision: str, zero_stage: int, *, micro: int, batch: int, seq_len: int,
            extra_config: dict | None = None, loss_fn: Callable = causal_lm_loss,
            slices: list[int] | None = None) -> Any:
    """The token pipeline over ``slices`` (default [16, 32, 16]); ``slices=[]``: stock DeepSpeed's
    PipelineEngine (1F1B) on the same module."""
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=STAGES, loss_fn=loss_fn,
                                            vocab_size=cfg.vocab_size, partition_method="uniform")
    dp = WORLD // STAGES
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro,
              "train_batch_size": batch * micro * dp, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": zero_stage}, "zero_allow_untested_optimizer": True,
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05, "warmup_max_lr": 0.1,
                                                           "warmup_num_steps": 8, "warmup_type": "linear"}},
              **PRECISIONS[precision], **(extra_config or {})}
    slices = [16, 32, 16] if slices is None else slices
    if slices:
        config["terapipe"] = {"enabled": True, "seq_len": seq_len, "slices": slices, "schedule": "1f1b"}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = (ds_terapipe.initialize if slices else deepspeed.initialize)(model=model, optimizer=opt,
                                                                                   config=config)
    ENGINE_REF["engine"] = engine
    return engine


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    return max(((float((a[n].float() - b[n].float()).abs().max()), n) for n in a), default=(0.0, ""))


def _train(engine: Any, groups: Iterator[list[tuple]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"losses": [], "scales": [], "lrs": [], "norms": []}
    for group in groups:
        out["losses"].append(float(engine.train_batch(iter(group))))
        out["norms"].append(float(engine.get_global_grad_norm()))
        out["scales"].append(loss_scale(engine))
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
            "monitor_scales": _monitor_scales(logged),
            "norms": runs["fp16"][0]["norms"],
            "master_max_diff": _max_diff(runs["fp16"][1], runs["fp16 static"][1])}


def _monitor_scales(logged: Path) -> list[float] | None:
    """The loss scales DeepSpeed's csv monitor logged, read on global rank 0, the one rank that writes them (it
    appends each step's row after that step, so another rank reading at its own end may miss rank 0's last row);
    None elsewhere or when nothing was logged."""
    if RANK != 0 or not logged.exists():
        return None
    return [float(line.split(",")[1]) for line in logged.read_text().splitlines()[1:]]


def _poison_grad(grad: torch.Tensor) -> torch.Tensor:
    if POISON["grad"] is None:
        return grad
    grad = grad.clone()
    grad.view(-1)[0] = POISON["grad"]
    return grad


def _optimizer_state(engine: Any) -> list[torch.Tensor]:
    inner = engine.optimizer.optimizer   # the SGD each DeepSpeed optimizer wraps
    return [v.detach().clone() for state in inner.state.values() for v in state.values() if torch.is_tensor(v)]


def _overflow_run(cfg: GPTConfig, precision: str, zero_stage: int, slices: list[int], out: Path) -> dict[str, Any]:
    """Train OVERFLOW_STEPS[precision] on the token pipeline over ``slices`` (``[]``: stock DeepSpeed); per step:
    the loss, loss scale, hysteresis, skipped and global steps, lr, gradient norm, and how far the step moved the
    fp32 master weights and the optimizer's state; where a step raised, its index and error."""
    micro, batch, seq_len = 2, 2, 64
    steps = OVERFLOW_STEPS[precision]
    dp = WORLD // STAGES
    data = make_batches(cfg, len(steps) * micro * dp, batch, seq_len, seed=37)
    job = f"overflow_{precision}_zero{zero_stage}_{len(slices)}slices"   # 0 slices: stock DeepSpeed
    monitor = {"csv_monitor": {"enabled": True, "output_path": str(out), "job_name": job}}
    engine = _engine(cfg, f"{precision} overflow" if precision == "fp16" else precision, zero_stage, micro=micro,
                     batch=batch, seq_len=seq_len, loss_fn=poisoned_loss, slices=slices, extra_config=monitor)
    dp_id = engine.grid.data_parallel_id
    if (engine.stage_id, dp_id) == (0, 0):
        next(p for n, p in engine.module.named_parameters() if not n.startswith("tied_modules")).register_hook(
            _poison_grad)
    run: dict[str, Any] = {key: [] for key in ("losses", "scales", "hysteresis", "skipped", "global_steps", "lrs",
                                               "norms", "weights_moved", "state_moved")}
    run["raised"] = None
    for step, what in enumerate(steps):
        group = list(data[(step * dp + dp_id) * micro:(step * dp + dp_id + 1) * micro])
        kind, _, replica = what.partition("@")
        if kind in POISON_FACTORS and replica in ("", str(dp_id)):
            group = poison(group, kind)
        POISON["grad"] = float("nan") if kind == "stage0 nan" else None
        weights, state = master_weights(engine), _optimizer_state(engine)
        try:
            run["losses"].append(float(engine.train_batch(iter(group))))
        except Exception as err:  # noqa: BLE001 - the test compares it with stock DeepSpeed's
            run["raised"] = [step, f"{type(err).__name__}: {err}"]
            break
        finally:
            POISON.update(loss=1.0, grad=None)
        scaler = getattr(engine.optimizer, "loss_scaler", None)
        run["scales"].append(loss_scale(engine))
        run["hysteresis"].append(getattr(scaler, "cur_hysteresis", None))
        run["skipped"].append(engine.skipped_steps)
        run["global_steps"].append(engine.global_steps)
        run["lrs"].append(float(engine.get_lr()[0]))
        run["norms"].append(float(engine.get_global_grad_norm()))
        run["weights_moved"].append(_max_diff(master_weights(engine), weights)[0])
        after = _optimizer_state(engine)
        run["state_moved"].append(max((float((a - b).abs().max()) for a, b in zip(after, state)), default=0.0)
                                  if len(after) == len(state) else float("inf"))
    run["master"] = master_weights(engine)
    ENGINE_REF.pop("engine", None)
    logged = out / job / "Train_Samples_loss_scale.csv"
    run["monitor_scales"] = _monitor_scales(logged)
    return run


def _overflow_case(cfg: GPTConfig, precision: str, out: Path) -> dict[str, Any]:
    """OVERFLOW_STEPS[precision] at ZeRO 0 and 1 on the token pipeline over 3 slices and on stock DeepSpeed (fp16 on
    one replica also unsliced, which stock DeepSpeed at ZeRO 1 must equal bit for bit), each run's record
    (``_overflow_run``) with its fp32 master weights at the end compared with stock DeepSpeed's at the same ZeRO
    stage and (``vs_zero1``) with the same engine's at ZeRO 1."""
    engines = {"3 slices": [16, 32, 16], "stock": []}
    if precision == "fp16" and WORLD == STAGES:
        engines["unsliced"] = [64]
    runs: dict[str, dict[str, Any]] = {}
    for zero_stage in (0, 1):
        for label, slices in engines.items():
            runs[f"zero{zero_stage} {label}"] = _overflow_run(cfg, precision, zero_stage, slices, out)
    for name, run in runs.items():
        zero, label = name.split(maxsplit=1)
        run["vs_stock"] = _max_diff(run["master"], runs[f"{zero} stock"]["master"])[0]
        run["vs_zero1"] = _max_diff(run["master"], runs[f"zero1 {label}"]["master"])[0]
    for run in runs.values():
        del run["master"]
    return {"case": STATUS["case"], "steps": OVERFLOW_STEPS[precision], "runs": runs}


@suite("precision_resume")
def suite_precision_resume(extra: dict) -> list[dict]:
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=11)
    fp16 = bool(get_accelerator().is_fp16_supported())
    if extra.get("force_fp16") and not fp16:
        get_accelerator().is_fp16_supported = lambda: True  # this process only: see the module docstring
    results: list[dict] = [{"case": "host", "fp16_supported": fp16, "world": WORLD}]
    for name in extra.get("cases", ["bf16 zero0", "bf16 zero1", "fp16 zero0", "fp16 zero1", "fp16 growth zero0",
                                    "fp16 growth zero1", "fp16 overflow",
                                    # bf16's skips come from DeepSpeed's or the engine's (flat gradients at ZeRO
                                    # 0) reductions alike: tested where a replica must learn of another's
                                    *(["bf16 overflow"] if WORLD > STAGES else [])]):
        STATUS["case"] = name
        try:
            if name.endswith(" overflow"):
                results.append(_overflow_case(cfg, name.split()[0], Path(extra["out"])))
                continue
            precision, zero = name.rsplit(maxsplit=1)
            zero_stage = int(zero.removeprefix("zero"))
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

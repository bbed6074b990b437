"""What the suites of cases share (tests/suites/__init__.py): this rank's place, the case being run, the
single-process references they compare with, engine builders, comparisons and case runners.

Every case compares the token pipeline against a single-process unsliced reference computed in the same process
(GPTReference with the same seeded weights, the same global batch), gradient by gradient. ``STATUS["case"]`` names
the case being run and ``ENGINE_REF["engine"]`` holds the engine being built or trained: tests/dist_worker.py's
watchdog prints both when a rank hangs.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
import time
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch

import deepspeed
import ds_terapipe
from deepspeed.pipe import TiedLayerSpec
from ds_terapipe.models.gpt import GPTConfig, GPTReference, causal_lm_loss, gpt_layer_specs, reference_param_name

RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
STATUS = {"case": "startup"}
ENGINE_REF: dict[str, Any] = {}


def make_batches(cfg: GPTConfig, num: int, batch: int, seq_len: int, seed: int,
                 ignored: bool = False) -> list[tuple]:
    """``num`` random (inputs, labels) micro-batches. ``ignored``: labels of -100 (not counted, still in the
    denominator: ``causal_lm_loss``) at every 7th position, and at the first 8 positions of every row of every
    other micro-batch, so a first slice of 8 tokens there counts no token at all."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for index in range(num):
        ids = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), generator=gen)
        labels = ids[:, 1:].clone()
        if ignored:
            labels[:, ::7] = -100
            if index % 2:
                labels[:, :8] = -100
        out.append((ids[:, :-1].contiguous(), labels))
    return out


def reference_step(cfg: GPTConfig, batches: list[tuple], num_steps: int, lr: float,
                   momentum: float, model: torch.nn.Module | None = None, max_norm: float = 0.0,
                   norms: Optional[list[float]] = None
                   ) -> tuple[list[float], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Unsliced single-process training: per step, mean loss over its micro-batches (of ``model``, default the
    reference GPT). With ``max_norm`` > 0 the gradients are clipped by torch's ``clip_grad_norm_`` over the whole
    model before each step (the first-step gradients are taken before it, as ``first_step_grads`` does), and each
    step's norm is appended to ``norms``."""
    model = GPTReference(cfg) if model is None else model
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    per_step = len(batches) // num_steps
    losses, first_grads = [], {}
    for step in range(num_steps):
        opt.zero_grad()
        chunk = batches[step * per_step:(step + 1) * per_step]
        total = sum(causal_lm_loss(model(x), y) for x, y in chunk) / len(chunk)
        total.backward()
        losses.append(float(total))
        if step == 0:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        if max_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm))
            if norms is not None:
                norms.append(norm)
        opt.step()
    return losses, first_grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def replica_batches(batches: list[tuple], dp_id: int, micro: int, dp: int, num_steps: int) -> list[tuple]:
    """Replica ``dp_id``'s micro-batches: step s uses global micro-batches [s*micro*dp, (s+1)*micro*dp), and
    each replica takes ``micro`` of them, in order."""
    return [batches[s * micro * dp + dp_id * micro + j] for s in range(num_steps) for j in range(micro)]


@contextmanager
def first_step_grads(engine: Any) -> Iterator[dict[str, torch.Tensor]]:
    """Inside the block, snapshot parameter gradients right before the first optimizer step. The hook sits on the
    engine's class, for this engine only: a repack before the first step (runtime/features/repack.py) gives the
    engine object the repacked engine's ``__dict__``, which would drop a hook set on the instance."""
    grads: dict[str, torch.Tensor] = {}
    cls = type(engine)
    own = cls.__dict__.get("_take_model_step")
    original = cls._take_model_step

    def snapshot_then_step(self, *args, **kwargs):
        if self is engine and not grads:
            grads.update({n: p.grad.detach().clone() for n, p in self.module.named_parameters()
                          if p.grad is not None})
        return original(self, *args, **kwargs)

    cls._take_model_step = snapshot_then_step
    try:
        yield grads
    finally:
        if own is None:
            del cls._take_model_step
        else:
            cls._take_model_step = own


def train_steps(engine: Any, data: Iterator, num_steps: int) -> tuple[list[float], list[Optional[float]]]:
    """``num_steps`` training steps: each step's loss and the gradient norm the engine reports for it
    (``get_global_grad_norm``: None where nothing computed one)."""
    losses, norms = [], []
    for _ in range(num_steps):
        losses.append(float(engine.train_batch(data)))
        norm = engine.get_global_grad_norm()
        norms.append(None if norm is None else float(norm))
    return losses, norms


def run_pipeline(cfg: GPTConfig, *, stages: int, micro_batches: int, batch: int, seq_len: int,
                 batches_for_rank: Callable[[int], list[tuple]], num_steps: int, lr: float, momentum: float,
                 terapipe: dict | None, zero_stage: int = 0, checkpoint_interval: int = 0,
                 virtual_stages: int = 1, stock_dualpipev: bool = False, clipping: float = 0.0,
                 compile_backend: str | None = None) -> dict[str, Any]:
    """Train ``num_steps`` steps of the GPT ``cfg`` on ``stages`` stages (the rest of WORLD as replicas); the
    loss, first step's gradients and final parameters. ``compile_backend``: ``engine.compile(backend=...)``
    before the first step, as a DeepSpeed user compiles."""
    if _FINISHED["armed"]:
        release_process_groups(_FINISHED["groups"])
    before = set(_process_groups())
    if stock_dualpipev:  # DeepSpeed's own DualPipeV: deepspeed.initialize picks its engine from the module class
        from deepspeed.runtime.pipe.dualpipev import DualPipeVModule
        model = DualPipeVModule(gpt_layer_specs(cfg), num_stages=stages, loss_fn=causal_lm_loss,
                                partition_method="uniform")
    else:
        chunks = {} if virtual_stages == 1 else {"virtual_stages": virtual_stages, "schedule": terapipe["schedule"]}
        model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=stages, loss_fn=causal_lm_loss,
                                                vocab_size=cfg.vocab_size, partition_method="uniform",
                                                activation_checkpoint_interval=checkpoint_interval, **chunks)
    dp = WORLD // stages
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro_batches,
              "train_batch_size": batch * micro_batches * dp, "steps_per_print": 10**9,
              "gradient_clipping": clipping,  # DeepSpeed clips at 1.0 by default; the reference only where asked
              "zero_optimization": {"stage": zero_stage}}
    if terapipe is not None:
        config["terapipe"] = dict(terapipe, enabled=True, seq_len=seq_len)
        if virtual_stages != 1:
            config["terapipe"]["virtual_stages"] = virtual_stages
    if zero_stage:
        config["zero_allow_untested_optimizer"] = True  # a client torch SGD, to match the reference exactly
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    init = ds_terapipe.initialize if terapipe is not None else deepspeed.initialize
    engine, _, _, _ = init(model=model, optimizer=opt, config=config)
    if compile_backend is not None:
        engine.compile(backend=compile_backend)
    ENGINE_REF["engine"] = engine
    data = iter(batches_for_rank(engine.grid.data_parallel_id))
    with first_step_grads(engine) as grads:
        losses, norms = train_steps(engine, data, num_steps)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    result = {"stage": engine.stage_id, "losses": losses, "norms": norms, "grads": grads, "params": params,
              "engine": engine, "slices": list(getattr(engine, "slices", [seq_len]))}
    ENGINE_REF.pop("engine", None)
    _FINISHED["groups"].extend(pg for pg in _process_groups() if pg not in before)
    _FINISHED["armed"] = True
    return result


def pipeline_engine(cfg: GPTConfig, layers: list, terapipe: dict, *, micro: int = 2, batch: int = 2,
                    extra_config: dict | None = None, loss_fn: Callable = causal_lm_loss, sampler: bool = True):
    """An engine of ``layers`` on WORLD stages (one replica), SGD at lr 0.1, no clipping; ``sampler=False``: a
    module that cannot sample an input (no vocab_size)."""
    model = ds_terapipe.TokenPipelineModule(layers, num_stages=WORLD, loss_fn=loss_fn,
                                            vocab_size=cfg.vocab_size if sampler else None,
                                            partition_method="uniform")
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro,
              "train_batch_size": batch * micro, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "terapipe": dict(terapipe, enabled=True), **(extra_config or {})}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def gathered_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter of the model, by reference name, gathered from all ranks (collective)."""
    mine = {reference_param_name(n): p.detach().clone() for n, p in engine.module.named_parameters()
            if not (n == "tied_modules.embed.wpe.weight" and 0 not in getattr(engine, "local_chunks", [0]))}
    parts: list = [None] * WORLD
    torch.distributed.all_gather_object(parts, mine)
    return {k: v for part in parts for k, v in part.items()}


# What the suites read from an engine beyond its public methods: kept here, in one place, so a
# refactor of the engine's private state updates these three functions and nothing else.
def engine_plan(engine: Any) -> dict[str, Any]:
    """The plan an engine runs: where it came from, its slices and the planner's result (None for config)."""
    summary = engine.plan_summary()
    return {"source": engine.plan_source, "slices": summary["slices"], "planner": summary.get("planner")}


def engine_planner_costs(engine: Any) -> Optional[dict]:
    """The measured cost model the plan was solved from (global rank 0 holds it), as a cost-file dict."""
    return engine.plan.cost


def engine_train_actions(engine: Any) -> list[str]:
    """This stage's compute actions of one training batch, in order (``0F1.2``, ``0B1.2``, ``0W1.2``)."""
    return [str(a) for a in engine._train_schedule().actions if a.is_compute]


def master_weights(engine: Any) -> dict[str, torch.Tensor]:
    """The optimizer's fp32 copy of every parameter (bf16 weights cannot show updates below their rounding).
    DeepSpeed's helper for it does not know FP16_UnfusedOptimizer, which keeps the copies in lists parallel to the
    fp16 parameters; with a torch optimizer (fp32) the weights are their own master copy."""
    from deepspeed.utils import safe_get_full_fp32_param

    if isinstance(engine.optimizer, torch.optim.Optimizer):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    groups = getattr(engine.optimizer, "fp32_groups", None)
    if type(engine.optimizer).__name__ == "FP16_UnfusedOptimizer" and groups is not None:
        fp32 = {id(p16): p32 for g16, g32 in zip(engine.optimizer.fp16_groups, groups) for p16, p32 in zip(g16, g32)}
        return {n: fp32[id(p)].detach().clone() for n, p in engine.module.named_parameters()}
    return {n: safe_get_full_fp32_param(p).detach().clone() for n, p in engine.module.named_parameters()}


def whole_tensors(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Whole fp32 copies of a rank's tensors, sharded ones (``shard_params``' DTensors) gathered: collective over
    the replicas of each sharded tensor, so every rank calls it with its names in one order."""
    return {n: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().float().clone()
            for n, v in named.items()}


def deltas(after: dict[str, torch.Tensor], before: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {n: after[n].float() - before[n].float() for n in after}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / max(float(b.norm()), 1e-12))


def compare(named: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
            stage: int) -> tuple[float, str, list[str]]:
    """The worst relative error of this rank's ``named`` tensors (pipeline names) against ``ref`` (reference
    names), its name, and the reference names compared here.

    Collective (every rank calls it at the same point): the names compared on all ranks together must be every
    name of ``ref``. ``named`` holds only what the engine produced (a gradient snapshot skips a parameter whose
    ``.grad`` is None), so an error taken over it alone passes a parameter that never got a gradient. The one name
    left out on purpose is the tied head's copy of the position embedding (only wte is tied): stage 0 covers it."""
    worst, worst_name, covered = 0.0, "", []
    for name, value in named.items():
        if name == "tied_modules.embed.wpe.weight" and stage != 0:
            continue  # the tied head's copy of the position embedding is unused (only wte is tied)
        ref_name = reference_param_name(name)
        if ref_name not in ref:
            raise KeyError(f"pipeline parameter {name} -> {ref_name} has no reference counterpart")
        err = rel_err(value, ref[ref_name])
        covered.append(ref_name)
        if err >= worst:
            worst, worst_name = err, name
    parts: list = [None] * WORLD
    torch.distributed.all_gather_object(parts, covered)
    missing = sorted(set(ref) - {n for part in parts for n in part})
    if missing:
        raise AssertionError(f"{STATUS['case']}: {len(missing)} of the reference's {len(ref)} tensors were compared on "
                             f"no rank (no gradient reached them?): {missing}")
    return worst, worst_name, covered


# Gradient clipping by the global norm (runtime/execution/clip.py): a threshold small enough that every step of
# every clipping case clips (tests/clipping.py checks that the reference's norms exceed it several times over):
# a clipping coefficient from any other norm changes the step.
CLIP = 0.15


def clip_result(case: str, engine: Any, losses: list[float], norms: list[Optional[float]],
                reference: tuple[list[float], list[float]], param_err: tuple[float, str]) -> dict[str, Any]:
    """A clipping case as tests/clipping.py reads it: losses and reported norms against the reference's
    (``reference``: its losses and ``clip_grad_norm_`` norms), and the worst parameter after the steps."""
    return {"case": case, "stage": engine.stage_id, "max_norm": engine.gradient_clipping(), "losses": losses,
            "ref_losses": reference[0], "norms": norms, "ref_norms": reference[1], "param_rel_err": param_err[0],
            "param_worst": param_err[1]}


def build_spec_layers(specs: list) -> tuple[list[Callable], dict[str, torch.nn.Parameter], list[torch.nn.Module]]:
    """Build layer specs once each (a TiedLayerSpec key once), as one process would run them: the callables in
    order, every parameter under the pipeline module's name, and each spec's module."""
    tied: dict[str, torch.nn.Module] = {}
    steps, named, modules = [], {}, []
    for idx, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            prefix = f"tied_modules.{spec.key}"
            steps.append((lambda x, m=module, f=spec.forward_fn: f(m, x)) if spec.forward_fn else module)
        else:
            module, prefix = spec.build(), str(idx)
            steps.append(module)
        for name, param in module.named_parameters():
            named.setdefault(f"{prefix}.{name}", param)
        modules.append(module)
    return steps, named, modules


def frozen_reference(specs: list, batches: list[tuple], num_steps: int, frozen_at: Callable[[int], int],
                     lr: float = 0.1, momentum: float = 0.9, max_norm: float = 0.0,
                     weight_decay: float = 0.0, evals: Optional[list[tuple]] = None, *,
                     optimizer: Optional[Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]] = None,
                     skipped: Sequence[int] = (), on_grads: Optional[Callable[[int, dict], None]] = None
                     ) -> dict[str, Any]:
    """Single-process, unsliced training of the layer specs with the first ``frozen_at(step)`` layers frozen at
    each step: run under no_grad, their parameters out of training (a tied weight also used by a later layer
    keeps training through that use). With ``max_norm`` > 0 the gradients are clipped by torch's
    ``clip_grad_norm_`` over the trained parameters before each step (the gradients recorded are the unclipped
    ones, as the pipeline's snapshot before its step); ``weight_decay``: SGD's, on the trained parameters. Losses,
    every step's gradients and the final parameters, under the pipeline module's parameter names. A micro-batch's
    inputs may be ``(input_ids, position_ids)`` (packed documents: run under ``packed_documents``); ``evals``:
    micro-batches evaluated after the last step, their mean loss as ``"eval"``.

    ``optimizer``: builds the optimizer from the parameters instead of SGD (``lr``, ``momentum`` and
    ``weight_decay`` then unused). ``skipped``: the steps (batch indices) DeepSpeed skips (an fp16 overflow): no
    optimizer step, loss None, no gradients; ``frozen_at`` is called with the optimizer steps taken before the
    batch, as the engine counts them. ``on_grads(steps_taken, grads)``: every step taken's unclipped gradients
    (under the pipeline module's names), before its optimizer step."""
    steps, named, modules = build_spec_layers(specs)
    layer_params = list(zip(specs, modules))
    params = list({id(p): p for p in named.values()}.values())
    opt = optimizer(params) if optimizer is not None else torch.optim.SGD(params, lr=lr, momentum=momentum,
                                                                            weight_decay=weight_decay)
    per_step = len(batches) // num_steps
    losses: list[Optional[float]] = []
    grads: list[dict[str, torch.Tensor]] = []
    for step in range(num_steps):
        if step in skipped:
            losses.append(None)
            grads.append({})
            continue
        taken = step - sum(1 for s in skipped if s < step)
        k = frozen_at(taken)
        for idx in range(k):
            spec, module = layer_params[idx]
            keep: set[int] = set()
            if isinstance(spec, TiedLayerSpec) and any(isinstance(s, TiedLayerSpec) and s.key == spec.key
                                                       for s in specs[k:]):
                attrs = [spec.tied_weight_attr] if isinstance(spec.tied_weight_attr, str) else spec.tied_weight_attr
                keep = {id(module.get_parameter(a)) for a in attrs}
            for p in module.parameters():
                if id(p) not in keep:
                    p.requires_grad_(False)
                    opt.state.pop(p, None)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in batches[step * per_step:(step + 1) * per_step]:
            loss = _spec_loss(steps, x, y, k) / per_step
            loss.backward()
            total += float(loss)
        losses.append(total)
        grads.append({n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None})
        if on_grads is not None:
            on_grads(taken, grads[-1])
        if max_norm > 0:
            torch.nn.utils.clip_grad_norm_([p for p in {id(p): p for p in named.values()}.values()
                                            if p.grad is not None], max_norm)
        opt.step()
    out = {"losses": losses, "grads": grads, "params": {n: p.detach().clone() for n, p in named.items()}}
    if evals:
        with torch.no_grad():
            out["eval"] = float(sum(_spec_loss(steps, x, y, 0) for x, y in evals) / len(evals))
    return out


def _spec_loss(steps: list[Callable], inputs: Any, labels: torch.Tensor, num_frozen: int) -> torch.Tensor:
    """One micro-batch's loss through the built layers, the first ``num_frozen`` of them under no_grad; inputs
    ``(input_ids, position_ids)`` run under their packed documents."""
    from ds_terapipe.runtime.slicing.documents import packed_documents

    x, positions = inputs if isinstance(inputs, tuple) else (inputs, None)
    with packed_documents(positions):
        for idx, f in enumerate(steps):
            if idx < num_frozen:
                with torch.no_grad():
                    x = f(x)
            else:
                x = f(x)
    return causal_lm_loss(x, labels)


def named_compare(named: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], stage_has_embed: bool
                  ) -> tuple[float, str, int]:
    """The worst relative error of this rank's ``named`` tensors against ``ref`` under the same (pipeline module)
    names, its name, and how many were compared."""
    worst, worst_name, count = 0.0, "", 0
    for name, value in named.items():
        if name == "tied_modules.embed.wpe.weight" and not stage_has_embed:
            continue  # the head's copy of the position embedding is unused
        if name not in ref:
            raise KeyError(f"{name} has no reference gradient/parameter (reference has {sorted(ref)})")
        err = rel_err(value, ref[name])
        count += 1
        if err >= worst:
            worst, worst_name = err, name
    return worst, worst_name, count


def allow_fp16_on_cpu() -> None:
    """Let DeepSpeed build its fp16 optimizers on a CPU whose oneDNN lacks fp16 kernels (this process only):
    torch computes fp16 on any CPU, slowly; the precision tests check where gradients go and in which scale."""
    from deepspeed.accelerator import get_accelerator

    if not get_accelerator().is_fp16_supported():
        get_accelerator().is_fp16_supported = lambda: True


def run_cases(cases: list, label: Callable[..., str], run: Callable[..., dict]) -> list[dict]:
    """``run(*case)`` for each case of a suite, named ``label(*case)``: a case that raises is reported with its
    traceback and the suite goes on (every rank runs the same cases, so they fail alike). Each result gets the
    case's wall time, ``case_s``. The process groups a case made are released after it
    (:func:`release_process_groups`)."""
    results: list[dict] = []
    for case in cases:
        STATUS["case"] = label(*case)
        before = set(_process_groups())
        keep_collections_cheap()
        started = time.perf_counter()
        try:
            results.append(run(*case))
        except Exception as err:  # noqa: BLE001 - reported per case; the test reads it
            results.append({"case": STATUS["case"], "error": f"{type(err).__name__}: {err}",
                            "traceback": traceback.format_exc()})
        if isinstance(results[-1], dict):   # where the suite's time goes (rank{R}.json), for keeping it short
            results[-1].setdefault("case_s", round(time.perf_counter() - started, 2))
        ENGINE_REF.pop("engine", None)
        release_process_groups([pg for pg in _process_groups() if pg not in before])
    return results


# the process groups of the engines run_pipeline ran to the end, released when the next one starts; "armed" is
# not "groups is non-empty": a rank outside every group an engine made has none, and every rank must still take part
# in the release's barrier
_FINISHED: dict[str, Any] = {"groups": [], "armed": False}


def _process_groups() -> list:
    return list(torch.distributed.distributed_c10d._world.pg_map)


def release_process_groups(groups: list) -> None:
    """Destroy ``groups`` (made by engines this rank is done with) once every rank is done with them. Why: every
    gloo group keeps a thread that wakes every 10 ms for as long as the process lives, and each engine's grid makes
    its own groups: left alive, a suite of 40 engines keeps ~100 such threads per rank, and waking them takes a
    quarter of the CPU. Every rank calls this at the same point of the same cases; the barrier keeps a rank from
    closing connections a peer still reads from. Engines with ``shard_params`` too: see
    :func:`_forget_dtensor_plans`."""
    _FINISHED.update(groups=[], armed=False)
    torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=120))
    live = set(_process_groups())
    # (a group run_pipeline left may be released by the case around it already)
    released = [pg for pg in groups if pg in live]
    if released:
        _forget_dtensor_plans()
    for pg in released:
        deepspeed.comm.destroy_process_group(pg)   # torch's, and DeepSpeed forgets any it cached


def _forget_dtensor_plans() -> None:
    """Empty torch's caches of DTensor sharding and redistribution plans (Python and C++). Why: they are keyed by
    ``DeviceMesh`` value, and a mesh compares equal for the same ranks whatever its process group, so a later
    engine's FSDP2 gathers would take a plan holding a released group ("Could not resolve the process group
    registered under the name 4"), or, with the groups kept, silently run on an earlier engine's group."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._redistribute import _gen_transform_infos
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _gen_transform_infos.cache_clear()
    torch._C._clear_DTensor_sharding_propagator_cache()


def keep_collections_cheap() -> None:
    """Collect what the cases before left, then move every live object to the collector's permanent generation
    (``gc.freeze``). Why: DeepSpeed's bf16 optimizer calls ``gc.collect()`` four times per engine it builds
    (``see_memory_usage(force=True)``), each a walk over every object of torch, DeepSpeed and transformers, 0.2-0.3 s
    on 2 cores: a fifth of a bf16 suite's time, other ranks waiting for rank 0. Frozen, a collection walks only
    what was made since. Nothing that is garbage now is frozen; what a case makes is still collected."""
    gc.collect()
    gc.freeze()


def run_until_error(run: Callable[[], Any], p2p_timeout_s: Optional[float] = None) -> dict[str, Any]:
    """``run()`` started on every rank at once: what it raised (with notes), after how many seconds, and when
    (``raised_at``: ``time.monotonic()``, one clock for every process of this host, so a peer's stop is timed
    from the moment the failing rank raised, not from a start that includes DeepSpeed's init or profiling)."""
    torch.distributed.barrier()
    started = time.perf_counter()
    try:
        run()
        return {"case": STATUS["case"], "raised": None}
    except Exception as err:  # noqa: BLE001 - the test checks the type name
        raised_at = time.monotonic()
        notes = " ".join(getattr(err, "__notes__", []))
        return {"case": STATUS["case"], "raised": type(err).__name__, "message": f"{err} {notes}",
                "seconds": time.perf_counter() - started, "raised_at": raised_at, "p2p_timeout_s": p2p_timeout_s}


def linger_until_peers_stop(result: dict[str, Any], shared: Path, timeout_s: float) -> dict[str, Any]:
    """After :func:`run_until_error` on every rank: each rank notes in ``shared`` (a directory every rank sees)
    that it stopped, then lives on, as a caller that catches would, until every rank has stopped or ``timeout_s``
    passed, so no rank's exit closes another's connections: a rank stopped by a peer's failure must have stopped
    on its own. ``left_at`` (``time.monotonic()``) is when it leaves. Why not a fixed time: on a loaded machine a
    fixed few seconds would measure the machine."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    shared.mkdir(parents=True, exist_ok=True)
    (shared / f"stopped_{rank}").write_text("stopped")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and sum((shared / f"stopped_{r}").exists() for r in range(world)) < world:
        time.sleep(0.05)
    return dict(result, left_at=time.monotonic())


# -- steps whose gradients overflow: a loss times 1e30, inf or nan on one micro-batch ---------------------------------
#: what a poisoned micro-batch's loss is multiplied by: "huge" (finite, its fp16 gradients are not), "inf", "nan"
POISON_FACTORS = {"huge": 1e30, "inf": float("inf"), "nan": float("nan")}
#: the poison of the step being run, read by poisoned_loss (and a suite's own gradient hooks: "grad")
POISON: dict[str, Any] = {"loss": 1.0, "grad": None}


def poisoned_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``causal_lm_loss`` times ``POISON["loss"]`` on a micro-batch whose row 0 has only -100 labels (the mark:
    every slice of that micro-batch carries it)."""
    loss = causal_lm_loss(logits, labels)
    return loss * POISON["loss"] if bool((labels[0] == -100).all()) else loss


def poison(group: list[tuple], kind: str) -> list[tuple]:
    """``group`` (a step's micro-batches) with micro-batch 1 marked and ``POISON["loss"]`` set for ``kind`` (a key
    of POISON_FACTORS); reset ``POISON`` after the step."""
    group = list(group)
    ids, labels = group[1]
    labels = labels.clone()
    labels[0] = -100
    group[1] = (ids, labels)
    POISON["loss"] = POISON_FACTORS[kind]
    return group


def loss_scale(engine: Any) -> float:
    """The fp16 loss scale the next step uses (1 without one); each DeepSpeed optimizer keeps it elsewhere."""
    optimizer = engine.optimizer
    for owner in (optimizer, getattr(optimizer, "loss_scale_config", None), getattr(optimizer, "loss_scaler", None)):
        if getattr(owner, "cur_scale", None) is not None:
            return float(owner.cur_scale)
    return 1.0

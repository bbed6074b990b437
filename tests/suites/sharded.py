"""Suite ``sharded``, asserted on by tests/test_shard_params.py: sharded data parallelism per chunk
(terapipe.shard_params), 2 stages x 2 replicas, against the single-process unsliced reference: loss, every
first-step gradient and the parameters after 3 SGD + momentum steps (fp32), or the fp32 master weights' change
(bf16), for ``looped-bfs``, ``interleaved-1f1b`` and ``1f1b``; the gathers and reduce-scatters each step executed
against the lowered schedule's count; the model states per rank against the replicated figure; a checkpoint saved
sharded and resumed at the same layout, by a run without sharding (optimizer state included) and back, and across
optimizer formats with a ZeRO-1 run (refused with the optimizer state, weights and step count without it). With
``extra["resume"]`` (a checkpoint directory), on 2 ranks: the checkpoint written by 2 replicas resumed by one, its
last step against the reference's. ``extra["fault"]``, last: a replica failing mid-step stops its peers in seconds.
"""

from __future__ import annotations

import gc
import os
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

import ds_terapipe
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from ds_terapipe.planner.sharding import shard_counts
from tests.suites import suite
from tests.suites.common import (CLIP, ENGINE_REF, STATUS, WORLD, compare, deltas, first_step_grads,
                                 linger_until_peers_stop, make_batches, reference_step, run_cases, run_until_error,
                                 train_steps)
from tests.suites.common import whole_tensors as _whole

STAGES = 2
SEQ_LEN, BATCH, STEPS, LR, MOMENTUM = 48, 2, 3, 0.1, 0.9
CFG = GPTConfig(num_layers=4, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=5)


def _engine(schedule: str, v: int, m: int, *, precision: str = "fp32", clipping: float = 0.0,
            slices: Any = (8, 24, 16), shard: bool = True, prefetch: bool = True, zero_stage: int = 0,
            extra_terapipe: Optional[dict] = None, sampler: bool = True, extra_config: Optional[dict] = None) -> Any:
    dp = WORLD // STAGES
    chunks = {} if v == 1 else {"virtual_stages": v, "schedule": schedule}
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(CFG), num_stages=STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=CFG.vocab_size if sampler else None,
                                            partition_method="uniform", **chunks)
    terapipe = {"enabled": True, "seq_len": SEQ_LEN, "slices": slices if isinstance(slices, str) else list(slices),
                "schedule": schedule,
                "granularity": 2, "p2p_timeout_s": 60, "shard_params": shard, "shard_prefetch": prefetch,
                **(extra_terapipe or {})}
    if v != 1:
        terapipe["virtual_stages"] = v
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": m,
              "train_batch_size": BATCH * m * dp, "steps_per_print": 10**9, "gradient_clipping": clipping,
              "zero_optimization": {"stage": zero_stage}, "terapipe": terapipe, **(extra_config or {})}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if zero_stage:
        config["zero_allow_untested_optimizer"] = True
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def _batches(m: int, dp: int, seed: int) -> tuple[list[tuple], Any]:
    batches = make_batches(CFG, STEPS * m * dp, BATCH, SEQ_LEN, seed=seed)

    def for_rank(dp_id: int) -> list[tuple]:
        return [batches[s * m * dp + dp_id * m + j] for s in range(STEPS) for j in range(m)]

    return batches, for_rank


def _equivalence(schedule: str, v: int, m: int, precision: str, clipping: bool = False, prefetch: bool = True,
                 sampler: bool = True, release: str = "run", extra: Optional[dict] = None) -> dict:
    """One schedule sharded against the reference: fp32 every gradient and parameter, bf16 the master weights'
    change (the fp32 shards); ``eval_batch`` on the first step's batch before training. ``sampler=False``: a
    module that cannot sample an input (the slice check runs on the first batch, the layers gathered whole);
    ``release="step"``: chunks kept whole from their first run to their last of the step; ``extra``: more keys of
    the ``"terapipe"`` section (``slices: "auto"`` profiles the whole layers at init; ``replan`` refits from the
    sharded steps)."""
    dp = WORLD // STAGES
    batches, for_rank = _batches(m, dp, seed=300 + m)
    max_norm = CLIP if clipping else 0.0
    ref_norms: list[float] = []
    ref_losses, ref_grads, ref_params = reference_step(CFG, batches, STEPS, lr=LR, momentum=MOMENTUM,
                                                       max_norm=max_norm, norms=ref_norms)
    engine = _engine(schedule, v, m, precision=precision, clipping=max_norm, prefetch=prefetch, sampler=sampler,
                     extra_terapipe={"shard_release": release, **(extra or {})})
    before = _whole(dict(engine.module.named_parameters()))
    mine = for_rank(engine.grid.data_parallel_id)
    eval_loss = float(engine.eval_batch(iter(mine[:m])))
    data = iter(mine)
    with first_step_grads(engine) as grads:
        losses, norms = train_steps(engine, data, STEPS)
    grads = _whole(grads)
    params = _whole(dict(engine.module.named_parameters()))
    counts = shard_counts(engine.lowered_schedule(engine.num_slices))[engine.stage_id]
    out = {"case": STATUS["case"], "stage": engine.stage_id, "losses": losses, "ref_losses": ref_losses,
           "eval_loss": eval_loss,
           "norms": norms, "ref_norms": ref_norms, "gathers": engine.sharded.gathers,
           "reduce_scatters": engine.sharded.reduce_scatters, "planned": list(counts),
           "sharded": sum(hasattr(p, "full_tensor") for p in engine.module.parameters()),
           "slices": list(engine.slices), "plan_source": engine.plan_source,
           "replanned": engine.replanner is not None and engine.replanner.done}
    if precision == "fp32":
        out["grad_rel_err"], out["grad_worst"], out["covered"] = compare(grads, ref_grads, engine.stage_id)
        out["param_rel_err"], out["param_worst"], _ = compare(params, ref_params, engine.stage_id)
    else:
        ref_before = _reference_params()
        err, worst, covered = compare(deltas(params, before), deltas(ref_params, ref_before), engine.stage_id)
        out.update(update_rel_err=err, update_worst=worst, covered=covered)
    ENGINE_REF.pop("engine", None)
    return out


def _reference_params() -> dict[str, torch.Tensor]:
    from ds_terapipe.models.gpt import GPTReference

    return {n: p.detach().clone() for n, p in GPTReference(CFG).named_parameters()}


def _gathers(schedule: str, v: int) -> dict:
    """Gathers and reduce-scatters executed per step at m in {2, 4, 8} against the lowered schedule's count."""
    executed, planned = [], []
    for m in (2, 4, 8):
        STATUS["case"] = f"gathers {schedule} m={m}"
        engine = _engine(schedule, v, m, slices=(16, 32))
        _, for_rank = _batches(m, WORLD // STAGES, seed=7)
        engine.train_batch(iter(for_rank(engine.grid.data_parallel_id)))
        executed.append([engine.sharded.gathers, engine.sharded.reduce_scatters])
        planned.append(list(shard_counts(engine.lowered_schedule(engine.num_slices))[engine.stage_id]))
        ENGINE_REF.pop("engine", None)
    return {"case": f"gathers {schedule}", "executed": executed, "planned": planned}


def _memory() -> dict:
    """Model states per rank at the optimizer step of step 2 of looped-bfs with Adam (gradients and the first step's
    optimizer state present): sharded, with and without prefetch, against the same run replicated (ZeRO 0)."""
    out: dict[str, Any] = {"case": "memory looped-bfs"}
    for label, shard, prefetch in (("replicated", False, True), ("sharded", True, True),
                                   ("sharded_no_prefetch", True, False)):
        STATUS["case"] = f"memory {label}"
        engine = _engine("looped-bfs", 2, 4, shard=shard, prefetch=prefetch)
        engine.optimizer = _adam_like(engine)
        seen: dict[str, float] = {}
        original = engine._take_model_step

        def measure_then_step(*args, engine=engine, seen=seen, original=original, **kwargs):
            seen.clear()
            seen.update(engine.sharded.memory() if engine.sharded is not None else _replicated_memory(engine))
            return original(*args, **kwargs)

        engine._take_model_step = measure_then_step
        _, for_rank = _batches(4, WORLD // STAGES, seed=9)
        data = iter(for_rank(engine.grid.data_parallel_id))
        for _ in range(2):
            engine.train_batch(data)
        out[label] = dict(seen)
        ENGINE_REF.pop("engine", None)
    return out


def _replicated_memory(engine: Any) -> dict[str, float]:
    params = list(engine.module.parameters())
    return {"params": float(sum(p.numel() * p.element_size() for p in params)),
            "grads": float(sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None)),
            "optimizer": float(sum(t.numel() * t.element_size() for st in engine.optimizer.state.values()
                                   for t in st.values() if torch.is_tensor(t) and t.dim() > 0))}


def _adam_like(engine: Any) -> torch.optim.Optimizer:
    """The engine's optimizer replaced by Adam over the same (possibly sharded) parameters: two states per
    parameter, as a real run holds."""
    params = [p for g in engine.optimizer.param_groups for p in g["params"]]
    adam = torch.optim.Adam(params, lr=1e-3)
    if engine.sharded is not None:
        engine.sharded.engine.optimizer = adam
        engine.sharded.wrap_optimizer_state()
    return adam


def _checkpoint(tmp: str, parallel_write: bool = False) -> dict:
    """Save after 2 steps (sharded, 2 replicas), load into a fresh engine, run step 3: the same loss and
    parameters as the run that went on; the checkpoint is kept for the resume at one replica. ``parallel_write``:
    each replica writes a share of the layers (DeepSpeed's ``checkpoint.parallel_write.pipeline_stage``), in a
    directory of its own."""
    STATUS["case"] = "checkpoint looped-bfs" + (" parallel write" if parallel_write else "")
    if parallel_write:
        tmp = os.path.join(tmp, "parallel")
    writing = {"checkpoint": {"parallel_write": {"pipeline_stage": True}}} if parallel_write else None
    m = 2
    _, for_rank = _batches(m, WORLD // STAGES, seed=11)
    engine = _engine("looped-bfs", 2, m, extra_config=writing)
    engine.optimizer = _adam_like(engine)
    data = iter(for_rank(engine.grid.data_parallel_id))
    for _ in range(2):
        engine.train_batch(data)
    with _whole_bytes_held() as held:
        engine.save_checkpoint(tmp, tag="two")
    went_on = float(engine.train_batch(data))
    expected = _whole(dict(engine.module.named_parameters()))
    ENGINE_REF.pop("engine", None)
    fresh = _engine("looped-bfs", 2, m, extra_config=writing)
    fresh.optimizer = _adam_like(fresh)
    fresh.load_checkpoint(tmp, tag="two")
    data = iter(for_rank(fresh.grid.data_parallel_id)[2 * m:])
    resumed = float(fresh.train_batch(data))
    got = _whole(dict(fresh.module.named_parameters()))
    worst = max(float((got[n] - expected[n]).abs().max()) for n in expected)
    ENGINE_REF.pop("engine", None)
    layers = engine.sharded._saved_layers()
    return {"case": STATUS["case"], "went_on": went_on, "resumed": resumed, "param_max_abs": worst,
            "expected": {n: t.tolist() for n, t in expected.items()} if engine.grid.data_parallel_id == 0 else None,
            "writes": bool(engine.save_non_zero_checkpoint), "save_held": held,
            "layer_bytes": sorted(sum(p.numel() * 4 for p in layer.parameters()) for layer in layers)}


@contextmanager
def _whole_bytes_held() -> Iterator[dict]:
    """Inside the block, the bytes of whole tensors the sharded save gathered that are alive at once: ``peak`` while
    the layers are saved (DeepSpeed's module save), ``peak_optimizer`` while the optimizer's state dict is built,
    ``left`` still held when the block ends (freed by then: the save returned)."""
    from ds_terapipe.runtime.features import sharding

    held = {"now": 0, "peak": 0, "peak_optimizer": 0}
    original, phase = sharding._whole, {"key": "peak"}

    def tracked(value: Any) -> Any:
        out = original(value)
        if out is not value:
            size = out.numel() * out.element_size()
            held["now"] += size
            held[phase["key"]] = max(held[phase["key"]], held["now"])
            weakref.finalize(out, lambda: held.__setitem__("now", held["now"] - size))
        return out

    module_state_dict = ENGINE_REF["engine"].module_state_dict

    def after_the_layers(*args: Any, **kwargs: Any) -> Any:
        out = module_state_dict(*args, **kwargs)
        phase["key"] = "peak_optimizer"
        return out

    sharding._whole, ENGINE_REF["engine"].module_state_dict = tracked, after_the_layers
    try:
        yield held
    finally:
        sharding._whole = original
        del ENGINE_REF["engine"].module_state_dict
        gc.collect()
        held["left"] = held["now"]   # "now" stays: a whole tensor freed later (a traceback's) still counts down


def _resume_one_replica(tmp: str, m_saved: int = 2) -> dict:
    """The checkpoint of 2 replicas resumed by 1 (twice the micro-batches, the same global batch): step 3's loss
    and the parameters after it."""
    STATUS["case"] = "resume at one replica"
    m = 2 * m_saved
    batches = make_batches(CFG, STEPS * m_saved * 2, BATCH, SEQ_LEN, seed=11)
    engine = _engine("looped-bfs", 2, m)
    engine.optimizer = _adam_like(engine)
    engine.load_checkpoint(tmp, tag="two")
    step3 = batches[2 * m:3 * m]
    loss = float(engine.train_batch(iter(step3)))
    params = _whole(dict(engine.module.named_parameters()))
    ENGINE_REF.pop("engine", None)
    return {"case": STATUS["case"], "loss": loss, "stage": engine.stage_id,
            "params": {n: t.tolist() for n, t in params.items()}}


def _zero_at_another_size(tmp: str) -> dict:
    """The ZeRO-1 checkpoint of 2 replicas ("zero1", from ``_across_formats``) loaded by one: its optimizer state is
    refused before anything is loaded (DeepSpeed cannot partition it anew), the weights and step count load
    without it."""
    STATUS["case"] = "zero at another data-parallel size"
    zero = _engine("looped-bfs", 2, 4, shard=False, zero_stage=1)
    before = {n: p.detach().clone() for n, p in zero.module.named_parameters()}
    refusal = _refused(zero, tmp, "zero1")
    untouched = all(torch.equal(before[n], p) for n, p in zero.module.named_parameters())
    zero.load_checkpoint(tmp, tag="zero1", load_optimizer_states=False)
    out = {"case": STATUS["case"], "refusal": refusal, "untouched": untouched, "steps": zero.global_steps}
    ENGINE_REF.pop("engine", None)
    return out


def _refused(engine: Any, tmp: str, tag: str) -> str:
    """The message of the load ``engine`` refuses (asking for the optimizer state of another format)."""
    try:
        engine.load_checkpoint(tmp, tag=tag)
    except ds_terapipe.CheckpointError as err:
        return str(err)
    return "not refused"


def _across_formats(tmp: str) -> dict:
    """The sharded checkpoint ("two", from ``_checkpoint``) and a ZeRO-1 run of the same layout, each loaded by the
    other: the optimizer formats differ, so a load that asks for the optimizer state is refused on every rank before
    anything is read, and the same engine then loads with ``load_optimizer_states=False``: the weights and the step
    count exactly, the optimizer fresh, and it trains on."""
    STATUS["case"] = "checkpoint across optimizer formats"
    m = 2
    _, for_rank = _batches(m, WORLD // STAGES, seed=11)
    out: dict[str, Any] = {"case": STATUS["case"]}
    sharded = _engine("looped-bfs", 2, m)
    sharded.optimizer = _adam_like(sharded)
    sharded.load_checkpoint(tmp, tag="two")          # the same format: the reference for the weights
    want = _whole(dict(sharded.module.named_parameters()))
    ENGINE_REF.pop("engine", None)
    zero = _engine("looped-bfs", 2, m, shard=False, zero_stage=1)
    out["zero_refusal"] = _refused(zero, tmp, "two")
    # a verdict every rank reaches together raises no abort flag: the engine stays usable
    out["flag_after_refusal"] = zero.p2p.abort.get() if zero.p2p.abort is not None else "no flag"
    zero.load_checkpoint(tmp, tag="two", load_optimizer_states=False)
    got = _whole(dict(zero.module.named_parameters()))
    out["zero_from_sharded"] = max(float((got[n] - want[n]).abs().max()) for n in want)
    out["zero_steps"] = zero.global_steps
    out["zero_fresh_state"] = not zero.optimizer.optimizer.state
    out["zero_loss"] = float(zero.train_batch(iter(for_rank(zero.grid.data_parallel_id)[2 * m:])))
    zero.save_checkpoint(tmp, tag="zero1")
    want = _whole(dict(zero.module.named_parameters()))
    ENGINE_REF.pop("engine", None)
    sharded = _engine("looped-bfs", 2, m)
    sharded.optimizer = _adam_like(sharded)
    out["sharded_refusal"] = _refused(sharded, tmp, "zero1")
    sharded.load_checkpoint(tmp, tag="zero1", load_optimizer_states=False)
    got = _whole(dict(sharded.module.named_parameters()))
    out["sharded_from_zero"] = max(float((got[n] - want[n]).abs().max()) for n in want)
    out["sharded_steps"] = sharded.global_steps
    out["sharded_fresh_state"] = not sharded.optimizer.state
    out["sharded_loss"] = float(sharded.train_batch(iter(for_rank(sharded.grid.data_parallel_id)[:m])))
    ENGINE_REF.pop("engine", None)
    return out


def _plain_and_sharded(tmp: str) -> dict:
    """The sharded checkpoint ("two", from ``_checkpoint``) resumed by a run without ``shard_params`` (fp32, ZeRO 0),
    and that run's own checkpoint of the same state resumed by a sharded one: both keep the torch optimizer's state
    as whole tensors, so each resumes with it: step 3's loss and parameters as a sharded run resumed from "two"
    (the reference)."""
    STATUS["case"] = "checkpoint between sharded and plain runs"
    m = 2
    _, for_rank = _batches(m, WORLD // STAGES, seed=11)
    out: dict[str, Any] = {"case": STATUS["case"]}
    runs = {}
    for name, shard, tag in (("reference", True, "two"), ("plain", False, "two"), ("sharded", True, "plain")):
        engine = _engine("looped-bfs", 2, m, shard=shard)
        engine.optimizer = _adam_like(engine)
        engine.load_checkpoint(tmp, tag=tag)
        if name == "plain":
            engine.save_checkpoint(tmp, tag="plain")   # the same state, as the run without sharding writes it
        steps = engine.global_steps
        loss = float(engine.train_batch(iter(for_rank(engine.grid.data_parallel_id)[2 * m:])))
        runs[name] = (loss, steps, _whole(dict(engine.module.named_parameters())))
        ENGINE_REF.pop("engine", None)
    ref_loss, _, ref = runs["reference"]
    for name in ("plain", "sharded"):
        loss, steps, params = runs[name]
        out[name] = {"loss": loss, "ref_loss": ref_loss, "steps": steps,
                     "param_rel_err": max(float((params[n] - ref[n]).norm() / ref[n].norm()) for n in ref)}
    return out


def _fault(shared: Path) -> dict:
    """After a healthy step, stage 0's second replica raises in its first block's forward (as an out-of-memory
    would): its peers are in the schedule's transfers and in its gathers and reduce-scatters, collectives without
    a deadline, and must stop within seconds (the collective watch), while every rank still lives. The last case
    of a launch: a fault leaves transfers half done."""
    from ds_terapipe.models.gpt import GPTBlock

    STATUS["case"] = "fault"
    timeout_s = 120
    engine = _engine("looped-bfs", 2, 2, slices=(16, 32), extra_terapipe={"p2p_timeout_s": timeout_s})
    _, for_rank = _batches(2, WORLD // STAGES, seed=11)
    mine = for_rank(engine.grid.data_parallel_id)
    engine.train_batch(iter(mine[:2]))
    origin = engine.stage_id == 0 and engine.grid.data_parallel_id == 1
    if origin:
        def raising(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("simulated out of memory in a sharded layer")

        block = next(f for f in engine.module.forward_funcs if isinstance(f, GPTBlock))
        block.forward = raising
    result = run_until_error(lambda: engine.train_batch(iter(mine[2:4])), timeout_s)
    return dict(linger_until_peers_stop(result, shared, timeout_s / 4), origin=origin,
                rank=torch.distributed.get_rank())


@suite("sharded")
def suite_sharded(extra: dict) -> list[dict]:
    if extra.get("resume"):
        return [_resume_one_replica(extra["resume"]), _zero_at_another_size(extra["resume"])]
    cases = [lambda c=c: _equivalence(*c) for c in extra.get("cases", [])]
    labels = [f"{c[3]} {c[0]} v={c[1]} m={c[2]}{' clip' if len(c) > 4 and c[4] else ''}"
              f"{' no-prefetch' if len(c) > 5 and not c[5] else ''}{' no-sampler' if len(c) > 6 and not c[6] else ''}"
              f"{' release=' + c[7] if len(c) > 7 else ''}{' ' + str(c[8]) if len(c) > 8 else ''}"
              for c in extra.get("cases", [])]
    results = run_cases(list(zip(labels, cases)), label=lambda name, fn: name, run=lambda name, fn: fn())
    if extra.get("gathers"):
        results.append(_gathers("looped-bfs", 2))
        results.append(_gathers("interleaved-1f1b", 2))
    if extra.get("memory"):
        results.append(_memory())
    if extra.get("checkpoint"):
        results.append(_checkpoint(extra["checkpoint"]))
        results.append(_checkpoint(extra["checkpoint"], parallel_write=True))
        checks = [("checkpoint across optimizer formats", _across_formats),
                  ("checkpoint between sharded and plain runs", _plain_and_sharded)]
        results += run_cases(checks, label=lambda name, fn: name, run=lambda name, fn: fn(extra["checkpoint"]))
    if extra.get("fault"):
        results.append(_fault(Path(extra["out"]) / "fault"))
    return results

"""Suite ``packed``, asserted on by tests/test_packed.py: rows that pack several documents of skewed lengths, given as
``((input_ids, position_ids), labels)`` with ``terapipe.packed``, on 2 stages (x the replicas the world size
leaves), against the single-process unsliced reference GPT run under ``packed_documents`` with the same position
ids: the losses of 3 SGD+momentum steps, every gradient of the first step and the parameters after the last.
``extra["refusals"]``: bad position ids on the first stage (no restart at 0, another length, a mask; packed rows
without ``terapipe.packed``), each raised on every rank before the step. Each step mixes packed rows, rows of one
document (position ids 0..L-1) and plain ``input_ids`` micro-batches (one document per row). Cases are
``extra["cases"]``: [schedule, virtual stages, slices(, mode)] with mode "fp32" (default), "bf16" (compares the fp32
master weights' change over the steps instead, bf16 weights hiding updates below their rounding), "per-batch"
(``slices: "auto"`` with ``terapipe.plan_per_batch``: each step planned for its documents) or "per-batch cuts"
(the same, with rank 0's planner replaced by a rule that cuts wherever a row of the step starts a document, so
every step runs another slicing whatever the profile measured).
"""

from __future__ import annotations

import random
from typing import Any, Optional

import torch

import ds_terapipe
from ds_terapipe.models.gpt import GPTConfig, GPTReference, causal_lm_loss, gpt_layer_specs
from ds_terapipe.runtime.slicing.documents import packed_documents
from tests.suites import suite
from tests.suites.common import (ENGINE_REF, STATUS, WORLD, compare, deltas, first_step_grads, make_batches,
                                 master_weights, replica_batches, run_cases, run_until_error)

STAGES, STEPS, MICRO, BATCH, SEQ_LEN = 2, 3, 3, 2, 48


def packed_positions(rng: random.Random, batch: int, seq_len: int) -> torch.Tensor:
    """(B, L) position ids: documents of skewed lengths (many short, a few long), cut at the row's end."""
    rows = []
    for _ in range(batch):
        row: list[int] = []
        while len(row) < seq_len:
            row += list(range(max(1, int(rng.paretovariate(1.2) * 4))))
        rows.append(row[:seq_len])
    return torch.tensor(rows)


def packed_batches(cfg: GPTConfig, num: int, seed: int) -> list[tuple]:
    """Micro-batches ``((ids, positions), labels)``, every third one of them plain ids (one document per row) and
    the one after it a single document per row given as position ids."""
    rng = random.Random(seed)
    out: list[tuple] = []
    for index, (ids, labels) in enumerate(make_batches(cfg, num, BATCH, SEQ_LEN, seed)):
        kind = index % 3
        if kind == 0:
            out.append(((ids, packed_positions(rng, BATCH, SEQ_LEN)), labels))
        elif kind == 1:
            out.append((ids, labels))
        else:
            out.append(((ids, torch.arange(SEQ_LEN).expand(BATCH, -1).clone()), labels))
    return out


def _split(inputs: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    return (inputs[0], inputs[1]) if isinstance(inputs, tuple) else (inputs, None)


def packed_reference(cfg: GPTConfig, batches: list[tuple], lr: float = 0.1, momentum: float = 0.9) -> tuple:
    """Unsliced, one process: per step the mean loss over its micro-batches, each under its documents."""
    model = GPTReference(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    per_step = len(batches) // STEPS
    losses, first = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        total = torch.zeros(())
        for inputs, labels in batches[step * per_step:(step + 1) * per_step]:
            ids, positions = _split(inputs)
            with packed_documents(positions):
                total = total + causal_lm_loss(model(ids), labels)
        total = total / per_step
        total.backward()
        losses.append(float(total))
        if step == 0:
            first = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return losses, first, {n: p.detach().clone() for n, p in model.named_parameters()}


QUICK_PROFILE = {"slice_lengths": [8, 32], "num_contexts": 2, "warmup": 0, "repeats": 1}


def document_cuts(context: Any, granularity: int = 8) -> tuple[int, ...]:
    """A slicing from a step's document context: a cut at every grid start where some row of the step starts a
    document since the last grid start (its context grew by less than the grid)."""
    cuts = [0] + [k for k in range(1, len(context)) if context[k] < context[k - 1] + granularity] + [len(context)]
    return tuple(granularity * (b - a) for a, b in zip(cuts[:-1], cuts[1:]))


def _engine(cfg: GPTConfig, schedule: str, v: int, slices: Any, packed: bool = True, bf16: bool = False,
            per_batch: bool = False, degree: int = 1) -> Any:
    chunks = {"virtual_stages": v, "schedule": schedule} if v > 1 else {}
    model = ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=STAGES, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="uniform",
                                            sequence_parallel=degree, **chunks)
    dp = WORLD // (STAGES * degree)
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": MICRO,
              "train_batch_size": BATCH * MICRO * dp, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "terapipe": {"enabled": True, "seq_len": SEQ_LEN, "slices": slices, "schedule": schedule,
                           "virtual_stages": v, "granularity": 8, "p2p_timeout_s": 60, "packed": packed,
                           "sequence_parallel": degree,
                           **({"plan_per_batch": True, "profile": QUICK_PROFILE} if per_batch else {})},
              **({"bf16": {"enabled": True}} if bf16 else {})}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def _case(schedule: str, v: int, slices: Any, precision: str = "fp32", degree: int = 1) -> dict[str, Any]:
    dp = WORLD // (STAGES * degree)
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=13)
    batches = packed_batches(cfg, STEPS * MICRO * dp, seed=41)
    ref_losses, ref_grads, ref_params = packed_reference(cfg, batches)
    per_batch = precision.startswith("per-batch")
    engine = _engine(cfg, schedule, v, slices, bf16=precision == "bf16", per_batch=per_batch, degree=degree)
    data = iter(replica_batches(batches, engine.grid.data_parallel_id, MICRO, dp, STEPS))
    if per_batch:
        return _per_batch_case(engine, data, precision.endswith("cuts"), ref_losses, ref_grads, ref_params)
    if precision == "bf16":   # bf16 weights cannot show an update below their rounding: the master weights' change
        start = master_weights(engine)
        losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
        ref_start = {n: p.detach().clone() for n, p in GPTReference(cfg).named_parameters()}
        err, worst, covered = compare(deltas(master_weights(engine), start), deltas(ref_params, ref_start),
                                      engine.stage_id)
        return {"case": STATUS["case"], "losses": losses, "ref_losses": ref_losses, "update_rel_err": err,
                "update_worst": worst, "covered": covered, "num_ref_params": len(ref_params),
                "optimizer": type(engine.optimizer).__name__, "stage": engine.stage_id}
    with first_step_grads(engine) as grads:
        losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    g_err, g_name, g_covered = compare(grads, ref_grads, engine.stage_id)
    p_err, p_name, _ = compare(params, ref_params, engine.stage_id)
    return {"case": STATUS["case"], "losses": losses, "ref_losses": ref_losses, "grad_rel_err": g_err,
            "grad_worst": g_name, "param_rel_err": p_err, "param_worst": p_name, "covered": g_covered,
            "num_ref_params": len(ref_params), "stage": engine.stage_id, "slices": list(engine.slices)}


def _per_batch_case(engine: Any, data: Any, cuts: bool, ref_losses: list, ref_grads: dict, ref_params: dict
                    ) -> dict[str, Any]:
    """Train the steps with a plan per batch: the slicing each step ran, its source, and the comparison."""
    planner = engine.batch_planner
    if cuts:   # rank 0 decides; the others must run what it broadcasts
        planner._solve = lambda engine, base, context: document_cuts(context)
    losses, slicings, sources, contexts = [], [], [], []
    with first_step_grads(engine) as grads:
        for _ in range(STEPS):
            losses.append(float(engine.train_batch(data)))
            slicings.append(list(engine.slices))
            sources.append(engine.plan.source)
            contexts.append(planner.last_context.tolist())
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    g_err, g_name, g_covered = compare(grads, ref_grads, engine.stage_id)
    p_err, p_name, _ = compare(params, ref_params, engine.stage_id)
    return {"case": STATUS["case"], "losses": losses, "ref_losses": ref_losses, "grad_rel_err": g_err,
            "grad_worst": g_name, "param_rel_err": p_err, "param_worst": p_name, "covered": g_covered,
            "num_ref_params": len(ref_params), "stage": engine.stage_id, "slicings": slicings, "sources": sources,
            "contexts": contexts, "length_plan": list(engine.plans[SEQ_LEN].slices),
            "planning_ms": planner.planning_ms}


def _label(schedule: str, v: int, slices: Any, precision: str = "fp32", degree: int = 1) -> str:
    return f"packed schedule={schedule} v={v} slices={slices} {precision}" + (f" sequence={degree}" if degree > 1
                                                                               else "")


def _refusal(kind: str) -> dict[str, Any]:
    """A bad micro-batch on the first stage: every rank stops with the rule (the others as PeerFailedError)."""
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=13)
    batches = packed_batches(cfg, MICRO, seed=43)
    (ids, positions), labels = batches[0]
    bad = {"no restart": positions + 1, "length": positions[:, :-1], "mask": torch.ones_like(ids),
           "not packed": positions}[kind]
    batches[0] = ((ids, bad), labels)
    engine = _engine(cfg, "1f1b", 1, 3, packed=kind != "not packed")
    return run_until_error(lambda: engine.train_batch(iter(batches)))


@suite("packed")
def suite_packed(extra: dict) -> list[dict]:
    results = run_cases(extra["cases"], _label, _case)
    for kind in extra.get("refusals", []):
        STATUS["case"] = f"refuse {kind}"
        results.append(_refusal(kind))
        ENGINE_REF.pop("engine", None)
    return results

"""Suite ``mixed`` (2 ranks), asserted on by tests/test_engine_varlen.py: steps whose micro-batches have different
lengths, each running its own length's slicing, on every schedule, with deferred weight gradients, vocabulary
parallelism and packed documents: the losses, the parameters after 2 steps and an evaluation against the unsliced
reference (run under the same documents).
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ds_terapipe.models.gpt import GPTConfig, GPTReference, causal_lm_loss
from ds_terapipe.runtime.slicing.documents import packed_documents
from tests.suites import suite
from tests.suites.common import STATUS, WORLD, make_batches, run_cases
from tests.suites.common_vocab import vocab_compare, vocab_engine
from tests.suites.packed import packed_positions

#: Lengths of the micro-batches of each step (3 micro-batches, 2 steps), then of an evaluation batch.
MIXED_STEPS = [[64, 32, 16], [16, 64, 48]]
MIXED_EVAL = [32, 64, 16]


@suite("mixed")
def suite_mixed(extra: dict) -> list[dict]:
    """Steps whose micro-batches differ in length, each micro-batch running its own length's slicing:
    ``extra["cases"]`` [schedule, slices, vocab_parallel, deferred_weight_grads (None: the schedule's)]."""
    cfg = GPTConfig(num_layers=4, hidden=32, num_heads=4, vocab_size=64, max_seq_len=128, seed=5)
    micro, batch = 3, 2
    plain = [make_batches(cfg, 1, batch, n, seed=60 + 10 * s + b)[0]
             for s, lengths in enumerate(MIXED_STEPS) for b, n in enumerate(lengths)]
    plain_evals = [make_batches(cfg, 1, batch, n, seed=90 + b)[0] for b, n in enumerate(MIXED_EVAL)]
    rng = random.Random(7)   # the same rows packing documents of skewed lengths
    packed = [((x, packed_positions(rng, batch, x.shape[1])), y) for x, y in plain]
    packed_evals = [((x, packed_positions(rng, batch, x.shape[1])), y) for x, y in plain_evals]
    references = {False: _reference(cfg, plain, plain_evals), True: _reference(cfg, packed, packed_evals)}

    def label(schedule: str, slices: Any, vocab: bool, deferred: Any, pack: bool = False,
              per_batch: bool = False) -> str:
        return (f"mixed {schedule} slices={slices} vocab={vocab} deferred={deferred}" + (" packed" if pack else "")
                + (" per-batch" if per_batch else ""))

    def case(schedule: str, slices: Any, vocab: bool, deferred: Any, pack: bool = False,
             per_batch: bool = False) -> dict[str, Any]:
        batches, evals = (packed, packed_evals) if pack else (plain, plain_evals)
        ref_losses, ref_params, ref_eval = references[pack]
        tp = {"slices": slices, "seq_len": 64, "schedule": schedule, "vocab_parallel": vocab, "granularity": 8,
              "packed": pack, "plan_per_batch": per_batch,
              "profile": {"slice_lengths": [8, 32, 64], "num_contexts": 2, "warmup": 0, "repeats": 1}}
        if deferred is not None:
            tp["deferred_weight_grads"] = deferred
        engine = vocab_engine(cfg, True, tp, stages=WORLD, micro=micro, batch=batch)
        data = iter(batches)
        losses, step_slices, names = [], [], []
        for _ in MIXED_STEPS:
            losses.append(float(engine.train_batch(data)))
            step_slices.append([list(s) for s in engine.step_slices])
            names.append(engine.running.schedule.name)
        params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        err, worst, covered, _ = vocab_compare(engine, params, ref_params, True)
        eval_loss = float(engine.eval_batch(iter(evals), num_micro_batches=len(evals)))
        return {"case": STATUS["case"], "losses": losses, "ref_losses": ref_losses, "param_rel_err": err,
                "param_worst": worst, "covered": covered, "step_slices": step_slices, "schedules": names,
                "eval_loss": eval_loss, "ref_eval": ref_eval, "eval_slices": [list(s) for s in engine.step_slices]}

    return run_cases(extra["cases"], label, case)


def _reference(cfg: GPTConfig, batches: list[tuple], evals: list[tuple]) -> tuple[list[float], dict, float]:
    """Unsliced, one process, SGD + momentum: each step's mean loss over its micro-batches (each under its
    documents), the parameters after the steps, and the evaluation loss with them."""
    model = GPTReference(cfg)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_of(inputs: Any, labels: torch.Tensor) -> torch.Tensor:
        ids, positions = inputs if isinstance(inputs, tuple) else (inputs, None)
        with packed_documents(positions):
            return causal_lm_loss(model(ids), labels)

    losses, per_step = [], len(batches) // len(MIXED_STEPS)
    for step in range(len(MIXED_STEPS)):
        opt.zero_grad()
        total = sum(loss_of(x, y) for x, y in batches[step * per_step:(step + 1) * per_step]) / per_step
        total.backward()
        losses.append(float(total))
        opt.step()
    with torch.no_grad():
        eval_loss = float(sum(loss_of(x, y) for x, y in evals) / len(evals))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, eval_loss

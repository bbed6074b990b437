"""Suite ``vocab``, asserted on by tests/test_vocab_parallel.py: vocabulary parallelism (terapipe.vocab_parallel)
against the unsliced reference: tied and untied heads x vocabularies (divisible by p and not) x schedules x
slicings, 3 steps each: loss, every gradient (each rank's head shard against its rows), parameters, and the
shard's padding rows left at zero. ``extra``: ``dp``, ``micro``, ``layers``, ``vocabs``, ``tied``, ``slicings``,
``schedules``, ``zero_stage``, ``virtual_cases`` (more cases, one each, as [schedule, vocab, tied, slices,
layers]: virtual-stage schedules, whose p*v chunks need more layers; slices may be "auto"), ``clip`` (one
gradient-clipping case).
"""

from __future__ import annotations

from typing import Any

from ds_terapipe.models.gpt import GPTConfig
from tests.suites import suite
from tests.suites.common import STATUS, WORLD, first_step_grads, make_batches
from tests.suites.common_vocab import vocab_clip_case, vocab_compare, vocab_engine, vocab_reference


@suite("vocab")
def suite_vocab(extra: dict) -> list[dict]:
    """Vocabulary parallelism against the unsliced reference: tied/untied heads x vocabularies (divisible by p
    and not) x schedules x slices; loss, every gradient (the shard against its rows), parameters after 3 steps.
    ``virtual_cases``: more cases, one each, as [schedule, vocab, tied, slices, layers] (virtual-stage schedules,
    whose p*v chunks need more layers)."""
    dp = extra.get("dp", 1)
    stages = WORLD // dp
    seq_len, batch, micro, steps = 48, 2, extra.get("micro", 2), 3
    cases = [(sched, vocab, tied, slices, extra.get("layers", 2))
             for vocab in extra.get("vocabs", [64, 63]) for tied in extra.get("tied", [True, False])
             for slices in extra.get("slicings", [1, [8, 24, 16]])
             for sched in extra.get("schedules", ["gpipe", "1f1b"])]
    cases += [tuple(c) for c in extra.get("virtual_cases", [])]
    references: dict[tuple, Any] = {}
    results = []
    for sched, vocab, tied, slices, layers in cases:
        cfg = GPTConfig(num_layers=layers, hidden=32, num_heads=4, vocab_size=vocab, max_seq_len=64, seed=7)
        batches = make_batches(cfg, steps * micro * dp, batch, seq_len, seed=300 + vocab, ignored=True)
        if (vocab, tied, layers) not in references:
            references[(vocab, tied, layers)] = vocab_reference(cfg, tied, batches, steps, lr=0.1, momentum=0.9)
        results.append(vocab_case(cfg, tied, sched, slices, batches, references[(vocab, tied, layers)], dp=dp,
                                  stages=stages, micro=micro, zero_stage=extra.get("zero_stage", 0)))
    if extra.get("clip"):
        cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=63, max_seq_len=64, seed=7)
        results.append(vocab_clip_case(cfg, True, make_batches(cfg, 3 * micro * dp, batch, seq_len, seed=410),
                                       stages=stages, micro=micro, zero_stage=extra.get("zero_stage", 0)))
    return results


def vocab_case(cfg: GPTConfig, tied: bool, sched: str, slices: Any, batches: list[tuple], reference: tuple, *,
               dp: int, stages: int, micro: int, zero_stage: int, seq_len: int = 48, batch: int = 2,
               steps: int = 3) -> dict[str, Any]:
    """One vocabulary-parallel run of ``steps`` steps against ``reference`` (losses, first-step gradients,
    parameters after the steps); ``sched`` may end with ``+W`` (deferred weight gradients)."""
    ref_losses, ref_grads, ref_params = reference
    STATUS["case"] = f"vocab={cfg.vocab_size} tied={tied} slices={slices} schedule={sched}"
    # slices "auto": profiled at init, the vocabulary passes with the layers (a small grid: 3 lengths, 2 contexts)
    auto = {"granularity": 8, "profile": {"slice_lengths": [8, 24, 48], "num_contexts": 2, "warmup": 0,
                                          "repeats": 1}} if slices == "auto" else {}
    engine = vocab_engine(cfg, tied, {"slices": slices, "seq_len": seq_len, "schedule": sched.removesuffix("+W"),
                                      **({"deferred_weight_grads": True} if sched.endswith("+W") else {}), **auto},
                          stages=stages, micro=micro, batch=batch, zero_stage=zero_stage)
    measured = engine.plan.cost   # rank 0's profiled costs (None elsewhere and for given slices)
    data = iter([batches[s * micro * dp + engine.grid.data_parallel_id * micro + j]
                 for s in range(steps) for j in range(micro)])
    with first_step_grads(engine) as grads:
        losses = [float(engine.train_batch(data)) for _ in range(steps)]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    grads_ok = zero_stage == 0  # ZeRO-1 keeps reduced gradients in its partitions
    g_err, g_name, covered, g_pad = vocab_compare(engine, grads if grads_ok else params,
                                                  ref_grads if grads_ok else ref_params, tied)
    p_err, p_name, _, p_pad = vocab_compare(engine, params, ref_params, tied)
    head = engine.module.vocab_head
    return {"case": STATUS["case"], "stage": engine.stage_id, "dp": dp, "losses": losses,
            "ref_losses": ref_losses, "grad_rel_err": g_err, "grad_worst": g_name,
            "param_rel_err": p_err, "param_worst": p_name, "pad_abs": max(g_pad, p_pad),
            "covered": covered, "rows": [head.offset, head.rows, head.num_valid],
            "num_ref_params": len(ref_params), "chunks": list(engine.local_chunks),
            "placement": list(engine.placement),
            "vocab_actions": [str(a) for a in engine._train_schedule().actions if a.is_collective],
            "slices": list(engine.slices), "source": engine.plan_source,
            "vocab_cost": None if measured is None else measured.get("vocab")}

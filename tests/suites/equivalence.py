"""Suite ``equivalence``, asserted on by tests/test_engine_equivalence.py: stages = world size / dp, slicings x
schedules (gpipe, 1f1b, each also with deferred weight gradients) x micro-batches, each trained 3 steps against the
single-process unsliced reference (loss, every gradient, parameters after the steps) and against stock DeepSpeed's
pipeline on the same batches. ``extra``: ``dp``, ``slicings``, ``schedules``, ``micro_batches``, ``zero_stage``
(ZeRO 1: parameters are the check), ``clip`` (one gradient-clipping case). Each case records whether the engine
added the Linears' weight gradients into ``.grad`` inside their GEMMs (``fused``: at ZeRO 0, not under ZeRO 1's
accumulation hooks).
"""

from __future__ import annotations

import time

from ds_terapipe.models.gpt import GPTConfig
from tests.suites import suite
from tests.suites.common import (CLIP, STATUS, WORLD, clip_result, compare, make_batches, reference_step, rel_err,
                                 replica_batches, run_pipeline)


@suite("equivalence")
def suite_equivalence(extra: dict) -> list[dict]:
    """Stages = world size, dp = 1: slices x schedules x micro-batches against the reference and stock DS."""
    stages = WORLD // extra.get("dp", 1)
    dp = WORLD // stages
    cfg = GPTConfig(num_layers=4, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=7)
    seq_len, batch = 48, 2
    slicings = extra.get("slicings", [1, [8, 24, 16], 8])
    # "+W": deferred weight gradients (one W action per micro-batch and stage)
    schedules = extra.get("schedules", ["gpipe", "1f1b", "gpipe+W", "1f1b+W"])
    micro_list = extra.get("micro_batches", [1, 3])
    zero_stage = extra.get("zero_stage", 0)
    steps_for_params = 3
    results = []
    for m in micro_list:
        # at m = 3, labels of -100 (a first slice of 8 counts nothing in every other micro-batch)
        batches = make_batches(cfg, steps_for_params * m * dp, batch, seq_len, seed=100 + m, ignored=m == 3)

        def for_rank(dp_id: int, m=m, batches=batches) -> list[tuple]:
            # step s uses global micro-batches [s*m*dp, (s+1)*m*dp); replica r takes its m of them
            return [batches[s * m * dp + dp_id * m + j] for s in range(steps_for_params) for j in range(m)]

        ref_losses, ref_grads, ref_params = reference_step(cfg, batches, steps_for_params, lr=0.1, momentum=0.9)
        STATUS["case"] = f"stock m={m}"
        stock = run_pipeline(cfg, stages=stages, micro_batches=m, batch=batch, seq_len=seq_len,
                             batches_for_rank=for_rank, num_steps=steps_for_params, lr=0.1, momentum=0.9,
                             terapipe=None, zero_stage=zero_stage)
        for slices in slicings:
            for sched in schedules:
                STATUS["case"] = f"slices={slices} schedule={sched} m={m}"
                t0 = time.perf_counter()
                run = run_pipeline(cfg, stages=stages, micro_batches=m, batch=batch, seq_len=seq_len,
                                   batches_for_rank=for_rank, num_steps=steps_for_params, lr=0.1, momentum=0.9,
                                   terapipe={"slices": slices, "schedule": sched.removesuffix("+W"),
                                             "deferred_weight_grads": sched.endswith("+W"), "granularity": 2,
                                             "p2p_timeout_s": 60}, zero_stage=zero_stage)
                # ZeRO-1 keeps reduced gradients in its own partitions: there, parameters are the check
                grads_ok = zero_stage == 0
                grad_err, grad_name, covered = compare(run["grads"] if grads_ok else run["params"],
                                                       ref_grads if grads_ok else ref_params, run["stage"])
                param_err, param_name, _ = compare(run["params"], ref_params, run["stage"])
                stock_err = max(rel_err(g, stock["params" if not grads_ok else "grads"][n])
                                for n, g in run["params" if not grads_ok else "grads"].items())
                results.append({
                    "case": STATUS["case"], "stages": stages, "dp": dp, "slices": run["slices"],
                    "loss": run["losses"], "ref_loss": ref_losses, "stock_loss": stock["losses"],
                    "stock_param_rel_err": compare(stock["params"], ref_params, stock["stage"])[0],
                    "grad_rel_err": grad_err, "grad_worst": grad_name, "param_rel_err": param_err,
                    "param_worst": param_name, "stock_grad_rel_err": stock_err, "covered": covered,
                    "fused": run["engine"].fused_grad_accumulation, "seconds": time.perf_counter() - t0,
                })
    if extra.get("clip"):
        # gradient clipping by the norm of the whole model's gradient over the global batch
        m, steps = 2, 3
        batches = make_batches(cfg, steps * m * dp, batch, seq_len, seed=400)
        ref_norms: list[float] = []
        ref_losses, _, ref_params = reference_step(cfg, batches, steps, lr=0.1, momentum=0.9, max_norm=CLIP,
                                                   norms=ref_norms)
        STATUS["case"] = f"clip zero={zero_stage}"
        run = run_pipeline(cfg, stages=stages, micro_batches=m, batch=batch, seq_len=seq_len,
                           batches_for_rank=lambda dp_id: replica_batches(batches, dp_id, m, dp, steps),
                           num_steps=steps, lr=0.1, momentum=0.9, zero_stage=zero_stage, clipping=CLIP,
                           terapipe={"slices": [8, 24, 16], "schedule": "1f1b", "granularity": 2, "p2p_timeout_s": 60})
        results.append(clip_result(STATUS["case"], run["engine"], run["losses"], run["norms"], (ref_losses, ref_norms),
                                   compare(run["params"], ref_params, run["stage"])[:2]))
    return results

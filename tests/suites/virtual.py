"""Suite ``virtual``, asserted on by tests/test_engine_virtual.py: virtual stages, p = world / dp ranks x v chunks
each, schedules (interleaved-1f1b, looped-bfs, dualpipev, zbv) x slicings x micro-batches trained 3 steps against
the single-process unsliced reference (loss, every gradient, parameters), and the two V schedules against
DeepSpeed's own DualPipeV where it runs (m >= 2p, one replica: the same placement and chunk boundaries).
``extra``: ``dp``, ``virtual_stages``, ``layers``, ``micro_batches``, ``slicings``, ``schedules``, ``zero_stage``.
"""

from __future__ import annotations

from ds_terapipe.models.gpt import GPTConfig
from tests.suites import suite
from tests.suites.common import STATUS, WORLD, compare, make_batches, reference_step, rel_err, run_pipeline


V_SHAPED = ("dualpipev", "zbv")


@suite("virtual")
def suite_virtual(extra: dict) -> list[dict]:
    """Virtual stages: p = world / dp ranks x v chunks each, schedules x slices x micro-batches against the
    unsliced reference (loss, every gradient, parameters after 3 steps). Stock DeepSpeed has no interleaved or
    looped schedule, so the reference is the check (its equality with stock is the equivalence suite's)."""
    dp = extra.get("dp", 1)
    stages, v = WORLD // dp, extra.get("virtual_stages", 2)
    cfg = GPTConfig(num_layers=extra.get("layers", 4), hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=7)
    seq_len, batch, steps = 48, 2, 3
    zero_stage = extra.get("zero_stage", 0)
    results = []
    for m in extra.get("micro_batches", [2, 4]):
        batches = make_batches(cfg, steps * m * dp, batch, seq_len, seed=200 + m)

        def for_rank(dp_id: int, m=m, batches=batches) -> list[tuple]:
            return [batches[s * m * dp + dp_id * m + j] for s in range(steps) for j in range(m)]

        ref_losses, ref_grads, ref_params = reference_step(cfg, batches, steps, lr=0.1, momentum=0.9)
        stock = None
        if m >= 2 * stages and dp == 1 and {"dualpipev", "zbv"} & set(extra.get("schedules", V_SHAPED)):
            STATUS["case"] = f"stock dualpipev m={m}"  # DeepSpeed's DualPipeV needs m >= 2p
            stock = run_pipeline(cfg, stages=stages, micro_batches=m, batch=batch, seq_len=seq_len,
                                 batches_for_rank=for_rank, num_steps=steps, lr=0.1, momentum=0.9, terapipe=None,
                                 stock_dualpipev=True)
        for slices in extra.get("slicings", [1, [8, 24, 16], 4]):
            for sched in extra.get("schedules", ["interleaved-1f1b", "looped-bfs", *V_SHAPED]):
                STATUS["case"] = f"v={v} slices={slices} schedule={sched} m={m}"
                run = run_pipeline(cfg, stages=stages, micro_batches=m, batch=batch, seq_len=seq_len,
                                   batches_for_rank=for_rank, num_steps=steps, lr=0.1, momentum=0.9,
                                   terapipe={"slices": slices, "schedule": sched.removesuffix("+W"),
                                             **({"deferred_weight_grads": True} if sched.endswith("+W") else {}),
                                             "granularity": 2, "p2p_timeout_s": 60},
                                   zero_stage=zero_stage, virtual_stages=v)
                grads_ok = zero_stage == 0
                grad_err, grad_name, covered = compare(run["grads"] if grads_ok else run["params"],
                                                       ref_grads if grads_ok else ref_params, run["stage"])
                param_err, param_name, _ = compare(run["params"], ref_params, run["stage"])
                engine = run["engine"]
                if stock is not None and sched in V_SHAPED:
                    # the same V placement and chunk boundaries: every gradient and parameter name matches
                    stock_err = max(max(rel_err(g, stock["grads"][n]) for n, g in run["grads"].items()),
                                    max(rel_err(p, stock["params"][n]) for n, p in run["params"].items()))
                else:
                    stock_err = None
                results.append({"case": STATUS["case"], "stages": stages, "dp": dp, "slices": run["slices"],
                                "stock_dualpipev_rel_err": stock_err, "stock_loss": stock and stock["losses"],
                                "loss": run["losses"], "ref_loss": ref_losses, "grad_rel_err": grad_err,
                                "grad_worst": grad_name, "param_rel_err": param_err, "param_worst": param_name,
                                "covered": covered, "chunks": list(engine.local_chunks),
                                "placement": list(engine.placement)})
    return results

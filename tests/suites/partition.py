"""Suite ``partition``, asserted on by tests/test_partition_runtime.py: modules built with
``partition_method="terapipe"`` (layer kinds profiled at init, boundaries and slicing planned together, broadcast,
cached) and ``"parts:..."`` (the user's own), trained 3 steps and compared with the single-process unsliced
reference (loss, every gradient, parameters), under gpipe, 1f1b and interleaved-1f1b, and with ``vocab_parallel``
under gpipe and 1f1b; each followed by the cache hit; then the refusals; then bf16 (DeepSpeed's BF16_Optimizer) with
clipping by the global norm, against the fp32 reference: the cost-based partition of the same setting as the first
case (its fp32 partition cached: the tied head alone on the last stage), and the user's ``parts:0,6,7`` (the same
stage of tied copies only).
``extra``: ``dp``, ``cases`` ([schedule, slices, virtual stages(, vocab_parallel)]), ``zero_stage``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import ds_terapipe
from ds_terapipe.runtime.features import partition as _partition
from ds_terapipe.models.gpt import GPTConfig, GPTReference, causal_lm_loss, gpt_layer_specs
from tests.suites import suite
from tests.suites.common import (CLIP, ENGINE_REF, RANK, STATUS, WORLD, clip_result, compare, deltas,
                                 first_step_grads, make_batches, master_weights, reference_step, train_steps)
from tests.suites.common_vocab import vocab_compare

# The head's measured points are made this much dearer before the partition is planned. Measured alone its margin
# over a block is a few times the noise of ranks sharing cores (four processes on two cores once planned the
# naive layout); the tests check that the runtime profiles, plans and broadcasts a cost-based layout, not this
# host's timings, so the layout they assert follows from the costs whatever the host measures.
HEAD_COST_FACTOR = 8.0
_measured_kinds = _partition._profile_kinds


def _head_made_dearer(module: Any, settings: Any, device: Any, shard: Any = None, split: Any = None,
                      table: Any = None) -> dict:
    profiled = _measured_kinds(module, settings, device, shard, split, table)
    if shard is None:   # with vocab_parallel the head is out of the layers (its share is costed apart)
        for point in profiled["kinds"][_partition.layer_kinds(module._layer_specs)[-1]]:
            point["forward_ms"] *= HEAD_COST_FACTOR
            point["backward_ms"] *= HEAD_COST_FACTOR
    return profiled


_partition._profile_kinds = _head_made_dearer


def _config(terapipe: dict, *, micro: int, batch: int, dp: int, zero_stage: int, vocab_parallel: bool = False
            ) -> dict:
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro,
              "train_batch_size": batch * micro * dp, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": zero_stage},
              "terapipe": dict(terapipe, enabled=True, **({"vocab_parallel": True} if vocab_parallel else {}))}
    if zero_stage:
        config["zero_allow_untested_optimizer"] = True
    return config


def _module(cfg: GPTConfig, config: dict, stages: int, method: str) -> Any:
    terapipe = ds_terapipe.parse_terapipe_config(config)
    kwargs = ds_terapipe.partition_kwargs(config) if method == "terapipe" else {"partition_method": method}
    # module_chunk_kwargs carries terapipe.vocab_parallel (the tied head split over the ranks)
    return ds_terapipe.TokenPipelineModule(gpt_layer_specs(cfg), num_stages=stages, loss_fn=causal_lm_loss,
                                           vocab_size=cfg.vocab_size, **ds_terapipe.module_chunk_kwargs(terapipe),
                                           **kwargs)


def _case(cfg: GPTConfig, terapipe: dict, method: str, *, stages: int, micro: int, batch: int, seq_len: int,
          zero_stage: int = 0, steps: int = 3, vocab_parallel: bool = False) -> dict:
    dp = WORLD // stages
    batches = make_batches(cfg, steps * micro * dp, batch, seq_len, seed=300 + micro)
    ref_losses, ref_grads, ref_params = reference_step(cfg, batches, steps, lr=0.1, momentum=0.9)
    config = _config(dict(terapipe, seq_len=seq_len), micro=micro, batch=batch, dp=dp, zero_stage=zero_stage,
                     vocab_parallel=vocab_parallel)
    t0 = time.perf_counter()
    model = _module(cfg, config, stages, method)
    init_s = time.perf_counter() - t0
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    mine = [batches[s * micro * dp + engine.grid.data_parallel_id * micro + j] for s in range(steps)
            for j in range(micro)]
    data = iter(mine)
    with first_step_grads(engine) as grads:
        losses = [float(engine.train_batch(data)) for _ in range(steps)]
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    grads_ok = zero_stage == 0
    if vocab_parallel:  # the shard against its rows of the reference's tied table
        grad_err, grad_name, covered, _ = vocab_compare(engine, grads if grads_ok else params,
                                                        ref_grads if grads_ok else ref_params, tied=True)
        param_err, param_name, _, _ = vocab_compare(engine, params, ref_params, tied=True)
    else:
        grad_err, grad_name, covered = compare(grads if grads_ok else params,
                                               ref_grads if grads_ok else ref_params, engine.stage_id)
        param_err, param_name, _ = compare(params, ref_params, engine.stage_id)
    ENGINE_REF.pop("engine", None)
    return {"case": STATUS["case"], "parts": list(model.parts), "report": model.partition_report,
            "chunks": list(engine.local_chunks), "slices": list(engine.slices), "loss": losses,
            "ref_loss": ref_losses, "grad_rel_err": grad_err, "grad_worst": grad_name, "param_rel_err": param_err,
            "param_worst": param_name, "covered": covered, "init_s": init_s}


def _bf16_case(cfg: GPTConfig, terapipe: dict, method: str, *, micro: int, batch: int, seq_len: int,
               steps: int = 3) -> dict:
    """``method``'s layout trained under bf16 with clipping by the global norm (its every step clips), against the
    fp32 unsliced reference clipped by torch's ``clip_grad_norm_``: losses, norms and the fp32 master weights' update
    (tests/precision.py, tests/clipping.py); whether this rank's optimizer holds a parameter that is not a tied
    copy (on a stage of tied copies only it lists no gradient for the norm)."""
    batches = make_batches(cfg, steps * micro, batch, seq_len, seed=500)
    reference = GPTReference(cfg)
    ref_start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_norms: list[float] = []
    ref_losses, _, ref_params = reference_step(cfg, batches, steps, lr=0.1, momentum=0.9, model=reference,
                                               max_norm=CLIP, norms=ref_norms)
    config = _config(dict(terapipe, seq_len=seq_len), micro=micro, batch=batch, dp=1, zero_stage=0)
    config.update(bf16={"enabled": True}, gradient_clipping=CLIP)   # DeepSpeed's BF16_Optimizer clips
    model = _module(cfg, config, 2, method)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    start = master_weights(engine)
    losses, norms = train_steps(engine, iter(batches), steps)
    update_err, update_worst, _ = compare(deltas(master_weights(engine), start), deltas(ref_params, ref_start),
                                          engine.stage_id)
    owned = any(not p.ds_pipe_replicated for g in engine.optimizer.bf16_groups for p in g)
    ENGINE_REF.pop("engine", None)
    return {**clip_result(STATUS["case"], engine, losses, norms, (ref_losses, ref_norms), (update_err, update_worst)),
            "optimizer": type(engine.optimizer).__name__, "update_rel_err": update_err, "update_worst": update_worst,
            "parts": list(model.parts), "report": model.partition_report, "owned": owned}


def _error(run: Any) -> dict:
    try:
        run()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return {"type": type(err).__name__, "message": str(err)}
    return {"type": None, "message": ""}


@suite("partition")
def suite_partition(extra: dict) -> list[dict]:
    dp = extra.get("dp", 1)
    stages = WORLD // dp
    # hidden 32, vocabulary 8192: the head (GEMM + softmax over 8192) outweighs several blocks
    cfg = GPTConfig(num_layers=4, hidden=32, num_heads=4, vocab_size=8192, max_seq_len=64, seed=7)
    cache = str(Path(extra["out"]) / "plans")
    profile = {"warmup": 1, "repeats": 3, "num_contexts": 2}
    results = []
    # [schedule, slices, virtual stages, vocab_parallel (the tied head split over the ranks)]
    cases = extra.get("cases", [["gpipe", [8, 24, 16], 1], ["1f1b", 1, 1], ["interleaved-1f1b", [16, 32], 2],
                                ["gpipe", 1, 1, True], ["1f1b", [8, 24, 16], 1, True],
                                ["interleaved-1f1b", [16, 32], 2, True]])
    first_case = cases[0][:3]
    for sched, slices, v, *vp in cases:
        vp_text = " vocab_parallel" if vp and vp[0] else ""
        STATUS["case"] = f"terapipe schedule={sched} slices={slices} v={v}{vp_text}"
        terapipe = {"slices": slices, "schedule": sched, "granularity": 8, "plan_cache": cache, "profile": profile,
                    **({"virtual_stages": v} if v > 1 else {})}
        results.append(_case(cfg, terapipe, "terapipe", stages=stages, micro=2 * v, batch=2, seq_len=48,
                             zero_stage=extra.get("zero_stage", 0), vocab_parallel=bool(vp and vp[0])))
        STATUS["case"] = f"cache schedule={sched} slices={slices} v={v}{vp_text}"   # the same setting: cached
        results.append(_case(cfg, terapipe, "terapipe", stages=stages, micro=2 * v, batch=2, seq_len=48,
                             zero_stage=extra.get("zero_stage", 0), steps=1, vocab_parallel=bool(vp and vp[0])))
    if dp == 1 and stages == 2:
        STATUS["case"] = "parts:0,2,7"
        results.append(_case(cfg, {"slices": [8, 24, 16], "schedule": "1f1b"}, "parts:0,2,7", stages=2, micro=2,
                             batch=2, seq_len=48))
        STATUS["case"] = "refusals"
        config = _config({"slices": 1, "seq_len": 48}, micro=1, batch=2, dp=1, zero_stage=0)
        no_settings = _error(lambda: ds_terapipe.TokenPipelineModule(
            gpt_layer_specs(cfg), num_stages=2, loss_fn=causal_lm_loss, vocab_size=cfg.vocab_size,
            partition_method="terapipe"))
        bad_parts = _error(lambda: _module(cfg, config, 2, "parts:0,9"))
        no_seq_len = _error(lambda: ds_terapipe.partition_kwargs({"terapipe": {"enabled": True}}))
        # rank 1 runs out of memory building the output layer's shard to profile (vocabulary parallelism): every
        # rank raises it, none waits in the link timing's broadcasts, and the next cases run
        from ds_terapipe.runtime.features import partition as partition_module

        def out_of_memory(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("simulated out of memory building the shard")

        original = partition_module.profiling_shard
        partition_module.profiling_shard = out_of_memory if RANK == 1 else original
        try:
            shard_oom = _error(lambda: _module(cfg, _config({"slices": 1, "seq_len": 48, "granularity": 8,
                                                             "profile": profile}, micro=1, batch=2, dp=1,
                                                            zero_stage=0, vocab_parallel=True), 2, "terapipe"))
        finally:
            partition_module.profiling_shard = original
        results.append({"case": "refusals", "no_settings": no_settings, "bad_parts": bad_parts,
                        "no_seq_len": no_seq_len, "shard_oom": shard_oom})
        STATUS["case"] = "bf16 zero0 terapipe"   # the first case's setting: its fp32 partition is in the cache
        sched, slices, _ = first_case
        results.append(_bf16_case(cfg, {"slices": slices, "schedule": sched, "granularity": 8, "plan_cache": cache,
                                        "profile": profile}, "terapipe", micro=2, batch=2, seq_len=48))
        STATUS["case"] = "bf16 zero0 parts:0,6,7"   # the tied head alone on stage 1
        results.append(_bf16_case(cfg, {"slices": [8, 24, 16], "schedule": "1f1b"}, "parts:0,6,7", micro=2, batch=2,
                                  seq_len=48))
    return results

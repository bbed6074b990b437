"""Suite ``vocab_precision``, asserted on by tests/test_vocab_precision.py: vocabulary parallelism under bf16 and
fp16, at ZeRO 0 (DeepSpeed's BF16_Optimizer / FP16_UnfusedOptimizer) and ZeRO 1, tied and untied heads, against the
fp32 unsliced single-process reference. Half-precision weights cannot show an update below their rounding, so each
case compares what the optimizer holds: the change of the fp32 master weights over 3 steps (each shard against its
rows of the reference's) and the losses. Cases are ``extra["cases"]``: [precision, zero stage, tied, schedule,
slices, layers]; the replicas are what the world size leaves after 2 stages.

fp16 on a CPU: DeepSpeed's CPU accelerator reports fp16 only where oneDNN has fp16 kernels; the suite lets
DeepSpeed build its fp16 optimizers anyway (torch computes fp16 on any CPU), since what is tested is where the
shard gradients go and in which scale.
"""

from __future__ import annotations

from typing import Any

from ds_terapipe.models.gpt import GPTConfig, GPTReference
from tests.suites import suite
from tests.suites.common import (STATUS, WORLD, allow_fp16_on_cpu, deltas, make_batches, master_weights,
                                 reference_step, rel_err, replica_batches, run_cases)
from tests.suites.common_vocab import UntiedReference, vocab_compare, vocab_engine

STAGES = 2
STEPS = 3
PRECISIONS = {"bf16": {"bf16": {"enabled": True}},
              # a static scale (no overflow can skip a step and leave the reference behind), large enough that an
              # unscaled shard gradient would be 1/1024 of the rest
              "fp16": {"fp16": {"enabled": True, "loss_scale": 1024.0}}}


def _case(precision: str, zero: int, tied: bool, schedule: str, slices: Any, layers: int) -> dict[str, Any]:
    dp = WORLD // STAGES
    micro, batch, seq_len = 2, 2, 48
    cfg = GPTConfig(num_layers=layers, hidden=32, num_heads=4, vocab_size=63, max_seq_len=64, seed=7)
    batches = make_batches(cfg, STEPS * micro * dp, batch, seq_len, seed=321)
    reference = GPTReference(cfg) if tied else UntiedReference(cfg)
    ref_start = {n: p.detach().clone() for n, p in reference.named_parameters()}
    ref_losses, _, ref_params = reference_step(cfg, batches, STEPS, lr=0.1, momentum=0.9, model=reference)
    engine = vocab_engine(cfg, tied, {"slices": slices, "seq_len": seq_len, "schedule": schedule},
                          stages=STAGES, micro=micro, batch=batch, zero_stage=zero,
                          extra_config={**PRECISIONS[precision], "zero_allow_untested_optimizer": True})
    data = iter(replica_batches(batches, engine.grid.data_parallel_id, micro, dp, STEPS))
    start = master_weights(engine)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    update = deltas(master_weights(engine), start)
    ref_update = deltas(ref_params, ref_start)
    err, worst, covered, pad = vocab_compare(engine, update, ref_update, tied)
    head = engine.module.vocab_head
    shard_err = rel_err(update["vocab_head.weight"][:head.num_valid],
                        ref_update["layers.0.wte.weight" if tied else "head.weight"]
                        [head.offset:head.offset + head.num_valid])
    if not tied:  # the untied input embedding's own rows, also written by hand (EB)
        shard_err = max(shard_err, rel_err(update["vocab_embed.weight"][:head.num_valid],
                                           ref_update["layers.0.wte.weight"][head.offset:head.offset + head.num_valid]))
    return {"case": STATUS["case"], "optimizer": type(engine.optimizer).__name__, "losses": losses,
            "ref_losses": ref_losses, "update_rel_err": err, "update_worst": worst, "shard_update_rel_err": shard_err,
            "covered": covered, "pad_abs": pad, "num_ref_params": len(ref_params), "stage": engine.stage_id}


def _label(precision: str, zero: int, tied: bool, schedule: str, slices: Any, _layers: int) -> str:
    return f"{precision} zero{zero} tied={tied} schedule={schedule} slices={slices}"


@suite("vocab_precision")
def suite_vocab_precision(extra: dict) -> list[dict]:
    allow_fp16_on_cpu()
    return run_cases(extra["cases"], _label, _case)

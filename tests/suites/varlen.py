"""Suite ``varlen`` (2 ranks), asserted on by tests/test_engine_varlen.py: batches of different lengths in one run,
with slices "auto" and a fixed count: one plan per length, planned once, exact gradients at every step against a
reference started from the engine's weights, a length off the granularity refused, and a checkpoint that keeps
every length's slicing.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from ds_terapipe.models.gpt import GPTConfig, GPTReference, causal_lm_loss, gpt_layer_specs, reference_param_name
from tests.suites import suite
from tests.suites.common import STATUS, WORLD, compare, first_step_grads, make_batches, pipeline_engine


@suite("varlen")
def suite_varlen(extra: dict) -> list[dict]:
    """Batches of different lengths in one run: one plan per length, planned once, exact gradients."""
    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=64, max_seq_len=128, seed=3)
    micro, batch = 2, 2
    results: list[dict] = []
    for slices in ("auto", 3):
        STATUS["case"] = f"varlen slices={slices}"
        # auto with gpipe: one W per micro-batch, its cost scaled from the profiled rate to every new length
        tp = {"seq_len": 64, "slices": slices, "granularity": 8, "schedule": "gpipe" if slices == "auto" else "1f1b",
              "profile": {"slice_lengths": [8, 32, 64], "num_contexts": 2, "warmup": 0, "repeats": 1}}
        engine = pipeline_engine(cfg, gpt_layer_specs(cfg), tp, micro=micro, batch=batch)
        seen = []
        for step, length in enumerate([64, 32, 128, 32, 64]):
            batches = make_batches(cfg, micro, batch, length, seed=40 + step)
            # compare gradients of this step against a fresh reference with the engine's current weights
            # the reference starts from the engine's current weights, gathered from every stage
            mine = {reference_param_name(n): p.detach().clone() for n, p in engine.module.named_parameters()
                    if not (n == "tied_modules.embed.wpe.weight" and engine.stage_id != 0)}
            parts: list = [None] * WORLD
            torch.distributed.all_gather_object(parts, mine)
            ref = GPTReference(cfg)
            ref.load_state_dict({k: v for part in parts for k, v in part.items()}, strict=True)
            total = sum(causal_lm_loss(ref(x), y) for x, y in batches) / len(batches)
            total.backward()
            ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            with first_step_grads(engine) as grads:
                loss = float(engine.train_batch(iter(batches)))
            err, name, _ = compare(grads, ref_grads, engine.stage_id)
            seen.append({"length": length, "slices": list(engine.slices), "loss": loss, "ref_loss": float(total),
                         "grad_rel_err": err, "grad_worst": name, "source": engine.plan_source})
        try:
            engine.train_batch(iter(make_batches(cfg, micro, batch, 60, seed=1)))
            bad = None
        except ValueError as err:
            bad = str(err)
        resume = varlen_resume(cfg, engine, tp, micro, batch, extra) if slices == "auto" else None
        results.append({"case": STATUS["case"], "steps": seen, "plans": sorted(engine.plans), "bad_length": bad,
                        "resume": resume})
    return results


def varlen_resume(cfg: GPTConfig, engine: Any, tp: dict, micro: int, batch: int, extra: dict) -> dict:
    """A checkpoint of a variable-length "auto" run keeps every length's slicing: a new engine whose own plan
    differs (as another host's profile can) runs the checkpoint's for each length and trains the same loss."""
    STATUS["case"] = "varlen resume"
    save_dir = str(Path(extra["out"]) / "varlen_ckpt")
    engine.save_checkpoint(save_dir)
    again = pipeline_engine(cfg, gpt_layer_specs(cfg), tp, micro=micro, batch=batch)
    profiled = next(s for s in ((32, 32), (16, 48)) if s != tuple(engine.plans[64].slices))
    again.install_plan(replace(again.plan, slices=profiled))
    again.load_checkpoint(save_dir)
    more = make_batches(cfg, micro, batch, 128, seed=77)
    losses = [float(e.train_batch(iter(more))) for e in (engine, again)]
    return {"plans": {str(n): list(p.slices) for n, p in sorted(engine.plans.items())},
            "restored": {str(n): list(p.slices) for n, p in sorted(again.plans.items())},
            "sources": {str(n): p.source for n, p in sorted(again.plans.items())}, "profiled": list(profiled),
            "losses": losses}

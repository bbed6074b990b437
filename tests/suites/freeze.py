"""Suite ``freeze`` (2 ranks), asserted on by tests/test_freeze.py: progressive freezing (runtime/features/freeze.py)
with a freeze schedule (schedules x v x activation checkpointing) and the auto policy, each against the unsliced
reference with the same layers frozen at the same steps; a checkpoint that keeps what froze; an untied model whose
stage 0 ends with nothing to train, with gradient clipping; repacking (runtime/features/repack.py) onto fewer
stages, with its checkpoint; then the refusals. ``extra``: ``only`` (schedules to run), ``repack_only``.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import ds_terapipe
from deepspeed.pipe import LayerSpec
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from ds_terapipe.runtime.execution import p2p as p2p_mod
from tests.suites import suite
from tests.suites.common import (ENGINE_REF, STATUS, WORLD, frozen_reference, make_batches, named_compare, rel_err,
                                 run_until_error)


class UntiedHead(torch.nn.Module):
    """An output projection of its own (no weight shared with the embedding), initialised from ``cfg.seed`` (not
    the global generator): the reference builds its own copy and must start from the same weights."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(cfg.hidden, cfg.vocab_size, bias=False)
        with torch.no_grad():
            self.proj.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(cfg.seed + 101))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


def untied_specs(cfg: GPTConfig) -> list:
    from ds_terapipe.models.gpt import GPTEmbedding

    specs = gpt_layer_specs(cfg)
    return [LayerSpec(GPTEmbedding, cfg), *specs[1:-1], LayerSpec(UntiedHead, cfg)]


def _frozen_engine(cfg: GPTConfig, terapipe: dict, *, micro: int = 2, batch: int = 2, v: int = 1,
                   checkpoint_interval: int = 0, zero_stage: int = 0, specs: Optional[list] = None,
                   clipping: float = 0.0) -> Any:
    specs = specs or gpt_layer_specs(cfg)
    chunks = {"virtual_stages": v, "schedule": terapipe["schedule"]} if v > 1 else {}
    model = ds_terapipe.TokenPipelineModule(specs, num_stages=WORLD, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="uniform",
                                            activation_checkpoint_interval=checkpoint_interval, **chunks)
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro,
              "train_batch_size": batch * micro, "steps_per_print": 10**9, "gradient_clipping": clipping,
              "zero_optimization": {"stage": zero_stage},
              "terapipe": dict(terapipe, enabled=True, virtual_stages=v, p2p_timeout_s=60)}
    if zero_stage:
        config["zero_allow_untested_optimizer"] = True
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def run_frozen(cfg: GPTConfig, terapipe: dict, batches: list[tuple], num_steps: int, **options: Any
               ) -> dict[str, Any]:
    """Train with ``terapipe`` (a freeze section) and record, per step: loss, gradients before the optimizer
    step, which parameters were frozen and whether they stayed bit-identical, and the schedule's actions."""
    engine = _frozen_engine(cfg, terapipe, **options)
    grads: list[dict[str, torch.Tensor]] = []
    original = engine._take_model_step

    def snapshot_then_step(*args, **kwargs):
        grads.append({n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        return original(*args, **kwargs)

    engine._take_model_step = snapshot_then_step
    data = iter(batches)
    losses, frozen_per_step, changed, with_state, actions, slices = [], [], [], [], [], []
    for _ in range(num_steps):
        module = engine.module
        before = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        losses.append(float(engine.train_batch(data)))
        frozen = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
        frozen_per_step.append(frozen)
        params = dict(engine.module.named_parameters())
        # a repack in this step replaced the module (repack cases compare with a run that did not repack instead)
        changed.append([n for n in frozen if engine.module is module and not torch.equal(params[n].detach(),
                                                                                       before[n])])
        with_state.append([n for n in frozen if params[n] in engine.optimizer.state])
        actions.append(sorted({str(a)[len(str(a.chunk)):].split(".")[0].rstrip("0123456789")
                               for a in engine._train_schedule().actions}))
        slices.append(list(engine.slices))
    engine._take_model_step = original
    ENGINE_REF.pop("engine", None)
    return {"engine": engine, "losses": losses, "grads": grads, "frozen": frozen_per_step, "changed": changed,
            "with_state": with_state, "actions": actions, "slices": slices,
            "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()},
            "events": engine.freezer.events, "has_embed": 0 in engine.local_chunks}


def _frozen_case(case: str, cfg: GPTConfig, run: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    grad_errs = []
    local = set(run["params"]) - (set() if run["has_embed"] else {"tied_modules.embed.wpe.weight"})
    for step, (mine, theirs) in enumerate(zip(run["grads"], ref["grads"])):
        err, name, count = named_compare(mine, theirs, run["has_embed"])
        grad_errs.append({"step": step, "err": err, "worst": name, "count": count, "names": sorted(mine),
                          "missing": sorted(n for n in theirs if n in local and n not in mine)})
    param_err, param_name, _ = named_compare(run["params"], ref["params"], run["has_embed"])
    return {"case": case, "losses": run["losses"], "ref_losses": ref["losses"], "grad_errs": grad_errs,
            "param_rel_err": param_err, "param_worst": param_name, "frozen": run["frozen"],
            "changed": run["changed"], "with_state": run["with_state"], "actions": run["actions"],
            "slices": run["slices"], "events": run["events"], "stage": run["engine"].stage_id,
            "local_chunks": list(run["engine"].local_chunks), "parts": list(run["engine"].module.parts)}


def repack_cases(extra: dict, cfg: GPTConfig, batches: list[tuple], num_steps: int, micro: int, batch: int,
                 seq_len: int, at: Callable[[int], int]) -> list[dict]:
    """Repacking (runtime/features/repack.py): the freeze schedule that leaves stage 0 with frozen layers only, with and
    without ``repack``; after the repack both ranks hold every layer (1 stage x 2 replicas) and train the same
    losses and parameters as the pipeline that kept its 2 stages, and as the reference."""
    results: list[dict] = []
    ref = frozen_reference(gpt_layer_specs(cfg), batches, num_steps, at)
    for slices, sched in ((2, "1f1b"), ("auto", "gpipe")):
        runs = {}
        # "auto": both runs must run the same slices, or the frozen weights they compare bit for bit were trained
        # with different rounding before they froze (a flaky failure once); the second run takes the first one's
        # plan from the plan cache, as it is (no re-timing)
        cache = str(Path(extra["out"]) / f"plan_cache_repack_{sched}")
        for repack in (False, True):
            STATUS["case"] = f"repack={repack} {sched} slices={slices}"
            terapipe = {"seq_len": seq_len, "slices": slices, "schedule": sched, "granularity": 8,
                        "profile": {"slice_lengths": [8, 24, 48], "num_contexts": 2, "warmup": 0, "repeats": 1,
                                    "recheck_cached": False},
                        "freeze": {"schedule": [[1, 2], [2, 4]], "repack": repack},
                        **({"plan_cache": cache} if slices == "auto" else {})}
            before = set(p2p_mod._WAITERS)
            runs[repack] = run_frozen(cfg, terapipe, batches, num_steps)
        plain, packed = runs[False], runs[True]
        # the thread the engine before the repack waited on for its transfers: stopped (no idle thread per repack)
        stray_waiters = sum(w not in before and w is not packed["engine"].p2p._waiter and w.is_alive()
                            for w in p2p_mod._WAITERS)
        engine = packed["engine"]
        worst = max(rel_err(packed["params"][n], plain["params"][n]) for n in plain["params"]
                    if n in packed["params"] and (n != "tied_modules.embed.wpe.weight" or plain["has_embed"]))
        ref_err, ref_name, _ = named_compare(packed["params"], ref["params"], True)
        # eval_batch after the repack: each replica evaluates its share, DeepSpeed averages over the replicas
        held_out = make_batches(cfg, micro, batch, seq_len, seed=37)
        evals = [float(plain["engine"].eval_batch(iter(held_out))), float(engine.eval_batch(iter(held_out)))]
        frozen_last = packed["frozen"][-1]
        frozen_moved = [n for n in frozen_last if n in plain["params"] and (plain["has_embed"] or "wpe" not in n)
                        and not torch.equal(packed["params"][n], plain["params"][n])]
        results.append({"case": f"repack {sched} slices={slices}", "losses": packed["losses"],
                        "plain_losses": plain["losses"], "ref_losses": ref["losses"], "param_rel_err": worst,
                        "ref_param_rel_err": ref_err, "ref_worst": ref_name, "events": packed["events"],
                        "frozen_differ": frozen_moved, "evals": evals, "stray_waiters": stray_waiters,
                        "first_slices": [plain["slices"][0], packed["slices"][0]],
                        "num_stages": engine.num_stages, "replicas": engine.dp_world_size,
                        "micro_batches": engine.micro_batches, "stage": engine.stage_id,
                        "names": sorted(packed["params"]), "plain_names": sorted(plain["params"]),
                        "changed": packed["changed"], "with_state": packed["with_state"],
                        "frozen": packed["frozen"], "slices": packed["slices"],
                        "state_names": sorted(n for n, p in engine.module.named_parameters()
                                              if p in engine.optimizer.state)})
        if slices != 2:
            continue
        # a checkpoint written after the repack: an engine started in the original layout repacks, then loads it,
        # and continues exactly as the repacked run does; the export holds the whole model
        STATUS["case"] = "repack resume"
        save_dir = str(Path(extra["out"]) / "repack_ckpt")
        engine.save_checkpoint(save_dir)
        second = _frozen_engine(cfg, terapipe)
        second.load_checkpoint(save_dir)
        more = make_batches(cfg, micro, batch, seq_len, seed=31)
        losses = [float(engine.train_batch(iter(more))), float(second.train_batch(iter(more)))]
        params = [dict(engine.module.named_parameters()), dict(second.module.named_parameters())]
        exported = ds_terapipe.export_state_dict(save_dir)
        results.append({"case": "repack resume", "layout": [second.num_stages, second.dp_world_size],
                        "losses": losses, "params_equal": sorted(params[0]) == sorted(params[1]) and all(
                            torch.equal(params[0][n].detach(), params[1][n].detach()) for n in params[0]),
                        "state_equal": _optimizer_states_equal(engine, second),
                        "exported_matches": all(torch.equal(exported[_export_name(n, exported)], v)
                                                for n, v in packed["params"].items()),
                        "frozen": second.freezer.num_frozen_layers})
    return results


def _export_name(name: str, exported: dict) -> str:
    """The export's key of a module parameter (a tied weight is stored under its first layer's index)."""
    if not name.startswith("tied_modules."):
        return name
    tail = name.split(".", 2)[2]
    return next(k for k in sorted(exported, key=lambda k: int(k.split(".")[0])) if k.split(".", 1)[1] == tail)


def _optimizer_states_equal(a: Any, b: Any) -> bool:
    pa, pb = dict(a.module.named_parameters()), dict(b.module.named_parameters())
    for name, param in pa.items():
        sa, sb = a.optimizer.state.get(param, {}), b.optimizer.state.get(pb[name], {})
        if sorted(sa) != sorted(sb) or not all(torch.equal(torch.as_tensor(sa[k]), torch.as_tensor(sb[k])) for k in sa):
            return False
    return True


@suite("freeze")
def suite_freeze(extra: dict) -> list[dict]:
    """A freeze schedule (schedules x v x checkpointing) and the auto policy against the unsliced reference with
    the same layers frozen at the same steps; then the refusals."""
    cfg = GPTConfig(num_layers=4, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=19)
    seq_len, batch, micro, num_steps = 48, 2, 2, 4
    batches = make_batches(cfg, num_steps * micro, batch, seq_len, seed=23)
    # layers: embed 0, blocks 1-4, final norm 5, head 6; two chunks [0, 4) [4, 7) (v = 1) or four (v = 2)
    schedule = [[1, 2], [2, 4]]

    def at(step: int) -> int:
        return max([n for s, n in schedule if s <= step] + [0])

    if extra.get("repack_only"):  # a developer's shortcut: python -c "...launch('freeze', 2, out, extra=...)"
        return repack_cases(extra, cfg, batches, num_steps, micro, batch, seq_len, at)
    ref = frozen_reference(gpt_layer_specs(cfg), batches, num_steps, at)
    results: list[dict] = []
    for sched, v, slices, interval in (("gpipe", 1, [8, 24, 16], 0), ("1f1b", 1, 3, 0), ("1f1b", 1, [16, 32], 1),
                                       ("dualpipev", 2, [24, 24], 0), ("interleaved-1f1b", 2, 2, 0)):
        if extra.get("only") and sched not in extra["only"]:
            continue
        STATUS["case"] = f"schedule {sched} v={v} slices={slices} ckpt={interval}"
        run = run_frozen(cfg, {"seq_len": seq_len, "slices": slices, "schedule": sched, "granularity": 8,
                               "freeze": {"schedule": schedule}}, batches, num_steps, v=v,
                         checkpoint_interval=interval)
        results.append(_frozen_case(STATUS["case"], cfg, run, ref))

    # auto policy with slices "auto": profiled, frozen by gradient norms, re-planned; the reference freezes at
    # the steps the pipeline decided (read from its events), so the gradients must still match
    STATUS["case"] = "auto"
    prof = {"slice_lengths": [8, 24, 48], "num_contexts": 2, "warmup": 0, "repeats": 1}
    auto_steps = 6
    auto_batches = make_batches(cfg, auto_steps * micro, batch, seq_len, seed=29)
    run = run_frozen(cfg, {"seq_len": seq_len, "slices": "auto", "schedule": "1f1b", "granularity": 8,
                           "profile": prof, "freeze": {"auto": {"check_interval": 1, "tolerance": 100.0,
                                                                "aggressiveness": 0.34}}},
                     auto_batches, auto_steps)
    decided = [(e["step"], e["layers"][1]) for e in run["events"]]

    def auto_at(step: int) -> int:
        return max([n for s, n in decided if s <= step] + [0])

    auto_ref = frozen_reference(gpt_layer_specs(cfg), auto_batches, auto_steps, auto_at)
    results.append(_frozen_case("auto", cfg, run, auto_ref))

    # a checkpoint keeps what froze: a new engine that loads it freezes the same layers and continues identically
    STATUS["case"] = "resume"
    first = run["engine"]
    save_dir = str(Path(extra["out"]) / "freeze_ckpt")
    # a client state with its own "terapipe" entry (the example trainer's once held its printed plan): the
    # engine's freeze state joins it, and the plan comes from the manifest the engine writes itself
    first.save_checkpoint(save_dir, client_state={"terapipe": {"caller": "own"}})
    second = _frozen_engine(cfg, {"seq_len": seq_len, "slices": "auto", "schedule": "1f1b", "granularity": 8,
                                  "profile": prof, "freeze": {"auto": {"check_interval": 1, "tolerance": 100.0,
                                                                       "aggressiveness": 0.34}}})
    # this start profiled its own slicing; make it differ from the first run's, as another host's speed can
    # (CI once chose [48] against the run's [24, 24]): the load must put the checkpoint's slicing back
    saved = list(first.slices)   # the checkpoint's slicing (a freeze in the next step may re-plan both runs)
    profiled = next(s for s in ((8, 40), (16, 32)) if s != tuple(saved))
    second.install_plan(replace(second.plan, slices=profiled))
    second.load_checkpoint(save_dir)
    loaded = list(second.slices)
    more = make_batches(cfg, micro, batch, seq_len, seed=31)
    losses = [float(first.train_batch(iter(more))), float(second.train_batch(iter(more)))]
    params = [dict(first.module.named_parameters()), dict(second.module.named_parameters())]
    results.append({"case": "resume", "frozen": [e.freezer.num_frozen_layers for e in (first, second)],
                    "frozen_names": [sorted(n for n, p in ps.items() if not p.requires_grad) for ps in params],
                    "losses": losses, "slices": [list(first.slices), list(second.slices)],
                    "sources": [first.plan_source, second.plan_source], "profiled": list(profiled),
                    "saved_slices": saved, "loaded_slices": loaded,
                    "params_equal": all(torch.equal(params[0][n].detach(), params[1][n].detach()) for n in params[0])})

    # no tied weight: rank 0 ends with nothing to train at all, and gradient clipping still works (it joins the
    # norm's all-reduce with zero: runtime/execution/clip.py)
    STATUS["case"] = "untied clipping"
    run = run_frozen(cfg, {"seq_len": seq_len, "slices": 2, "schedule": "1f1b", "freeze": {"schedule": [[1, 4]]}},
                     batches, 3, specs=untied_specs(cfg), clipping=1e-3)
    clipped_ref = frozen_reference(untied_specs(cfg), batches[:3 * micro], 3, lambda step: 4 if step >= 1 else 0,
                                   max_norm=1e-3)
    param_err, param_name, _ = named_compare(run["params"], clipped_ref["params"], run["has_embed"])
    results.append({"case": STATUS["case"], "losses": run["losses"], "changed": run["changed"],
                    "frozen": [len(f) for f in run["frozen"]], "stage": run["engine"].stage_id,
                    "actions": run["actions"], "trained": sorted(n for n in run["params"] if n in run["grads"][-1]),
                    "ref_losses": clipped_ref["losses"], "param_rel_err": param_err, "param_worst": param_name,
                    "unclipped_param_rel_err": named_compare(run["params"], frozen_reference(
                        untied_specs(cfg), batches[:3 * micro], 3, lambda step: 4 if step >= 1 else 0)["params"],
                        run["has_embed"])[0]})

    results.extend(repack_cases(extra, cfg, batches, num_steps, micro, batch, seq_len, at))

    # refusals, on every rank before any step
    for case, freeze, zero in (("too many", {"schedule": [[1, 9]]}, 0), ("all", {"schedule": [[1, 7]]}, 0),
                               ("repack micro-batches", {"schedule": [[1, 4]], "repack": True}, 0)):
        STATUS["case"] = f"refuse {case}"
        micro_batches = 3 if case == "repack micro-batches" else 2  # 3 micro-batches cannot split over 2 replicas
        got = run_until_error(lambda: run_frozen(cfg, {"seq_len": seq_len, "slices": 2, "schedule": "1f1b",
                                                       "freeze": freeze}, batches, 1, zero_stage=zero,
                                                 micro=micro_batches))
        results.append(got)
    return results

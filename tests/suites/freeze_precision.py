"""Suite ``freeze_precision``, asserted on by tests/test_freeze_precision.py: a freeze schedule (2 layers from step 1,
4 from step 2, of 7) on 2 stages (x the replicas the world size leaves) under bf16, fp16 and fp32 at ZeRO 0 and 1,
against the unsliced single-process fp32 reference with the same layers frozen at the same steps (SGD with momentum
0.9 and weight decay: a frozen weight whose momentum survives keeps moving, and one whose master copy the inner
step updates decays even with its momentum zeroed). Per case: the losses; the change of the optimizer's fp32
master weights over the run against the reference's change, per parameter; per step, every frozen parameter's master
copy and model weight unchanged bit for bit, and its optimizer state zero (``state_nonzero``: the frozen parameters
whose momentum is not). Cases are ``extra["cases"]``: [precision, zero stage, schedule, virtual stages(, vocabulary
parallelism: the head's shards, each compared with its rows of the reference's(, the model: "gpt", the reference GPT
with its tied head, or "llama", a Hugging Face Llama from a config, untied head(, freeze: false runs the same case
without freezing)))]. fp16 on a CPU: as tests/suites/vocab_precision.py, DeepSpeed is let build its fp16 optimizers.

Steps DeepSpeed skips (``extra["skip_cases"]``: [policy, precision, zero stage, steps], :func:`_skips_case`): the
steps are clean batches and poisoned ones (a micro-batch's loss times nan or inf), fp16 under a dynamic loss scale
that the overflows halve. ``auto``: what the auto policy compared at each check (every layer's norm), what froze
when, against a run of the clean batches alone (the test compares them with the fp32 run's). ``schedule repack``:
a freeze schedule that repacks at step 2: the frozen count at each step against the optimizer steps taken, and the
loss scaler's state and step counters right before and after the repack.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

import ds_terapipe
import ds_terapipe.runtime.features.freeze as freeze_module
import ds_terapipe.runtime.features.repack as repack_module
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from tests.suites import suite
from tests.suites.common import (ENGINE_REF, POISON, STATUS, WORLD, allow_fp16_on_cpu, build_spec_layers, deltas,
                                 frozen_reference, loss_scale, make_batches, master_weights, named_compare, poison,
                                 poisoned_loss, replica_batches, run_cases)

STAGES = 2
SCHEDULE = [[1, 2], [2, 4]]
STEPS = 4
WEIGHT_DECAY = 0.01
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "loss_scale": 1024.0}},
              # from 2^8, doubled by every step taken (so a check's step moves the scale its gradients carry); an
              # overflow halves it (ZeRO 1: after its hysteresis of 2)
              "fp16 dynamic": {"fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1}}}
#: the auto policy of the skipped-step cases: a check every step, every layer stable, 2 layers per check at first
AUTO = {"check_interval": 1, "tolerance": 100.0, "aggressiveness": 0.34}


def _frozen_at(step: int) -> int:
    return max([n for s, n in SCHEDULE if s <= step] + [0])


def _specs(model: str) -> tuple[list, int]:
    """The layer specs of ``model`` ("gpt": the reference GPT, tied head; "llama": a Hugging Face Llama with
    grouped-query attention and an untied lm_head, from a config) and its vocabulary; 7 layers each."""
    if model == "gpt":
        cfg = GPTConfig(num_layers=4, hidden=32, num_heads=4, vocab_size=64, max_seq_len=64, seed=19)
        return gpt_layer_specs(cfg), cfg.vocab_size
    import transformers

    from ds_terapipe.models.hf import causal_lm_specs

    llama = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
    return causal_lm_specs(llama, seed=5), llama.vocab_size


def _engine(specs: list, vocab_size: int, precision: str, zero: int, schedule: str, v: int, micro: int, batch: int,
            vocab: bool = False, freeze: bool = True, repack: bool = False, freeze_section: Optional[dict] = None,
            loss_fn: Any = causal_lm_loss) -> Any:
    chunks = {"virtual_stages": v, "schedule": schedule} if v > 1 else {}
    model = ds_terapipe.TokenPipelineModule(specs, num_stages=STAGES, loss_fn=loss_fn,
                                            vocab_size=vocab_size, partition_method="uniform",
                                            vocab_parallel=vocab, **chunks)
    dp = WORLD // STAGES
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro,
              "train_batch_size": batch * micro * dp, "steps_per_print": 10**9, "gradient_clipping": 0.0,
              "zero_optimization": {"stage": zero}, "zero_allow_untested_optimizer": True,
              "terapipe": {"enabled": True, "seq_len": 48, "slices": [8, 24, 16], "schedule": schedule,
                           "virtual_stages": v, "granularity": 8, "p2p_timeout_s": 60,
                           **({"freeze": freeze_section or {"schedule": SCHEDULE, "repack": repack}}
                              if freeze else {}),
                           "vocab_parallel": vocab},
              **PRECISIONS[precision]}
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=WEIGHT_DECAY)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def _state_nonzero(engine: Any, names: list[str]) -> list[str]:
    """The frozen parameters (``names``) whose optimizer state on this rank is not all zero."""
    masters = getattr(engine.freezer, "_masters", None)
    params = dict(engine.module.named_parameters())
    if masters is None:   # a torch optimizer: the state is dropped
        return [n for n in names if params[n] in engine.optimizer.state]
    out = []
    for name in names:
        region = masters._region(params[name])
        if region is None:
            continue
        master, start, count = region
        if any(bool(t.view(-1).narrow(0, start, count).any()) for t in masters._state_tensors(master)):
            out.append(name)
    return out


def _vocab_update(engine: Any, update: dict[str, torch.Tensor], ref_update: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """With vocabulary parallelism the head's table (and a split untied embedding's) lives in the shards: each
    shard against its rows of the reference's, under the shard's name."""
    head = engine.module.vocab_head
    if head is None:
        return update, ref_update
    rows = slice(head.offset, head.offset + head.num_valid)
    table = f"tied_modules.{head.spec.tied_key}.{head.spec.weight_name}" if head.spec.tied_key else \
        f"{head.spec.index}.{head.spec.weight_name}"
    update = dict(update, **{"vocab_head.weight": update["vocab_head.weight"][:head.num_valid]})
    ref_update = dict(ref_update, **{"vocab_head.weight": ref_update[table][rows]})
    split = head.embedding
    if split is not None and not split.tied:   # the untied input embedding's rows, against its layer's table
        embed = f"tied_modules.{split.key}.{split.name}" if split.key else f"{split.layer}.{split.name}"
        update["vocab_embed.weight"] = update["vocab_embed.weight"][:head.num_valid]
        ref_update["vocab_embed.weight"] = ref_update[embed][rows]
    return update, ref_update


def _whole_rows(engine: Any, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``named`` with vocabulary parallelism's row shards replaced by the whole tables (collective): a repack to
    one stage gives that stage every row, so the tables before and after compare as wholes."""
    head = engine.module.vocab_head
    if head is None:
        return named
    rows: list[Any] = [None] * WORLD
    torch.distributed.all_gather_object(rows, (engine.stage_id, head.num_valid, {
        n: t for n, t in named.items() if n.startswith(("vocab_head.", "vocab_embed."))}))
    first = {stage: (valid, part) for stage, valid, part in reversed(rows)}   # replica 0's, by stage
    return {**named, **{name: torch.cat([first[s][1][name][:first[s][0]] for s in sorted(first)])
                        for name in first[0][1]}}


def _case(precision: str, zero: int, schedule: str, v: int, vocab: bool = False, model: str = "gpt",
          freeze: bool = True, repack: bool = False) -> dict[str, Any]:
    dp = WORLD // STAGES
    micro, batch = 2, 2
    specs, vocab_size = _specs(model)
    batches = make_batches(SimpleNamespace(vocab_size=vocab_size), STEPS * micro * dp, batch, 48, seed=23)
    _, initial, _ = build_spec_layers(_specs(model)[0])
    ref_start = {n: p.detach().clone() for n, p in initial.items()}
    ref = frozen_reference(_specs(model)[0], batches, STEPS, _frozen_at if freeze else (lambda step: 0),
                           weight_decay=WEIGHT_DECAY)
    engine = _engine(specs, vocab_size, precision, zero, schedule, v, micro, batch, vocab, freeze, repack)
    # an iterator per step: after a repack every rank reads its former pipeline's stream, a rank that was a middle
    # stage before (dualpipev's rank 1) included, which a persistent iterator would have left behind
    stream = replica_batches(batches, engine.grid.data_parallel_id, micro, dp, STEPS)
    start = master_weights(engine)
    if repack:   # after the repack a rank holds the other stage's weights too: their start from their first holder
        every: list[Any] = [None] * WORLD
        torch.distributed.all_gather_object(every, start)
        start = {n: t for part in reversed(every) for n, t in part.items()} | start
        start = _whole_rows(engine, start)
    previous: Optional[tuple[dict, dict]] = None
    losses, moved, nonzero, frozen_counts = [], [], [], []
    for step in range(STEPS):
        losses.append(float(engine.train_batch(iter(stream[step * micro:(step + 1) * micro]))))
        master = master_weights(engine)
        weights = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if repack:   # rows split over the pipeline compare as whole tables across the repack
            master, weights = _whole_rows(engine, master), _whole_rows(engine, weights)
        frozen = sorted(n for n, p in engine.module.named_parameters() if not p.requires_grad)
        frozen_counts.append(len(frozen))
        if previous is not None:
            moved.append([n for n in frozen if n in previous[0] and (not torch.equal(master[n], previous[0][n]) or
                          not torch.equal(weights[n], previous[1][n]))])
        nonzero.append(_state_nonzero(engine, frozen))
        previous = (master, weights)
        if 0 not in engine.local_chunks:   # a stage without the embedding holds a stale, unused copy of wpe
            for held in previous:
                held.pop("tied_modules.embed.wpe.weight", None)
    update = deltas(master_weights(engine), start)
    ref_update = deltas(ref["params"], ref_start)
    update, ref_update = _vocab_update(engine, update, ref_update)
    has_embed = 0 in engine.local_chunks
    err, worst, count = named_compare(update, ref_update, has_embed)
    return {"case": STATUS["case"], "optimizer": type(engine.optimizer).__name__, "losses": losses,
            "ref_losses": ref["losses"], "update_rel_err": err, "update_worst": worst, "compared": count,
            "moved": moved, "state_nonzero": nonzero, "frozen_counts": frozen_counts,
            "frozen_layers": engine.freezer.num_frozen_layers if freeze else None, "stage": engine.stage_id,
            "layout": [engine.num_stages, engine.dp_world_size]}


def _label(precision: str, zero: int, schedule: str, v: int, vocab: bool = False, model: str = "gpt",
           freeze: bool = True, repack: bool = False) -> str:
    return (f"{precision} zero{zero} schedule={schedule} v={v} model={model}" + (" vocab_parallel" if vocab else "")
            + ("" if freeze else " no-freeze") + (" repack" if repack else ""))


def _scaler_state(engine: Any) -> dict[str, Any]:
    """The step counters and the fp16 loss scaler's state (scale, hysteresis, iterations, last overflow)."""
    state: dict[str, Any] = {c: getattr(engine, c) for c in ("global_steps", "skipped_steps")}
    for name in ("loss_scaler", "loss_scale_config"):
        owner = getattr(engine.optimizer, name, None)
        if owner is not None:
            state[name] = {k: v for k, v in sorted(vars(owner).items()) if isinstance(v, (bool, int, float))}
    return state


def _skips_case(policy: str, precision: str, zero: int, steps: list[str]) -> dict[str, Any]:
    """``steps`` ("clean": the next clean batch; "nan", "inf": a poisoned batch DeepSpeed skips) on 2 stages under
    ``policy`` ("auto": AUTO; "schedule repack": 4 layers frozen from step 2, repacked); per step the frozen layers
    in effect, the steps taken and skipped after it and the loss scale; the norms each auto check compared; the
    freeze events; the loss scaler's state around the repack."""
    micro, batch = 2, 2
    specs, vocab_size = _specs("gpt")
    vocab = SimpleNamespace(vocab_size=vocab_size)
    clean = iter(make_batches(vocab, steps.count("clean") * micro, batch, 48, seed=23))
    bad = iter(make_batches(vocab, len(steps) * micro, batch, 48, seed=41))
    section = {"auto": AUTO} if policy == "auto" else {"schedule": [[2, 4]], "repack": True}
    engine = _engine(specs, vocab_size, "fp16 dynamic" if precision == "fp16" else precision, zero, "1f1b", 1,
                     micro, batch, freeze_section=section, loss_fn=poisoned_loss)
    checks: list[dict[str, float]] = []
    around: dict[str, Any] = {}
    rule, repack = freeze_module.auto_freeze_count, repack_module.repack

    def recorded_rule(frozen: int, previous: Any, current: Any, *args: Any) -> int:
        checks.append({str(k): v for k, v in sorted(current.items())})
        return rule(frozen, previous, current, *args)

    def recorded_repack(old: Any, k: int) -> Any:
        around["before"] = _scaler_state(old)
        event = repack(old, k)
        around["after"] = _scaler_state(old)   # the engine object is the repacked one now
        return event

    freeze_module.auto_freeze_count, repack_module.repack = recorded_rule, recorded_repack
    run: dict[str, list] = {"frozen": [], "taken": [], "skipped": [], "scales": [], "losses": []}
    try:
        for what in steps:
            group = [next(clean) for _ in range(micro)] if what == "clean" else poison(
                [next(bad) for _ in range(micro)], what)
            try:
                run["losses"].append(float(engine.train_batch(iter(group))))
            finally:
                POISON["loss"] = 1.0
            run["frozen"].append(engine.freezer.num_frozen_layers)
            run["taken"].append(engine.global_steps - engine.skipped_steps)
            run["skipped"].append(engine.skipped_steps)
            run["scales"].append(loss_scale(engine))
    finally:
        freeze_module.auto_freeze_count, repack_module.repack = rule, repack
    return {"case": STATUS["case"], "policy": policy, "precision": precision, "zero": zero, "steps": steps, **run,
            "checks": checks, "events": [[e["step"], e.get("global_step"), e["layers"]] for e in engine.freezer.events
                                         if "layers" in e and not e.get("after_repack")],
            "repack": around or None, "layout": [engine.num_stages, engine.dp_world_size]}


@suite("freeze_precision")
def suite_freeze_precision(extra: dict) -> list[dict]:
    allow_fp16_on_cpu()
    return run_cases(extra["cases"], _label, _case) + run_cases(
        extra.get("skip_cases", []), lambda policy, precision, zero, steps: f"skips {policy} {precision} zero{zero} "
        + " ".join(steps), _skips_case)

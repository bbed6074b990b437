"""Suite ``fuzz``, run by tests/fuzz.py (random cases) and tests/test_fuzz.py (a fixed selection): cases drawn
over the feature matrix the ``"terapipe"`` config allows (schedule, stages, sequence ranks and replicas, chunks per
rank, slices, micro-batches, deferred weight gradients, activation checkpointing, ZeRO 0/1, precision, vocabulary
parallelism with a tied or untied head, packed documents, micro-batches of mixed lengths, clipping, sharded data
parallelism, freezing by a schedule or the ``auto`` policy and repacking, online re-planning, fp16 with a static or
a dynamic loss scale and a step that overflows, SGD or the config's Adam/AdamW, a checkpoint saved after the first
step and loaded by a new engine for the others, a Hugging Face Llama), each trained 2 to 4 steps, then evaluated,
against the single-process unsliced reference on the same data (:func:`tests.suites.common.frozen_reference`, with
the same optimizer, the same steps skipped and the same layers frozen: the ``auto`` rule run on its own
gradients): the losses, every first-step gradient (fp32 at ZeRO 0) and the parameters after the steps (fp32), or
the master weights' change (bf16, fp16), the evaluation loss, the steps skipped and the frozen count of each step.

A case is a dict (tests/fuzz.py's ``draw_case`` makes them; every rank gets the same list). Each rank appends one
JSON line per case to ``OUT/fuzz_rank{R}.jsonl`` when the case starts and one when it ends, so a launch that dies
on a case (a crash, a hang past ``extra["case_timeout_s"]``: tests/dist_worker.py's watchdog prints where this
rank was and exits 3) still leaves every earlier case's outcome; the runner decides the verdict from all ranks'
lines. An exception is recorded with its
type, message and the phase it came from (``init``, ``train``, ``eval``, ``compare``): a ValueError or TypeError
raised on every rank at init is a refusal, anything else a finding.
"""

from __future__ import annotations

import gc
import json
import random
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

import torch

import ds_terapipe
from ds_terapipe.config import AutoFreezeConfig
from ds_terapipe.models.gpt import GPTConfig, causal_lm_loss, gpt_layer_specs
from ds_terapipe.planner.freeze import auto_freeze_count
from tests.dist_worker import watchdog
from tests.suites import suite
from tests.suites.common import (CLIP, ENGINE_REF, POISON, RANK, STATUS, WORLD, allow_fp16_on_cpu,
                                 build_spec_layers, deltas, first_step_grads, frozen_reference, make_batches,
                                 master_weights, poisoned_loss, rel_err, replica_batches, whole_tensors)
from tests.suites.common_vocab import SeededHead, reference_rows
from tests.suites.packed import packed_positions

SEQ_LEN, BATCH, LR, MOMENTUM = 48, 2, 0.1, 0.9
#: the slice lengths "auto" profiles: few, one round, so a case profiles in seconds
QUICK_PROFILE = {"slice_lengths": [8, 24, 48], "num_contexts": 2, "warmup": 0, "repeats": 1}
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}},
              "fp16": {"fp16": {"enabled": True, "loss_scale": 1024.0}}}   # static: no step skipped
#: ``optimizer: "adam"`` / ``"adamw"``: DeepSpeed builds it from the config (torch's, as on a CPU; "Adam" with
#: ``adam_w_mode`` off is torch's Adam, weight decay added to the gradient), the reference builds the same. eps
#: above the gradients' rounding: the keys' bias has a gradient that is zero but for rounding (attention is
#: invariant to it), which Adam's division by its root mean square would turn into a step of up to ``lr`` (with
#: eps 1e-8 that bias alone is 0.29 off in fp32 after 3 steps, 0.54 in bf16); with 1e-4 Adam's updates keep the
#: tolerances SGD's do (measured 3.9e-7 in fp32, 3.4e-2 in bf16 at ZeRO 1, 2.2e-3 in fp16)
ADAM = {"lr": 1e-3, "betas": [0.9, 0.99], "eps": 1e-4}
#: what an ``overflow`` step's marked micro-batch multiplies its loss by: finite, its fp16 gradients are not
OVERFLOW_FACTOR = 1e30


def case_model(case: dict) -> tuple[GPTConfig, list]:
    """The model of a case and its layer specs: the reference GPT with its tied head, or an untied one with a
    bias; ``model: "llama"``: a Hugging Face Llama (rotary positions, 4 query heads over 2 key/value heads, its
    ``tie_word_embeddings`` from ``tied``). The GPTConfig gives the vocabulary either way."""
    cfg = GPTConfig(num_layers=case["layers"], hidden=32, num_heads=4, vocab_size=case["vocab"], max_seq_len=64,
                    seed=7 + case["seed"] % 5)
    if case.get("model") == "llama":
        import transformers

        from ds_terapipe.models.hf import causal_lm_specs

        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=case["layers"],
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=case["vocab"],
                                          max_position_embeddings=64, tie_word_embeddings=case["tied"])
        return cfg, causal_lm_specs(config, seed=cfg.seed)
    specs = gpt_layer_specs(cfg)
    if not case["tied"]:
        from deepspeed.pipe import LayerSpec
        specs = specs[:-1] + [LayerSpec(SeededHead, cfg)]
    return cfg, specs


def case_data(case: dict, cfg: GPTConfig, dp: int) -> tuple[list[tuple], list[tuple]]:
    """The global batches of the training steps (``steps * micro * dp`` micro-batches, in the order
    :func:`replica_batches` deals them) and the evaluation micro-batches (the same on every replica). Lengths: the
    case's ``lengths`` cycled (mixed lengths), else ``SEQ_LEN``; packed cases give each micro-batch packed rows,
    plain ids or one document per row as position ids, by turns."""
    rng = random.Random(case["seed"])
    lengths = case.get("lengths") or [SEQ_LEN]

    def micro_batch(index: int, seed: int) -> tuple:
        length = lengths[index % len(lengths)]
        ids, labels = make_batches(cfg, 1, BATCH, length, seed=seed, ignored=case["ignored"] and index % 2 == 1)[0]
        if not case["packed"] or index % 3 == 1:
            return ids, labels
        positions = (packed_positions(rng, BATCH, length) if index % 3 == 0
                     else torch.arange(length).expand(BATCH, -1).clone())
        return (ids, positions), labels

    train = [micro_batch(i, 1000 * case["seed"] + i) for i in range(_steps(case) * case["micro"] * dp)]
    evals = [micro_batch(i + 1, 1000 * case["seed"] + 500 + i) for i in range(case["micro"])]
    if case.get("overflow") is not None:   # the step's last micro-batch (the last replica's) marked: poisoned_loss
        index = (case["overflow"] + 1) * case["micro"] * dp - 1
        inputs, labels = train[index]
        labels = labels.clone()
        labels[0] = -100
        train[index] = (inputs, labels)
    return train, evals


def _steps(case: dict) -> int:
    return case.get("steps", 2)


def terapipe_section(case: dict) -> dict[str, Any]:
    tp: dict[str, Any] = {"enabled": True, "seq_len": SEQ_LEN, "slices": case["slices"], "schedule": case["schedule"],
                          "granularity": case["granularity"], "p2p_timeout_s": 30}
    if case["v"] is not None:
        tp["virtual_stages"] = case["v"]
    if case["deferred"] is not None:
        tp["deferred_weight_grads"] = case["deferred"]
    for key in ("vocab_parallel", "packed"):
        if case[key]:
            tp[key] = True
    if case["seq"] > 1:
        tp["sequence_parallel"] = case["seq"]
    if case["shard"]:
        tp["shard_params"] = True
    if case["freeze"] or case.get("auto_freeze"):
        policy = {"auto": dict(case["auto_freeze"])} if case.get("auto_freeze") else \
            {"schedule": [[_freeze_at(case), case["freeze"]]]}
        tp["freeze"] = {**policy, **({"repack": True} if case.get("repack") else {})}
    if case.get("replan"):
        tp["replan"] = {"enabled": True, **case["replan"]}
    for key, name in (("release", "shard_release"), ("prefetch", "shard_prefetch"), ("fuse", "fuse_grad_accumulation"),
                      ("per_batch", "plan_per_batch")):
        if case.get(key) is not None:
            tp[name] = case[key]
    if case["slices"] == "auto":
        tp["profile"] = dict(QUICK_PROFILE)
    return tp


def _freeze_at(case: dict) -> int:
    """The training step a case's freeze starts at (its ``freeze`` front layers from then on)."""
    return 1 if case.get("freeze_at") is None else case["freeze_at"]


def precision_config(case: dict) -> dict[str, Any]:
    """The case's precision section: fp16 with ``scale`` (``initial_scale_power``, ``loss_scale_window``,
    ``hysteresis``) is DeepSpeed's dynamic loss scale, else the static one of PRECISIONS."""
    if case["precision"] == "fp16" and case.get("scale"):
        return {"fp16": {"enabled": True, "loss_scale": 0, **case["scale"]}}
    return PRECISIONS[case["precision"]]


def optimizer_config(case: dict) -> dict[str, Any]:
    """The DeepSpeed config's ``optimizer`` section of an Adam case (empty for SGD, which the case passes in)."""
    name = case.get("optimizer", "sgd")
    if name == "sgd":
        return {}
    params = {**ADAM, "weight_decay": case.get("wd") or 0.0, "torch_adam": True}
    return {"optimizer": {"type": "AdamW", "params": params} if name == "adamw" else
            {"type": "Adam", "params": {**params, "adam_w_mode": False}}}


def reference_optimizer(case: dict) -> Optional[Callable[[list], torch.optim.Optimizer]]:
    """The optimizer the reference steps with, the one :func:`optimizer_config` asks DeepSpeed for (None: SGD)."""
    name = case.get("optimizer", "sgd")
    if name == "sgd":
        return None
    kind = torch.optim.AdamW if name == "adamw" else torch.optim.Adam
    return lambda params: kind(params, lr=ADAM["lr"], betas=tuple(ADAM["betas"]), eps=ADAM["eps"],
                               weight_decay=case.get("wd") or 0.0)


def build_engine(case: dict, specs: list, cfg: GPTConfig, dp: int) -> Any:
    tp = terapipe_section(case)
    model = ds_terapipe.TokenPipelineModule(
        specs, num_stages=case["stages"], loss_fn=poisoned_loss if case.get("overflow") is not None else causal_lm_loss,
        vocab_size=cfg.vocab_size, partition_method="uniform", activation_checkpoint_interval=case["ckpt"],
        **ds_terapipe.module_chunk_kwargs(ds_terapipe.parse_terapipe_config({"terapipe": tp})))
    config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": case["micro"],
              "train_batch_size": BATCH * case["micro"] * dp, "steps_per_print": 10**9,
              "gradient_clipping": CLIP if case["clip"] else 0.0, "zero_optimization": {"stage": case["zero"]},
              "zero_allow_untested_optimizer": True, "terapipe": tp, **precision_config(case),
              **optimizer_config(case)}
    opt = None if "optimizer" in config else torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                                                             weight_decay=case.get("wd") or 0.0)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, model_parameters=model.parameters(),
                                             config=config)
    ENGINE_REF["engine"] = engine
    return engine


class AutoFreezeReference:
    """The ``freeze.auto`` rule (:func:`auto_freeze_count`) run on the reference's own gradients, as
    :func:`frozen_reference`'s ``frozen_at`` and ``on_grads``: each layer's gradient norm (every parameter of its
    module, a tied module's whole) at each check, the frozen count for the next step from the last two checks.
    ``changes``: every relative norm change a check compared, so the caller can tell a decision that a rounding
    could flip. ``vocab_parallel``: the output layer (the last) trains beside the last chunk's backward, so the
    layer with parameters in front of it is the one that never freezes."""

    def __init__(self, cfg: AutoFreezeConfig, specs: list, vocab_parallel: bool) -> None:
        from deepspeed.pipe import TiedLayerSpec

        self.cfg = cfg
        _, named, modules = build_spec_layers(specs)
        prefixes = [f"tied_modules.{spec.key}." if isinstance(spec, TiedLayerSpec) else f"{idx}."
                    for idx, spec in enumerate(specs)]
        self.names = {idx: [n for n in named if n.startswith(prefix)] for idx, prefix in enumerate(prefixes)}
        self.param_layers = tuple(idx for idx, module in enumerate(modules[:-1] if vocab_parallel else modules)
                                  if any(True for _ in module.parameters()))
        self.frozen, self.pending = 0, 0
        self.previous: Optional[dict[int, float]] = None
        self.changes: list[float] = []

    def __call__(self, taken: int) -> int:
        self.frozen = max(self.frozen, self.pending)
        return self.frozen

    def on_grads(self, taken: int, grads: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg
        if taken < cfg.warmup_steps or (taken - cfg.warmup_steps) % cfg.check_interval:
            return
        norms = {idx: sum(float((grads[n].double() ** 2).sum()) for n in self.names[idx] if n in grads) ** 0.5
                 for idx in self.param_layers if idx >= self.frozen}
        previous, self.previous = self.previous, norms
        if previous is None:
            return
        self.changes += [abs(norms[i] - previous[i]) / previous[i] for i in norms if previous.get(i)]
        self.pending = auto_freeze_count(self.frozen, previous, norms, self.param_layers, cfg)


def reference_run(case: dict, train: list, evals: list) -> tuple[dict[str, Any], dict[str, Any]]:
    """The unsliced reference of ``case`` and the case as the engine runs it. A ``freeze.auto`` case's tolerance
    is moved, where a check's norm change lies within rounding of it, into the middle of the widest gap between
    the changes (so the engine's norms, rounded otherwise, take the reference's decisions), and the reference run
    again with it; ``"ref_frozen"``: the frozen count of every step taken."""
    frozen, frozen_at = case["freeze"] or 0, _freeze_at(case)
    skipped = [case["overflow"]] if case.get("overflow") is not None else []
    margin = 1e-3 if case["precision"] == "fp32" else 5e-2
    for _ in range(4):
        auto = AutoFreezeReference(AutoFreezeConfig(**case["auto_freeze"]), case_model(case)[1],
                                   case["vocab_parallel"]) if case.get("auto_freeze") else None
        counts: list[int] = []

        def at(taken: int) -> int:
            counts.append(auto(taken) if auto is not None else frozen if taken >= frozen_at else 0)
            return counts[-1]

        ref = frozen_reference(case_model(case)[1], train, _steps(case), at, lr=LR, momentum=MOMENTUM,
                               max_norm=CLIP if case["clip"] else 0.0, weight_decay=case.get("wd") or 0.0,
                               evals=evals, optimizer=reference_optimizer(case), skipped=skipped,
                               on_grads=auto.on_grads if auto is not None else None)
        ref["frozen"], ref["skipped"] = counts, skipped
        tolerance = case["auto_freeze"]["tolerance"] if auto is not None else 0.0
        if auto is None or all(abs(c - tolerance) > margin * (1 + c) for c in auto.changes):
            return ref, case
        edges = sorted({0.0, *auto.changes})
        gaps = [(b - a, (a + b) / 2) for a, b in zip(edges, edges[1:])] + [(1.0 + edges[-1], 2 * edges[-1] + 1)]
        case = dict(case, auto_freeze={**case["auto_freeze"], "tolerance": max(gaps)[1]})
    raise AssertionError(f"{case['id']}: no freeze.auto tolerance clear of the reference's norm changes")


def run_case(case: dict, out_dir: Path) -> dict[str, Any]:
    """One case on this rank: what it compared, or the exception and the phase it came from (a resume case's
    checkpoint goes under ``out_dir``)."""
    out: dict[str, Any] = {"id": case["id"], "rank": RANK}
    dp = WORLD // (case["stages"] * case["seq"])
    phase, started = "reference", time.perf_counter()
    try:
        cfg, specs = case_model(case)
        train, evals = case_data(case, cfg, dp)
        ref, case = reference_run(case, train, evals)
        if case.get("auto_freeze"):
            out["auto_tolerance"] = case["auto_freeze"]["tolerance"]
        ref_start = {n: p.detach().clone() for n, p in build_spec_layers(case_model(case)[1])[1].items()}
        phase, started = "init", time.perf_counter()
        engine = build_engine(case, specs, cfg, dp)
        out["slices"] = [int(s) for s in engine.slices]
        half = case["precision"] != "fp32"
        phase = "train"
        start = whole_model(engine, master_weights(engine))[0] if half else {}
        stream = replica_batches(train, engine.grid.data_parallel_id, case["micro"], dp, _steps(case))
        m = case["micro"]
        out["skipped"], out["frozen"] = [], []
        POISON["loss"] = OVERFLOW_FACTOR

        def step(index: int) -> float:
            # an iterator per step: after a repack every rank reads the step, a former middle stage included
            skipped = engine.skipped_steps
            loss = float(engine.train_batch(iter(stream[index * m:(index + 1) * m])))
            if engine.skipped_steps != skipped:
                out["skipped"].append(index)
            else:   # the frozen count the step trained with
                out["frozen"].append(getattr(getattr(engine, "freezer", None), "num_frozen_layers", 0))
            return loss

        with first_step_grads(engine) as grads:
            out["losses"] = [step(0)]
        if not half and case["zero"] == 0 and ref["grads"][0]:   # ZeRO 1 keeps reduced gradients in its partitions
            phase = "compare"
            got, out["grad_copies_err"], out["grad_copies_worst"] = whole_model(engine, grads)
            out["grad_err"], out["grad_worst"], out["grads_missing"] = compare_whole(got, ref["grads"][0])
        if case.get("resume"):   # saved after the first step, the second run by a new engine that loads it
            phase = "checkpoint"
            where = str(out_dir / f"ckpt_{case['id']}")
            engine.save_checkpoint(where, tag="one")
            ENGINE_REF.pop("engine", None)
            engine = build_engine(case, case_model(case)[1], cfg, dp)
            engine.load_checkpoint(where, tag="one")
        phase = "train"
        out["losses"] += [step(index) for index in range(1, _steps(case))]
        out.update(ref_losses=ref["losses"], ref_skipped=ref["skipped"], ref_frozen=ref["frozen"])
        out["step_slices"] = [list(map(int, s)) for s in getattr(engine, "step_slices", [])]
        phase = "compare"
        if half:   # half precision cannot show an update below its rounding: the fp32 master weights' change
            got, out["param_copies_err"], out["param_copies_worst"] = whole_model(engine, master_weights(engine))
            out["update_err"], out["update_worst"], out["missing"] = compare_whole(
                deltas(got, start), deltas(ref["params"], ref_start))
        else:
            got, out["param_copies_err"], out["param_copies_worst"] = whole_model(
                engine, dict(engine.module.named_parameters()))
            out["param_err"], out["param_worst"], out["missing"] = compare_whole(got, ref["params"])
        if case["eval"]:
            phase = "eval"
            count = case.get("eval_count")   # None: the step's micro-batches, as train_batch reads them
            out["eval"] = float(engine.eval_batch(iter(evals), num_micro_batches=count))
            out["ref_eval"] = ref["eval"]
        out["status"] = "ok"
    except Exception as err:  # noqa: BLE001 - the runner classifies it (refusal or finding)
        out.update(status="error", phase=phase, type=type(err).__name__, message=f"{err}"[:2000],
                   traceback=traceback.format_exc()[-4000:])
    finally:
        POISON["loss"] = 1.0
    out["seconds"] = round(time.perf_counter() - started, 2)
    return out


def whole_model(engine: Any, named: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], float, str]:
    """Every rank's ``named`` tensors gathered on every rank (collective), under the reference's names: a
    vocabulary-parallel shard joins its table (its rows of all ranks, under ``"<table>#rows"`` where the table's
    own tensor exists too). So a comparison does not depend on the layout, which a repack changes mid-run. Also
    the largest relative difference between two copies of one tensor (replicas, tied copies, a tied head's shards
    against their rows of the table): 0 when the copies agree, and where (the tensor, the two ranks). The head
    stage's copy of the tied embedding's position table is left out (unused)."""
    split = reference_rows(engine)
    has_embed = 0 in engine.local_chunks
    mine: list[tuple[str, int, torch.Tensor]] = []
    for name, value in whole_tensors(named).items():
        if name in split:
            table, shard = split[name]
            if shard.num_valid:
                mine.append((f"{table}#rows", shard.offset, value[:shard.num_valid]))
        elif has_embed or name != "tied_modules.embed.wpe.weight":
            mine.append((name, -1, value))
    parts: list = [None] * WORLD
    torch.distributed.all_gather_object(parts, mine)
    copies: dict[str, dict[int, torch.Tensor]] = {}
    disagree, where = 0.0, ""
    holder: dict[tuple[str, int], int] = {}
    for rank, part in enumerate(parts):
        for name, offset, value in part:
            seen = copies.setdefault(name, {})
            if offset in seen:
                err = rel_err(value, seen[offset])
                if err > disagree:
                    disagree, where = err, f"{name} (ranks {holder[name, offset]} and {rank})"
            seen[offset], holder[name, offset] = value, rank
    for name, pieces in copies.items():   # a tied head's shards: copies of their rows of the embedding
        table = copies.get(name.removesuffix("#rows"), {}).get(-1) if name.endswith("#rows") else None
        for offset, value in ([] if table is None else pieces.items()):
            err = rel_err(value, table[offset:offset + len(value)])
            if err > disagree:
                disagree, where = err, f"{name} at row {offset} (rank {holder[name, offset]}) and its table"
    out = {name: pieces[-1] if -1 in pieces else torch.cat([pieces[o] for o in sorted(pieces)])
           for name, pieces in copies.items()}
    return {(n.removesuffix("#rows") if n.endswith("#rows") and n.removesuffix("#rows") not in out else n): t
            for n, t in out.items()}, disagree, where


def compare_whole(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]
                  ) -> tuple[float, dict[str, float], list[str]]:
    """The worst relative error of :func:`whole_model`'s tensors against the reference's, the 6 worst names with
    theirs, and the reference names nothing was compared with."""
    errors = {name: rel_err(value, ref[name.removesuffix("#rows")]) for name, value in got.items()}
    worst = sorted(errors.items(), key=lambda item: -item[1])[:6]
    return (worst[0][1] if worst else 0.0), dict(worst), sorted(set(ref) - {n.removesuffix("#rows") for n in got})


@suite("fuzz")
def suite_fuzz(extra: dict) -> list[dict]:
    allow_fp16_on_cpu()
    log = Path(extra["out"]) / f"fuzz_rank{RANK}.jsonl"
    results = []
    for case in extra["cases"]:
        STATUS["case"] = case["id"]
        timer = watchdog(float(extra.get("case_timeout_s", 240)))   # a hang becomes an exit naming the case
        with open(log, "a") as fh:   # a launch that dies later tells a case it began from one it never reached
            fh.write(json.dumps({"id": case["id"], "status": "started"}) + "\n")
        result = run_case(case, Path(extra["out"]))
        ENGINE_REF.pop("engine", None)
        gc.collect()
        with open(log, "a") as fh:   # before the barrier: a launch that dies in it still tells what this rank saw
            fh.write(json.dumps(result) + "\n")
        # every rank ends the case before any starts the next (a rank that refused alone waits here for its peers)
        torch.distributed.barrier()
        timer.cancel()
        results.append({k: v for k, v in result.items() if k != "traceback"})
    return results


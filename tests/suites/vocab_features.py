"""Suite ``vocab_features`` (2 ranks), asserted on by tests/test_vocab_parallel.py: vocabulary parallelism's
checkpoints (the same p resumes exactly; p = 1 loads the weights; export_state_dict merges the shards; to and from
a model without vocab_parallel; under dualpipev, and from there into 1f1b), gradient clipping with tied and
untied heads, eval_batch, and the refusals, each raised on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch

import ds_terapipe
from ds_terapipe.models.gpt import GPTConfig, GPTReference, causal_lm_loss, gpt_layer_specs
from tests.suites import suite
from tests.suites.common import STATUS, WORLD, gathered_params, make_batches, rel_err
from tests.suites.common_vocab import vocab_clip_case, vocab_engine, vocab_layer_specs


def _raised(fn: Callable[[], Any]) -> Optional[str]:
    try:
        fn()
    except ValueError as err:
        return f"{type(err).__name__}: {err}"
    return None


def vocab_virtual_checkpoint_case(cfg: GPTConfig, batches: list[tuple], ckpt: Path) -> dict[str, Any]:
    """A checkpoint under dualpipev (two chunks per rank, the last chunk and chunk 0 on rank 0) with a tied head
    whose input embedding is split: eval_batch equals the reference's loss; the same layout resumes exactly; a 1f1b
    model (one chunk per rank) loads the
    same weights (layers by global index, the shards by pipeline rank); the export holds the whole head."""
    from ds_terapipe.runtime.execution.checkpoint import export_state_dict

    STATUS["case"] = "vocab checkpoint under dualpipev"
    plan = {"slices": [8, 24, 16], "seq_len": 48, "schedule": "dualpipev"}
    first = vocab_engine(cfg, True, plan, stages=WORLD, micro=2, batch=2)
    eval_loss = float(first.eval_batch(iter(batches[:2])))  # forwards and VF alone, before any step
    with torch.no_grad():
        ref_model = GPTReference(cfg)
        ref_eval = float(sum(causal_lm_loss(ref_model(x), y) for x, y in batches[:2]) / 2)
    data = iter(batches)
    for _ in range(2):
        first.train_batch(data)
    first.save_checkpoint(str(ckpt))
    saved = {n: p.detach().clone() for n, p in first.module.named_parameters()}
    saved_all = gathered_params(first)
    uninterrupted = float(first.train_batch(data))
    after = {n: p.detach().clone() for n, p in first.module.named_parameters()}
    again = vocab_engine(cfg, True, plan, stages=WORLD, micro=2, batch=2)
    again.load_checkpoint(str(ckpt))
    resumed = float(again.train_batch(iter(batches[4:])))
    resume_err = max(rel_err(p.detach(), after[n]) for n, p in again.module.named_parameters())
    STATUS["case"] = "vocab checkpoint under dualpipev into 1f1b"
    flat = vocab_engine(cfg, True, dict(plan, schedule="1f1b"), stages=WORLD, micro=2, batch=2)
    flat.load_checkpoint(str(ckpt), load_optimizer_states=False)
    flat_all = gathered_params(flat)
    head = flat.module.vocab_head
    merged = export_state_dict(str(ckpt))
    key = f"{head.spec.index}.{head.spec.weight_name}"
    return {"case": "vocab checkpoint under dualpipev", "chunks": list(first.local_chunks),
            "eval_loss": eval_loss, "ref_eval_loss": ref_eval,
            "uninterrupted": uninterrupted, "resumed": resumed, "resume_err": resume_err,
            "layers_equal": sorted(k for k in saved_all if "vocab_head" not in k) ==
            sorted(k for k in flat_all if "vocab_head" not in k),
            "flat_layer_err": max(rel_err(flat_all[k], v) for k, v in saved_all.items() if "vocab_head" not in k),
            "flat_head_err": rel_err(head.weight.detach(), saved["vocab_head.weight"]),
            "export_head_err": rel_err(merged[key][head.offset:head.offset + head.num_valid],
                                       saved["vocab_head.weight"][:head.num_valid]),
            "export_embed_err": rel_err(merged["0.wte.weight"], merged[key])}


@suite("vocab_features")
def suite_vocab_features(extra: dict) -> list[dict]:
    """Checkpoints (same p: exact resume; p=1: weights; export_state_dict merges the shards), eval_batch, and the
    refusals, each raised on every rank."""
    from ds_terapipe.runtime.execution.checkpoint import export_state_dict

    cfg = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=63, max_seq_len=64, seed=7)
    batches = make_batches(cfg, 6, 2, 48, seed=77)
    plan = {"slices": [8, 24, 16], "seq_len": 48, "schedule": "1f1b"}
    results: list[dict] = []
    for tied in (True, False):
        STATUS["case"] = f"vocab checkpoint tied={tied}"
        first = vocab_engine(cfg, tied, plan, stages=WORLD, micro=2, batch=2)
        data = iter(batches)
        for _ in range(2):
            first.train_batch(data)
        ckpt = str(Path(extra["out"]) / f"vocab_ckpt_{tied}")
        first.save_checkpoint(ckpt)
        saved = first.module.vocab_head
        saved_rows = (saved.offset, saved.num_valid, saved.weight.detach().clone())
        saved_embed = None if tied else first.module.vocab_embed.weight.detach().clone()
        uninterrupted = float(first.train_batch(data))
        after = {n: p.detach().clone() for n, p in first.module.named_parameters()}
        again = vocab_engine(cfg, tied, plan, stages=WORLD, micro=2, batch=2)
        again.load_checkpoint(ckpt)
        resumed = float(again.train_batch(iter(batches[4:])))
        resume_err = max(rel_err(p.detach(), after[n]) for n, p in again.module.named_parameters())
        # another p: one stage x WORLD replicas loads the weights; the export holds the whole head
        STATUS["case"] = f"vocab checkpoint at p=1 tied={tied}"
        merged = export_state_dict(ckpt)
        one = vocab_engine(cfg, tied, plan, stages=1, micro=2, batch=2)
        one.load_checkpoint(ckpt, load_optimizer_states=False)
        head = one.module.vocab_head
        key = f"{head.spec.index}.{head.spec.weight_name}"
        split = {}
        rows = slice(saved_rows[0], saved_rows[0] + saved_rows[1])
        # the input embedding was split: its table is in the shards, exported and loaded from there
        tag_dir = Path(ckpt) / (Path(ckpt) / "latest").read_text().strip()
        split["layer0_has_table"] = "wte.weight" in torch.load(tag_dir / "layer_00-model_states.pt",
                                                               weights_only=True)
        # tied: the head's table under layer 0 too; untied: the embedding's own rows, whole
        split["export_embed_err"] = rel_err(merged["0.wte.weight"], merged[key]) if tied else \
            rel_err(merged["0.wte.weight"][rows], saved_embed[:saved_rows[1]])
        split["p1_embed_err"] = 0.0 if tied else rel_err(one.module.vocab_embed.weight.detach(),
                                                         merged["0.wte.weight"])
        STATUS["case"] = "vocab checkpoint into a model without vocab_parallel"
        plain = ds_terapipe.TokenPipelineModule(vocab_layer_specs(cfg, tied), num_stages=WORLD,
                                                loss_fn=causal_lm_loss, vocab_size=cfg.vocab_size,
                                                partition_method="uniform")
        plain_engine, _, _, _ = ds_terapipe.initialize(
            model=plain, optimizer=torch.optim.SGD(plain.parameters(), lr=0.1),
            config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "train_batch_size": 4,
                    "terapipe": dict(plan, enabled=True, p2p_timeout_s=60)})
        plain_engine.load_checkpoint(ckpt, load_optimizer_states=False)
        holds = "embed" in plain.tied_modules   # untied: the embedding layer's stage only
        split["plain_table_err"] = rel_err(plain.tied_modules["embed"].wte.weight.detach(),
                                           merged["0.wte.weight"]) if holds else 0.0
        split["plain_layer_err"] = max(rel_err(p.detach(), merged[n]) for n, p in plain.state_dict().items()
                                       if n in merged)
        # and back: a checkpoint written without vocabulary parallelism loads into the split model
        STATUS["case"] = "vocab: a checkpoint without vocab_parallel into the split model"
        plain_ckpt = str(Path(extra["out"]) / f"plain_ckpt_{tied}")
        plain_engine.save_checkpoint(plain_ckpt)
        split_again = vocab_engine(cfg, tied, plan, stages=WORLD, micro=2, batch=2)
        split_again.load_checkpoint(plain_ckpt, load_optimizer_states=False)
        mine = split_again.module.vocab_head
        split["from_plain_err"] = rel_err(mine.weight.detach()[:mine.num_valid],
                                          merged[key][mine.offset:mine.offset + mine.num_valid])
        if not tied:
            rows_again = split_again.module.vocab_embed
            split["from_plain_err"] = max(split["from_plain_err"], rel_err(
                rows_again.weight.detach()[:rows_again.num_valid],
                merged["0.wte.weight"][rows_again.offset:rows_again.offset + rows_again.num_valid]))
        results.append({"case": f"vocab checkpoint at p=1 tied={tied}", **split,
                        "uninterrupted": uninterrupted, "resumed": resumed,
                        "resume_err": resume_err, "export_keys": sorted(merged),
                        "export_shape": list(merged[key].shape),
                        "p1_head_err": rel_err(head.weight.detach(), merged[key]),
                        "shard_vs_export_err": rel_err(saved_rows[2][:saved_rows[1]],
                                                       merged[key][saved_rows[0]:saved_rows[0] + saved_rows[1]])})
    results.append(vocab_virtual_checkpoint_case(cfg, batches, Path(extra["out"]) / "vocab_ckpt_dualpipev"))
    for tied in (True, False):
        results.append(vocab_clip_case(cfg, tied, batches, stages=WORLD, micro=2))
    # eval: the loss of the unsliced reference's forward; return_logits and compute_loss=False are refused, the
    # engine still usable
    STATUS["case"] = "vocab eval"
    engine = vocab_engine(cfg, True, plan, stages=WORLD, micro=2, batch=2)
    loss = float(engine.eval_batch(iter(batches[:2])))
    with torch.no_grad():
        ref_model = GPTReference(cfg)
        ref = float(sum(causal_lm_loss(ref_model(x), y) for x, y in batches[:2]) / 2)
    results.append({"case": "vocab eval", "loss": loss, "ref_loss": ref,
                    "return_logits": _raised(lambda: engine.eval_batch(iter(batches[:2]), return_logits=True)),
                    "compute_loss": _raised(lambda: engine.eval_batch(iter(batches[:2]), compute_loss=False)),
                    "after": float(engine.eval_batch(iter(batches[:2])))})
    # refusals, every rank
    refusals = {}
    STATUS["case"] = "vocab refusals"
    specs = gpt_layer_specs(cfg)
    refusals["no_head"] = _raised(lambda: ds_terapipe.TokenPipelineModule(
        specs[:-1], num_stages=WORLD, loss_fn=causal_lm_loss, vocab_parallel=True))
    refusals["loss"] = _raised(lambda: ds_terapipe.TokenPipelineModule(
        specs, num_stages=WORLD, loss_fn=lambda out, lab: causal_lm_loss(out, lab) * 2, vocab_parallel=True))
    tiny = GPTConfig(num_layers=2, hidden=32, num_heads=4, vocab_size=WORLD - 1, max_seq_len=64, seed=7)
    refusals["small_vocab"] = _raised(lambda: ds_terapipe.TokenPipelineModule(
        gpt_layer_specs(tiny), num_stages=WORLD, loss_fn=causal_lm_loss, vocab_parallel=True))
    refusals["config_without_module"] = _raised(lambda: vocab_engine(
        cfg, True, dict(plan, vocab_parallel=True), stages=WORLD, micro=2, batch=2) if False else
        ds_terapipe.initialize(model=ds_terapipe.TokenPipelineModule(specs, num_stages=WORLD, loss_fn=causal_lm_loss,
                                                                     partition_method="uniform"),
                               config={"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                                       "train_batch_size": 4, "terapipe": dict(plan, enabled=True,
                                                                                vocab_parallel=True)}))
    # a label no shard holds (torch's cross_entropy refuses it): refused before the step, on every rank
    bad = [(x, y.clone()) for x, y in batches[:2]]
    bad[1][1][0, 5] = cfg.vocab_size
    refusals["out_of_vocab"] = _raised(lambda: engine.train_batch(iter(bad)))
    results.append({"case": "vocab refusals", **refusals})
    return results

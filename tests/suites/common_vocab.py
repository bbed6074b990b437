"""What the vocabulary-parallelism suites share (tests/suites/vocab.py, vocab_features.py, vocab_precision.py,
partition.py): the untied seeded head and its reference, the vocabulary-parallel engine, the comparison of each
rank's head shard against its rows of the reference's, and the clipping case.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import ds_terapipe
from deepspeed.pipe import LayerSpec
from ds_terapipe.models.gpt import GPTConfig, GPTReference, causal_lm_loss, gpt_layer_specs, reference_param_name
from tests.suites.common import (CLIP, ENGINE_REF, STATUS, WORLD, clip_result, named_compare, reference_step,
                                 rel_err, replica_batches, train_steps)


class SeededHead(torch.nn.Linear):
    """An untied output layer whose weights depend only on (seed, vocab): the same in every build."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg.hidden, cfg.vocab_size)
        gen = torch.Generator().manual_seed(cfg.seed + 999)
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, generator=gen) * 0.02)
            self.bias.copy_(torch.randn(self.bias.shape, generator=gen) * 0.02)


class UntiedReference(GPTReference):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__(cfg)
        self.head = SeededHead(cfg)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = ids
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def vocab_layer_specs(cfg: GPTConfig, tied: bool) -> list:
    specs = gpt_layer_specs(cfg)
    return specs if tied else specs[:-1] + [LayerSpec(SeededHead, cfg)]


def vocab_reference(cfg: GPTConfig, tied: bool, batches: list[tuple], num_steps: int, lr: float, momentum: float,
                    **clipping: Any):
    return reference_step(cfg, batches, num_steps, lr, momentum,
                          model=GPTReference(cfg) if tied else UntiedReference(cfg), **clipping)


def vocab_clip_case(cfg: GPTConfig, tied: bool, batches: list[tuple], *, stages: int, micro: int,
                    zero_stage: int = 0) -> dict[str, Any]:
    """Gradient clipping with the head's shards on every rank (3 steps of 1f1b over ``batches``, the global
    batch): each shard counts once, and a tied head's shards (copies of rows of the embedding's gradient) not at
    all."""
    dp = WORLD // stages
    ref_norms: list[float] = []
    ref_losses, _, ref_params = vocab_reference(cfg, tied, batches, 3, lr=0.1, momentum=0.9, max_norm=CLIP,
                                                norms=ref_norms)
    STATUS["case"] = f"clip vocab tied={tied} zero={zero_stage}"
    engine = vocab_engine(cfg, tied, {"slices": [8, 24, 16], "seq_len": 48, "schedule": "1f1b"}, stages=stages,
                          micro=micro, batch=2, zero_stage=zero_stage, clipping=CLIP)
    data = iter(replica_batches(batches, engine.grid.data_parallel_id, micro, dp, 3))
    losses, norms = train_steps(engine, data, 3)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return clip_result(STATUS["case"], engine, losses, norms, (ref_losses, ref_norms),
                       vocab_compare(engine, params, ref_params, tied)[:2])


def vocab_compare(engine: Any, named: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
                  tied: bool) -> tuple[float, str, list[str], float]:
    """Worst relative error of this rank's tensors against the reference (the shard against its rows), the names
    covered, and the largest absolute value in the shard's padding rows (must stay 0)."""
    worst, worst_name, covered, pad = 0.0, "", [], 0.0
    for name, value in named.items():
        if name == "tied_modules.embed.wpe.weight" and engine.stage_id != 0:
            continue
        if name.startswith(("vocab_head.", "vocab_embed.")):
            if name.startswith("vocab_embed."):  # the untied input embedding's rows
                head, ref_name = engine.module.vocab_embed, "layers.0.wte.weight"
            else:
                head = engine.module.vocab_head
                ref_name = ("layers.0.wte.weight" if tied else "head.weight") if name.endswith("weight") else \
                    "head.bias"
            rows = slice(head.offset, head.offset + head.num_valid)
            err = rel_err(value[:head.num_valid], ref[ref_name][rows]) if head.num_valid else 0.0
            pad = max(pad, float(value[head.num_valid:].abs().max()) if head.num_valid < head.rows else 0.0)
            covered.append(f"{ref_name}[{head.offset}:{head.offset + head.num_valid}]")
        else:
            ref_name = reference_param_name(name)
            err = rel_err(value, ref[ref_name])
            covered.append(ref_name)
        if err >= worst:
            worst, worst_name = err, name
    return worst, worst_name, covered, pad


def vocab_engine(cfg: GPTConfig, tied: bool, terapipe: dict, *, stages: int, micro: int, batch: int,
                 zero_stage: int = 0, lr: float = 0.1, momentum: float = 0.9, clipping: float = 0.0,
                 extra_config: Optional[dict] = None):
    """A vocabulary-parallel engine; a schedule with virtual stages gets its default chunks per rank (module and
    config alike). ``extra_config``: more DeepSpeed config keys (e.g. ``bf16``)."""
    from ds_terapipe.planner.registry import get_schedule

    v = get_schedule(terapipe.get("schedule", "gpipe")).virtual_stages
    chunks = {"virtual_stages": v, "schedule": terapipe["schedule"]} if v > 1 else {}
    model = ds_terapipe.TokenPipelineModule(vocab_layer_specs(cfg, tied), num_stages=stages, loss_fn=causal_lm_loss,
                                            vocab_size=cfg.vocab_size, partition_method="uniform",
                                            vocab_parallel=terapipe.get("vocab_parallel", True), **chunks)
    dp = WORLD // stages
    config = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": micro,
              "train_batch_size": batch * micro * dp, "steps_per_print": 10**9, "gradient_clipping": clipping,
              "zero_optimization": {"stage": zero_stage},
              "terapipe": dict({"vocab_parallel": True, "granularity": 2, "p2p_timeout_s": 60}, **terapipe,
                               enabled=True)}
    if zero_stage:
        config["zero_allow_untested_optimizer"] = True
    config.update(extra_config or {})
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=opt, config=config)
    ENGINE_REF["engine"] = engine
    return engine


def reference_rows(engine: Any) -> dict[str, tuple[str, Any]]:
    """Under vocabulary parallelism: each row-split parameter's name -> (its table's name in the reference, the
    shard holding this rank's rows), so a shard is compared with the reference's rows (under the pipeline
    module's names, as :func:`tests.suites.common.build_spec_layers` gives them)."""
    module = engine.module
    head = getattr(module, "vocab_head", None)
    if head is None:
        return {}
    spec = head.spec
    owner = f"tied_modules.{spec.tied_key}" if spec.tied_key else str(spec.index)
    names = {"vocab_head.weight": (f"{owner}.{spec.weight_name}", head)}
    if spec.bias_name and head.bias is not None:
        names["vocab_head.bias"] = (f"{owner}.{spec.bias_name}", head)
    split = head.embedding
    if split is not None and not split.tied:
        embed_owner = f"tied_modules.{split.key}" if split.key is not None else str(split.layer)
        names["vocab_embed.weight"] = (f"{embed_owner}.{split.name}", module.vocab_embed)
    return names


def rows_compare(engine: Any, named: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], has_embed: bool
                 ) -> tuple[float, str, list[str]]:
    """:func:`tests.suites.common.named_compare`, the row shards of vocabulary parallelism against the reference's
    rows: the worst relative error, its name, and the reference names compared (a shard as its table's name)."""
    split = reference_rows(engine)
    plain = {n: t for n, t in named.items() if n not in split}
    worst, worst_name, _ = named_compare(plain, ref, has_embed)
    covered = [n for n in plain if has_embed or n != "tied_modules.embed.wpe.weight"]
    for name, (table, shard) in split.items():
        if name in named and shard.num_valid:
            rows = slice(shard.offset, shard.offset + shard.num_valid)
            err = rel_err(named[name][:shard.num_valid], ref[table][rows])
            covered.append(table)
            if err >= worst:
                worst, worst_name = err, f"{name} (rows {rows.start}:{rows.stop} of {table})"
    return worst, worst_name, covered

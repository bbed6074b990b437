"""Suite ``hf`` (standalone, 2 ranks), asserted on by tests/test_hf.py: ``python tests/dist_worker.py hf OUT_DIR {}``
(env: RANK, WORLD_SIZE, ...).

A Llama model with grouped-query attention, built from a config by ``causal_lm_specs``, runs one training step
through ``ds_terapipe.initialize`` on 2 stages (slices [3, 9, 4]; 1f1b, then gpipe with deferred weight
gradients). The reference is ``transformers``' own LlamaForCausalLM with the pipeline's weights, gathered from
both ranks, on the same batches. Writes ``OUT_DIR/rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import transformers

import ds_terapipe
from ds_terapipe.models.hf import causal_lm_loss, causal_lm_specs, hf_param_name
from tests.suites import suite

RANK = int(os.environ["RANK"])
SEQ_LEN, BATCH, MICRO_BATCHES = 16, 2, 2


def tiny_llama() -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                    max_position_embeddings=64)


def batches(vocab: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (MICRO_BATCHES, BATCH, SEQ_LEN + 1), generator=gen)
    return [(ids[b, :, :-1].contiguous(), ids[b, :, 1:].contiguous()) for b in range(MICRO_BATCHES)]


def _head_name(config: transformers.LlamaConfig) -> str:
    """The reference's name of the output weight the vocabulary shards hold rows of."""
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def _pipe_name(name: str, config: transformers.LlamaConfig) -> str:
    if name == "vocab_embed.weight":   # the untied input embedding's rows
        return "model.embed_tokens.weight"
    return _head_name(config) if name == "vocab_head.weight" else hf_param_name(name, config)


def run_case(config: transformers.LlamaConfig, schedule: str, vocab_parallel: bool = False) -> dict[str, Any]:
    model = ds_terapipe.TokenPipelineModule(causal_lm_specs(config, seed=5), num_stages=2, loss_fn=causal_lm_loss,
                                            vocab_size=config.vocab_size, partition_method="uniform",
                                            vocab_parallel=vocab_parallel)
    ds_config = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": MICRO_BATCHES,
                 "train_batch_size": BATCH * MICRO_BATCHES, "steps_per_print": 10**9, "gradient_clipping": 0.0,
                 "terapipe": {"enabled": True, "seq_len": SEQ_LEN, "slices": [3, 9, 4], "granularity": 1,
                              "schedule": schedule, "p2p_timeout_s": 60, "vocab_parallel": vocab_parallel}}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    engine, _, _, _ = ds_terapipe.initialize(model=model, optimizer=optimizer, config=ds_config)
    head = engine.module.vocab_head
    rows = slice(head.offset, head.offset + head.num_valid) if head is not None else slice(None)
    split = ("vocab_head.weight", "vocab_embed.weight")   # the shards (rows of a table) by parameter name

    # The reference: transformers' model with the pipeline's initial weights, gathered from both stages (with
    # vocabulary parallelism, the output weight, and an untied split embedding's table, from the shards' rows, in
    # rank order).
    named = dict(engine.module.named_parameters())
    mine = {hf_param_name(n, config): p.detach().clone() for n, p in named.items() if n not in split}
    shards = {n: named[n].detach()[:head.num_valid].clone() for n in split if n in named}
    parts: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, (mine, shards))
    weights = {k: v for part, _ in parts for k, v in part.items()}
    for name in shards:
        weights[_pipe_name(name, config)] = torch.cat([s[name] for _, s in parts])
    reference = transformers.LlamaForCausalLM(config)
    reference.load_state_dict(weights, strict=False)
    assert not set(weights) ^ {n for n, _ in reference.named_parameters()}, "the gathered weights are the model's"
    data = batches(config.vocab_size)
    ref_loss = sum(causal_lm_loss(reference(input_ids=x).logits, y) for x, y in data) / len(data)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    grads: dict[str, torch.Tensor] = {}
    original = engine._take_model_step

    def snapshot_then_step(*args: Any, **kwargs: Any) -> Any:
        grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None})
        return original(*args, **kwargs)

    engine._take_model_step = snapshot_then_step
    loss = float(engine.train_batch(iter(data)))
    engine._take_model_step = original
    worst, worst_name = 0.0, ""
    for name, grad in grads.items():
        ref = ref_grads[_pipe_name(name, config)]
        if name in split:   # this rank's rows
            grad, ref = grad[:head.num_valid], ref[rows]
        err = float((grad - ref).norm() / max(float(ref.norm()), 1e-12))
        if err >= worst:
            worst, worst_name = err, name
    return {"schedule": schedule, "vocab_parallel": vocab_parallel, "tied": bool(config.tie_word_embeddings),
            "stage": engine.stage_id, "loss": loss, "ref_loss": float(ref_loss.detach()),
            "grad_rel_err": worst, "grad_worst": worst_name,
            "covered": sorted(_pipe_name(n, config) for n in grads), "slices": list(engine.slices),
            "all_params": sorted(n for n, _ in reference.named_parameters())}


@suite("hf", standalone=True)
def suite_hf(out_dir: Path, extra: dict) -> None:
    torch.manual_seed(0)
    ds_terapipe.init_distributed(dist_backend="gloo")
    config = tiny_llama()
    config._attn_implementation = "eager"  # the reference's attention; the pipeline's specs use their own
    all_params = sorted(n for n, _ in transformers.LlamaForCausalLM(config).named_parameters())
    payload: dict[str, Any] = {"rank": RANK, "cases": [], "all_params": all_params}
    code = 0
    try:
        for schedule in ("1f1b", "gpipe"):
            payload["cases"].append(run_case(config, schedule))
        # vocabulary parallelism: the untied lm_head recognised by its structure, and the tied one (its input
        # embedding split with it)
        payload["cases"].append(run_case(config, "1f1b", vocab_parallel=True))
        tied = tiny_llama()
        tied.tie_word_embeddings = True
        tied._attn_implementation = "eager"
        payload["cases"].append(run_case(tied, "gpipe", vocab_parallel=True))
    except Exception as err:  # the test prints this; the peer fails on its p2p deadline or the launcher's kill
        payload["error"] = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        print(payload["error"], flush=True)
        code = 1
    (out_dir / f"rank{RANK}.json").write_text(json.dumps(payload, indent=1))
    sys.stdout.flush()
    if code == 0:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    os._exit(code)
